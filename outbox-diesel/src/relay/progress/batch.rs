//! A batch: the statement that reads a partition's next rows, late rows and released rows at
//! a cursor, and what it sets aside behind a parked row.

use std::collections::HashSet;

use diesel::sql_types::{Array, BigInt, Bool, Integer, Nullable, Text};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;

use super::super::rows::OutboxRowText;
use super::super::{OutboxRow, Partition};
use super::statement::{Binds, behind_sql};
use super::{Cursor, LatePass};

/// Where a fetched row came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// After the cursor's `seq`.
    Next,
    /// At or below it, of a transaction its snapshot did not see.
    Late,
    /// Released by `retry` after the cursor had passed it: marked `published_at` once acked
    /// (see [`mark_released`]).
    Released,
}

/// A batch of a partition: its rows in `seq` order, and the cursor once they are published.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// The rows to publish, in `seq` order (held-back ones left out).
    pub rows: Vec<(OutboxRow, Source)>,
    /// The cursor after this batch (the same as before when nothing was read).
    pub next: Cursor,
    /// Rows read and set aside behind a parked row of their aggregate (see
    /// [`hold_back`](crate::relay::hold_back)).
    pub held: usize,
}

impl Batch {
    /// A batch with no row, after which the partition's cursor is `next`.
    pub fn empty(next: Cursor) -> Self {
        Batch {
            rows: Vec::new(),
            next,
            held: 0,
        }
    }
}

#[derive(QueryableByName)]
struct Fetched {
    #[diesel(embed)]
    event: OutboxRowText,
    /// 0 next, 1 late, 2 released (3: the snapshot, [`SNAPSHOT_PART`](super::statement::SNAPSHOT_PART))
    #[diesel(sql_type = Integer)]
    part: i32,
    /// The row's partition (`aggregate_hash % count`).
    #[diesel(sql_type = Integer)]
    p: i32,
    /// 0: no earlier row of the aggregate is parked, held or released; 1: one is
    /// parked or held; 2: only released ones
    #[diesel(sql_type = Integer)]
    behind: i32,
    /// A late row: how many late rows its partition has (the statement returns those within
    /// the batch's limits); 0 for the others.
    #[diesel(sql_type = BigInt)]
    late_total: i64,
    /// The statement's snapshot, on its last row only, which carries no event
    /// ([`SNAPSHOT_PART`](super::statement::SNAPSHOT_PART)).
    #[diesel(sql_type = Nullable<Text>)]
    snap: Option<String>,
}

/// Reads the next batch of `partition` after `cursor`: [`fetch_batches`] for one partition.
pub async fn fetch_batch(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partition: Partition,
    cursor: &Cursor,
    exclude: &[i64],
    limit: i64,
    max_bytes: i64,
) -> QueryResult<Batch> {
    let mut batches = fetch_batches(
        conn,
        table,
        partition.count,
        &[(partition.index, cursor.clone())],
        exclude,
        limit,
        max_bytes,
    )
    .await?;
    Ok(batches
        .pop()
        .map(|(_, b)| b)
        .unwrap_or_else(|| Batch::empty(cursor.clone())))
}

/// The most partitions [`fetch_batches_in`] reads by the partition index in one statement: each
/// is a walk of the index of its own, merged with the others by `seq`, and PostgreSQL plans
/// them all once per session (64: 6 ms and 2.6 MB of cached plan; 1,024 took 450 ms and
/// 43 MB). A relay that reads more walks the `ready` index, as without the partition index.
pub const MAX_PARTITIONS_BY_INDEX: usize = 64;

/// How a relay's partitions are cut: how many there are, and whether the table has the
/// partition index of that count ([`create_partition_index`](crate::create_partition_index)),
/// which [`fetch_batches_in`] then reads each partition by when the relay reads some of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partitioning {
    /// The partition count (`--partitions`).
    pub count: u32,
    /// Whether the table has the partition index of `count` (see [`has_partition_index`]).
    pub indexed: bool,
}

impl Partitioning {
    /// `count` partitions, read through the table's `ready` index alone.
    pub fn new(count: u32) -> Self {
        Partitioning {
            count,
            indexed: false,
        }
    }

    /// With `indexed`, each partition the relay reads is read by the partition index.
    pub fn indexed(self, indexed: bool) -> Self {
        Partitioning { indexed, ..self }
    }
}

/// Whether `table` has a valid partition index for `count` partitions (named as
/// [`partition_index_name`](crate::partition_index_name) says; not one left invalid by a build
/// that did not finish).
pub async fn has_partition_index(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    count: u32,
) -> QueryResult<bool> {
    if count < 2 {
        return Ok(false);
    }
    // once a second per relay: prepared once per session
    let found: super::super::Flag = super::super::prepared::Prepared {
        pieces: &[
            "SELECT EXISTS (SELECT 1 FROM pg_index i WHERE i.indexrelid = to_regclass(",
            ") AND i.indrelid = to_regclass(",
            ") AND i.indisvalid AND i.indisready) AS flag",
        ],
        binds: &[&crate::partition_index_name(table, count), &table.quoted()],
    }
    .get_result(conn)
    .await?;
    Ok(found.flag == Some(true))
}

/// Reads the next batch of each of `cursors`' partitions (of `count`) in one statement: up
/// to `limit` rows after the lowest cursor in one walk through those partitions (and while
/// their payloads stay under `max_bytes`, the first always), the late rows of each within the
/// same limits, and up to `limit` released rows other than `exclude` (those the caller holds).
/// Returns a batch per partition, in the order of `cursors`. [`fetch_batches_in`] without the
/// partition index.
///
/// Rows of an aggregate with an earlier parked or held row are set aside (`parked_at =
/// '-infinity'`), rows of an aggregate whose earlier rows were released join them
/// (`'infinity'`): neither is returned. Each partition's cursor moves to the end of the walk:
/// the walk read every row of every one of them up to there.
///
/// A partition with more late rows than the limits let through is read in a [`LatePass`]:
/// its batch holds the first of them, its cursor keeps its place and carries the pass, and
/// the next calls read the rest in parts, its next rows waiting, until the pass ends and the
/// cursor takes the pass's snapshot. Traced as the span `outbox.claim`.
pub async fn fetch_batches(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    count: u32,
    cursors: &[(u32, Cursor)],
    exclude: &[i64],
    limit: i64,
    max_bytes: i64,
) -> QueryResult<Vec<(u32, Batch)>> {
    fetch_batches_in(
        conn,
        table,
        Partitioning::new(count),
        cursors,
        exclude,
        limit,
        max_bytes,
    )
    .await
}

/// [`fetch_batches`] for partitions cut as `partitioning` says. With the partition index, a
/// relay that reads some of the partitions (at most [`MAX_PARTITIONS_BY_INDEX`]; more are read
/// as without it), or reads them at different cursors, reads each one by that index from its
/// own cursor, their rows merged in `seq` order within `limit` and `max_bytes` as one walk's
/// would be, and no row of the partitions it does not read: a busy partition among quiet ones
/// fills the batch.
#[tracing::instrument(name = "outbox.claim", level = "debug", skip_all, fields(outbox.table = %table, outbox.partitions = cursors.len()))]
pub async fn fetch_batches_in(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partitioning: Partitioning,
    cursors: &[(u32, Cursor)],
    exclude: &[i64],
    limit: i64,
    max_bytes: i64,
) -> QueryResult<Vec<(u32, Batch)>> {
    read_batches_in(
        conn,
        table,
        partitioning,
        cursors,
        exclude,
        limit,
        max_bytes,
    )
    .await
    .map(|read| read.batches)
}

/// What one statement of [`fetch_batches_in`] read.
pub(super) struct Read {
    /// A batch per partition, in the order of the cursors.
    pub(super) batches: Vec<(u32, Batch)>,
    /// The statement's snapshot (none when no statement ran: no cursor).
    pub(super) snapshot: Option<String>,
    /// Whether the statement returned any row (held back ones too).
    pub(super) found: bool,
}

/// [`fetch_batches_in`], with the statement's snapshot and whether it found anything.
pub(super) async fn read_batches_in(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partitioning: Partitioning,
    cursors: &[(u32, Cursor)],
    exclude: &[i64],
    limit: i64,
    max_bytes: i64,
) -> QueryResult<Read> {
    if cursors.is_empty() {
        return Ok(Read {
            batches: Vec::new(),
            snapshot: None,
            found: false,
        });
    }
    let count = partitioning.count;
    let binds = Binds::of(count, cursors, partitioning.indexed);
    let mut fetched: Vec<Fetched> = binds
        .statement(table, count, "", exclude, limit, max_bytes)
        .load(conn)
        .await?;
    // the statement's snapshot, when it returned a row; with none, nothing was there to read:
    // a late pass has ended, the other cursors stay
    let snapshot = fetched
        .iter()
        .rposition(|f| f.part == super::statement::SNAPSHOT_PART)
        .map(|i| fetched.swap_remove(i).snap);
    let statement_snapshot = snapshot.flatten();
    let found = !fetched.is_empty();
    let snap = statement_snapshot.clone().filter(|_| found);
    // how far the walk went: every row of the walked partitions up to there that `snap` sees
    // (returned, or at or below its own partition's cursor)
    let walked = fetched
        .iter()
        .filter(|f| f.part == 0)
        .map(|f| f.event.seq())
        .max();
    // per partition: the late rows returned, their highest `seq`, and how many there are
    let mut late: std::collections::HashMap<i32, (i64, i64, i64)> = Default::default();
    for f in fetched.iter().filter(|f| f.part == 1) {
        let e = late.entry(f.p).or_insert((0, i64::MIN, f.late_total));
        e.0 += 1;
        e.1 = e.1.max(f.event.seq());
    }
    let mut batches: Vec<(u32, Batch)> = Vec::with_capacity(cursors.len());
    // the partitions whose late rows did not all fit: their next rows wait for the pass
    let mut passing: HashSet<i32> = HashSet::new();
    for (p, c) in cursors {
        let (returned, highest, total) = late.get(&(*p as i32)).copied().unwrap_or((0, 0, 0));
        let next = match (&c.late, &snap) {
            // late rows left over (so a row came back, and with it the snapshot): a pass
            (pass, Some(snap)) if returned < total => {
                passing.insert(*p as i32);
                let snap = pass.as_ref().map_or(snap, |pass| &pass.snap);
                Cursor {
                    upto_seq: c.upto_seq,
                    snap: c.snap.clone(),
                    late: Some(LatePass {
                        after_seq: highest,
                        snap: snap.clone(),
                    }),
                }
            }
            // the pass has read every late row its snapshot sees
            (Some(pass), _) => Cursor::at(c.upto_seq, pass.snap.clone()),
            (None, Some(snap)) => {
                Cursor::at(walked.unwrap_or(c.upto_seq).max(c.upto_seq), snap.clone())
            }
            (None, None) => c.clone(),
        };
        batches.push((*p, Batch::empty(next)));
    }
    let fetched: Vec<Fetched> = fetched
        .into_iter()
        .filter(|f| !(f.part == 0 && passing.contains(&f.p)))
        .collect();
    // rows behind a parked, held or released row of their aggregate: decided again under the
    // lock that orders holding and retrying
    let behind: Vec<i64> = fetched
        .iter()
        .filter(|f| f.behind == 1 || (f.behind == 2 && f.part != 2))
        .map(|f| f.event.seq())
        .collect();
    let set_aside = if behind.is_empty() {
        Vec::new()
    } else {
        set_aside(conn, table, &behind).await?
    };
    let aside: HashSet<i64> = set_aside
        .iter()
        .filter(|s| s.held || s.joined)
        .map(|s| s.seq)
        .collect();
    let held: HashSet<i64> = set_aside.iter().filter(|s| s.held).map(|s| s.seq).collect();
    let index: std::collections::HashMap<i32, usize> = batches
        .iter()
        .enumerate()
        .map(|(i, (p, _))| (*p as i32, i))
        .collect();
    for f in fetched {
        let Some(&i) = index.get(&f.p) else {
            continue;
        };
        let batch = &mut batches[i].1;
        let seq = f.event.seq();
        if aside.contains(&seq) {
            batch.held += usize::from(held.contains(&seq));
            continue;
        }
        let source = match f.part {
            0 => Source::Next,
            1 => Source::Late,
            _ => Source::Released,
        };
        batch.rows.push((f.event.into(), source));
    }
    for (_, batch) in &mut batches {
        batch.rows.sort_by_key(|(r, _)| r.seq);
    }
    Ok(Read {
        batches,
        snapshot: statement_snapshot,
        found,
    })
}

/// [`fetch_batch`]'s statement run with `EXPLAIN (ANALYZE, BUFFERS)` at `cursor` (with its late
/// pass, if any): the plan with the rows and buffers each node read (nothing is held back or
/// recorded). [`explain_batches_analyze`] for one partition.
pub async fn explain_batch_analyze(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partition: Partition,
    cursor: &Cursor,
    limit: i64,
) -> QueryResult<Vec<String>> {
    explain_batches_analyze(
        conn,
        table,
        partition.count,
        &[(partition.index, cursor.clone())],
        limit,
    )
    .await
}

/// [`fetch_batches`]'s statement for `cursors` of partitions of `count`, run with `EXPLAIN
/// (ANALYZE, BUFFERS)` as the relay runs it (the same prepared statement, so after five calls
/// the plan PostgreSQL keeps): the plan with the rows and buffers each node read (nothing is
/// held back or recorded).
pub async fn explain_batches_analyze(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    count: u32,
    cursors: &[(u32, Cursor)],
    limit: i64,
) -> QueryResult<Vec<String>> {
    explain_batches_analyze_in(conn, table, Partitioning::new(count), cursors, limit).await
}

/// [`explain_batches_analyze`] for partitions cut as `partitioning` says (the statement of
/// [`fetch_batches_in`]).
pub async fn explain_batches_analyze_in(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partitioning: Partitioning,
    cursors: &[(u32, Cursor)],
    limit: i64,
) -> QueryResult<Vec<String>> {
    let count = partitioning.count;
    let binds = Binds::of(count, cursors, partitioning.indexed);
    let lines: Vec<super::super::poll::PlanLine> = binds
        .statement(
            table,
            count,
            "EXPLAIN (ANALYZE, BUFFERS) ",
            &[],
            limit,
            i64::MAX,
        )
        .load(conn)
        .await?;
    Ok(lines.into_iter().map(|l| l.line).collect())
}

#[derive(QueryableByName)]
struct SetAside {
    #[diesel(sql_type = BigInt)]
    seq: i64,
    /// behind a parked or held row: `'-infinity'`
    #[diesel(sql_type = Bool)]
    held: bool,
    /// behind released rows only: `'infinity'`, published after them
    #[diesel(sql_type = Bool)]
    joined: bool,
}

/// Under the lock that orders holding and retrying: a row behind a parked or held row of its
/// aggregate is held (`'-infinity'`), one behind released rows only joins them
/// (`'infinity'`); the others are left as they are (a retry released their aggregate).
async fn set_aside(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seqs: &[i64],
) -> QueryResult<Vec<SetAside>> {
    let t = table.quoted();
    conn.transaction(async |conn| {
        super::super::parking::lock_holds(conn, table).await?;
        diesel::sql_query(format!(
            "WITH b AS (SELECT o.seq, {} AS behind \
             FROM {t} o WHERE o.seq = ANY($1) AND o.published_at IS NULL) \
             UPDATE {t} o SET parked_at = CASE WHEN b.behind = 1 THEN '-infinity'::timestamptz \
             ELSE 'infinity'::timestamptz END FROM b WHERE o.seq = b.seq AND b.behind > 0 \
             AND NOT (b.behind = 2 AND o.parked_at = 'infinity') \
             RETURNING o.seq, b.behind = 1 AS held, b.behind = 2 AS joined",
            behind_sql(table)
        ))
        .bind::<Array<BigInt>, _>(seqs)
        .load(conn)
        .await
    })
    .await
}

/// Marks the released rows `seqs` published once acked (`published_at = now()`, no longer
/// released); returns how many.
pub async fn mark_released(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seqs: &[i64],
) -> QueryResult<usize> {
    if seqs.is_empty() {
        return Ok(0);
    }
    diesel::sql_query(format!(
        "UPDATE {} SET published_at = now(), parked_at = NULL WHERE seq = ANY($1) \
         AND parked_at = 'infinity'",
        table.quoted()
    ))
    .bind::<Array<BigInt>, _>(seqs)
    .execute(conn)
    .await
}
