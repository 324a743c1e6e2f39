//! Snapshot batches: how the ordered relay reads its partitions and records what it published
//! without a write per row.
//!
//! Every row carries the id of the transaction that inserted it (`txid`, `xid8`). Per
//! partition, the relay keeps a [`Cursor`]: the highest `seq` it has read, `W`, and the snapshot
//! `S` it read at. What it has read is exactly the rows with `seq <= W` that `S` sees. A batch
//! runs one statement, whose snapshot `cur` becomes the next `S`, and reads:
//!
//! - the next rows after `W`, in `seq` order (the poll's index), up to the batch size;
//! - the late rows: `seq <= W` but not seen by `S`, so inserted by a transaction in progress at
//!   `S` (its `xip` list) or begun after it (at or above its `xmax`). They are found by
//!   transaction id (the index `outbox_txid`), so a transaction held open for an hour costs a
//!   lookup of its id, not a rescan of everything recorded since it began (PgQ's batches);
//! - the rows `outbox-relay retry` released after the relay had read past them
//!   (`parked_at = 'infinity'`, the index `outbox_released`).
//!
//! The new cursor is `(max seq read, cur)`: every row at or below it that `cur` sees was read,
//! either before (seen by `S`) or now. After the acks, the relay records the cursor with one
//! `INSERT` per batch into `<table>_progress`; nothing is written per row. The view
//! `<table>_audit` answers `published_at` for the rows a cursor covers (the time of the first
//! batch that covered the row), and cleanup deletes the rows a cursor covered a retention ago.
//!
//! Late commits are never skipped, whatever the order of `seq` and commits: a committed row is
//! read by the first batch whose snapshot sees it. Two transactions of one aggregate serialised
//! by a lock commit in `seq` order, and the first is seen by every snapshot that sees the
//! second: the first is read in the same batch (rows go out in `seq` order) or an earlier one.

use std::collections::HashSet;

use diesel::sql_types::{Array, BigInt, Bool, Integer, Nullable, Text};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;

use super::{OutboxRow, Partition};

/// Where a partition's reading stands: every row with `seq <= upto_seq` that the snapshot
/// `snap` sees has been read.
#[derive(Debug, Clone, PartialEq, Eq, QueryableByName)]
pub struct Cursor {
    /// The highest `seq` read.
    #[diesel(sql_type = BigInt)]
    pub upto_seq: i64,
    /// The snapshot the rows were read at, as PostgreSQL writes a `pg_snapshot`
    /// (`xmin:xmax:xip,…`).
    #[diesel(sql_type = Text)]
    pub snap: String,
}

impl Cursor {
    /// A partition nothing was read from: no `seq` at or below 0, a snapshot that sees nothing.
    pub fn start() -> Cursor {
        Cursor {
            upto_seq: 0,
            snap: "1:1:".to_owned(),
        }
    }
}

fn progress_table(table: &OutboxTable) -> String {
    table.progress_table()
}

/// `c`: the last cursor of every partition of the newest partition count in the progress
/// table (a partition not read yet: [`Cursor::start`]); no row when nothing was recorded.
pub(crate) fn cursors_cte(table: &OutboxTable) -> String {
    let p = progress_table(table);
    format!(
        "c AS MATERIALIZED (SELECT m.n AS partitions, g.p AS partition, \
         COALESCE(l.upto_seq, 0) AS upto_seq, COALESCE(l.snap, '1:1:'::pg_snapshot) AS snap, \
         l.published_at \
         FROM (SELECT partitions AS n FROM {p} ORDER BY id DESC LIMIT 1) m \
         CROSS JOIN generate_series(0, m.n - 1) AS g(p) \
         LEFT JOIN LATERAL (SELECT upto_seq, snap, published_at FROM {p} \
         WHERE partitions = m.n AND partition = g.p ORDER BY id DESC LIMIT 1) l ON true)"
    )
}

/// Whether row `o` was read by its partition's cursor in `c` (see [`cursors_cte`]).
pub(crate) const COVERED: &str = "EXISTS (SELECT 1 FROM c WHERE o.aggregate_hash % c.partitions \
     = c.partition AND o.seq <= c.upto_seq AND pg_visible_in_snapshot(o.txid, c.snap))";

/// Whether `table` has what snapshot batches need: its `txid` column and its progress table.
/// A table made before them gets both from [`create_table`](crate::create_table) or the
/// migrations.
pub async fn has_progress(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<bool> {
    let f: super::Flag = diesel::sql_query(
        "SELECT to_regclass($1) IS NOT NULL AND EXISTS (SELECT 1 FROM pg_attribute \
         WHERE attrelid = to_regclass($2) AND attname = 'txid' AND NOT attisdropped) AS flag",
    )
    .bind::<Text, _>(progress_table(table))
    .bind::<Text, _>(table.quoted())
    .get_result(conn)
    .await?;
    Ok(f.flag.unwrap_or(false))
}

/// The last recorded cursor of `partition`, if any.
pub async fn load_cursor(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partition: Partition,
) -> QueryResult<Option<Cursor>> {
    let rows: Vec<Cursor> = diesel::sql_query(format!(
        "SELECT upto_seq, snap::text AS snap FROM {} WHERE partitions = $1 AND partition = $2 \
         ORDER BY id DESC LIMIT 1",
        progress_table(table)
    ))
    .bind::<Integer, _>(partition.count as i32)
    .bind::<Integer, _>(partition.index as i32)
    .load(conn)
    .await?;
    Ok(rows.into_iter().next())
}

/// The first key of the transaction advisory lock that serialises changing a table's
/// partition count in its progress (the second is the table's OID): `'OBPC'` in ASCII.
pub const PROGRESS_LOCK_KEY: i32 = 0x4F42_5043;

/// Where `partition` goes on from: its last recorded cursor; when it has none and the
/// progress was recorded under another partition count, every partition of the new count
/// starts from what all the old ones read (the lowest `seq`, a snapshot that sees only what
/// every old snapshot sees), and the rows an old cursor read beyond that start are marked
/// `published_at` once, so that none is published again; otherwise [`Cursor::start`].
///
/// Relays of one table agree on the partition count before they read (see
/// [`AdvisoryLock::PartitionCount`](super::AdvisoryLock::PartitionCount)).
pub async fn start_cursor(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partition: Partition,
) -> QueryResult<Cursor> {
    if let Some(c) = load_cursor(conn, table, partition).await? {
        return Ok(c);
    }
    let t = table.quoted();
    let p = progress_table(table);
    let cte = cursors_cte(table);
    conn.transaction(async |conn| {
        diesel::sql_query(format!(
            "SELECT pg_advisory_xact_lock({PROGRESS_LOCK_KEY}, to_regclass($1)::oid::int)"
        ))
        .bind::<Text, _>(t.clone())
        .execute(conn)
        .await?;
        if let Some(c) = load_cursor(conn, table, partition).await? {
            // another relay of the new count moved the progress meanwhile
            return Ok(c);
        }
        #[derive(QueryableByName)]
        struct Newest {
            #[diesel(sql_type = Nullable<Integer>)]
            n: Option<i32>,
        }
        let newest: Newest = diesel::sql_query(format!(
            "SELECT (SELECT partitions FROM {p} ORDER BY id DESC LIMIT 1) AS n"
        ))
        .get_result(conn)
        .await?;
        let Some(old) = newest.n.filter(|&n| n != partition.count as i32) else {
            return Ok(Cursor::start());
        };
        // the start every new partition shares: the lowest seq, and a snapshot that sees a
        // transaction only when every old one does
        let start: Cursor = diesel::sql_query(format!(
            "WITH {cte}, lim AS (SELECT min(upto_seq) AS w, min(pg_snapshot_xmin(snap)) AS xmin, \
             min(pg_snapshot_xmax(snap)) AS xmax FROM c) \
             SELECT lim.w AS upto_seq, (lim.xmin::text || ':' || lim.xmax::text || ':' || \
             COALESCE((SELECT string_agg(x::text, ',' ORDER BY x) FROM (SELECT DISTINCT x \
             FROM c, pg_snapshot_xip(c.snap) AS x WHERE x < lim.xmax) d), ''))::pg_snapshot::text \
             AS snap FROM lim"
        ))
        .get_result(conn)
        .await?;
        // what an old cursor read and the shared start does not cover: marked, once
        let marked = diesel::sql_query(format!(
            "WITH {cte} UPDATE {t} o SET published_at = now() \
             WHERE o.published_at IS NULL AND o.parked_at IS NULL AND {COVERED} \
             AND (o.seq > $1 OR o.txid = ANY(ARRAY(SELECT pg_snapshot_xip($2::pg_snapshot))) \
             OR o.txid >= pg_snapshot_xmax($2::pg_snapshot))"
        ))
        .bind::<BigInt, _>(start.upto_seq)
        .bind::<Text, _>(&start.snap)
        .execute(conn)
        .await?;
        diesel::sql_query(format!(
            "INSERT INTO {p} (partitions, partition, upto_seq, snap) \
             SELECT $1, g, $2, $3::pg_snapshot FROM generate_series(0, $1 - 1) AS g"
        ))
        .bind::<Integer, _>(partition.count as i32)
        .bind::<BigInt, _>(start.upto_seq)
        .bind::<Text, _>(&start.snap)
        .execute(conn)
        .await?;
        tracing::info!(
            from_partitions = old,
            to_partitions = partition.count,
            marked,
            "progress moved to the new partition count"
        );
        Ok(start)
    })
    .await
}

/// Records the cursors of a batch, one row per partition; the last one of a partition is where
/// its next owner goes on from. Traced as the span `outbox.mark`.
#[tracing::instrument(name = "outbox.mark", level = "debug", skip_all, fields(outbox.table = %table, outbox.partitions = cursors.len()))]
pub async fn record_progress(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    cursors: &[(Partition, Cursor)],
) -> QueryResult<()> {
    if cursors.is_empty() {
        return Ok(());
    }
    let counts: Vec<i32> = cursors.iter().map(|(p, _)| p.count as i32).collect();
    let indexes: Vec<i32> = cursors.iter().map(|(p, _)| p.index as i32).collect();
    let seqs: Vec<i64> = cursors.iter().map(|(_, c)| c.upto_seq).collect();
    let snaps: Vec<&str> = cursors.iter().map(|(_, c)| c.snap.as_str()).collect();
    diesel::sql_query(format!(
        "INSERT INTO {} (partitions, partition, upto_seq, snap) \
         SELECT n, i, s, x::pg_snapshot FROM unnest($1::int[], $2::int[], $3::bigint[], $4::text[]) \
         AS u(n, i, s, x)",
        progress_table(table)
    ))
    .bind::<Array<Integer>, _>(counts)
    .bind::<Array<Integer>, _>(indexes)
    .bind::<Array<BigInt>, _>(seqs)
    .bind::<Array<Text>, _>(snaps)
    .execute(conn)
    .await
    .map(drop)
}

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
    /// [`hold_back`](super::hold_back)).
    pub held: usize,
}

/// Whether an earlier row of row `o`'s aggregate is parked or held (1), or only released
/// ones are waiting (2), or none (0). Each test stops at the first row it finds, so a row
/// costs the same however many rows of its aggregate wait.
fn behind_sql(table: &OutboxTable) -> String {
    let t = table.quoted();
    let earlier = format!(
        "FROM {t} p WHERE p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id \
         AND p.parked_at IS NOT NULL AND p.published_at IS NULL AND p.seq < o.seq"
    );
    format!(
        "CASE WHEN EXISTS (SELECT 1 {earlier} AND p.parked_at < 'infinity') THEN 1 \
         WHEN EXISTS (SELECT 1 {earlier} AND p.parked_at = 'infinity') THEN 2 ELSE 0 END"
    )
}

#[derive(QueryableByName)]
struct Fetched {
    #[diesel(embed)]
    event: OutboxRow,
    /// 0 next, 1 late, 2 released
    #[diesel(sql_type = Integer)]
    part: i32,
    /// 0: no earlier row of the aggregate is parked, held or released; 1: one is parked or
    /// held; 2: only released ones
    #[diesel(sql_type = Integer)]
    behind: i32,
    #[diesel(sql_type = Text)]
    snap: String,
}

/// Reads the next batch of `partition` after `cursor`: up to `limit` rows after it (and while
/// their payloads stay under `max_bytes`, the first always), every late row, and up to
/// `limit` released rows other than `exclude` (those the caller holds). Rows of an aggregate
/// with an earlier parked or held row are set aside (`parked_at = '-infinity'`), rows of an
/// aggregate whose earlier rows were released join them (`'infinity'`): neither is returned.
/// Traced as the span `outbox.claim`.
#[tracing::instrument(name = "outbox.claim", level = "debug", skip_all, fields(outbox.table = %table, outbox.partition = partition.index))]
pub async fn fetch_batch(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partition: Partition,
    cursor: &Cursor,
    exclude: &[i64],
    limit: i64,
    max_bytes: i64,
) -> QueryResult<Batch> {
    let sql = batch_sql(table, partition);
    let fetched: Vec<Fetched> = diesel::sql_query(sql)
        .bind::<BigInt, _>(cursor.upto_seq)
        .bind::<Text, _>(&cursor.snap)
        .bind::<BigInt, _>(limit)
        .bind::<BigInt, _>(max_bytes)
        .bind::<Array<BigInt>, _>(exclude)
        .load(conn)
        .await?;
    let Some(snap) = <[Fetched]>::first(&fetched).map(|f| f.snap.clone()) else {
        return Ok(Batch {
            rows: Vec::new(),
            next: cursor.clone(),
            held: 0,
        });
    };
    let upto_seq = fetched
        .iter()
        .filter(|f| f.part == 0)
        .map(|f| f.event.seq)
        .max()
        .unwrap_or(cursor.upto_seq)
        .max(cursor.upto_seq);
    // rows behind a parked, held or released row of their aggregate: decided again under the
    // lock that orders holding and retrying
    let behind: Vec<i64> = fetched
        .iter()
        .filter(|f| f.behind == 1 || (f.behind == 2 && f.part != 2))
        .map(|f| f.event.seq)
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
    let mut rows: Vec<(OutboxRow, Source)> = fetched
        .into_iter()
        .filter(|f| !aside.contains(&f.event.seq))
        .map(|f| {
            let source = match f.part {
                0 => Source::Next,
                1 => Source::Late,
                _ => Source::Released,
            };
            (f.event, source)
        })
        .collect();
    rows.sort_by_key(|(r, _)| r.seq);
    let held = set_aside.iter().filter(|s| s.held).count();
    Ok(Batch {
        rows,
        next: Cursor { upto_seq, snap },
        held,
    })
}

/// The statement of [`fetch_batch`] for `partition` of `table`; its binds: the cursor's `seq`
/// and snapshot, the row limit, the byte budget, the released rows to leave out.
fn batch_sql(table: &OutboxTable, partition: Partition) -> String {
    const COLUMNS: &str = "o.seq, o.id, o.aggregate_type, o.aggregate_id, o.event_type, \
                           o.payload, o.headers, o.created_at, o.attempts";
    let t = table.quoted();
    let part = if partition.count > 1 {
        // the count is a literal: each partition count gets its own cached plan
        format!(
            " AND o.aggregate_hash % {} = {}",
            partition.count, partition.index
        )
    } else {
        String::new()
    };
    let behind = behind_sql(table);
    format!(
        "WITH cur AS MATERIALIZED (SELECT pg_current_snapshot() AS s) \
         SELECT {COLUMNS}, o.part, {behind} AS behind, \
         (SELECT s::text FROM cur) AS snap FROM ( \
         (SELECT {COLUMNS}, 0 AS part FROM (SELECT {COLUMNS}, COALESCE(sum(octet_length(o.payload::text)) \
         OVER (ORDER BY o.seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before \
         FROM (SELECT {COLUMNS} FROM {t} o WHERE o.published_at IS NULL AND o.parked_at IS NULL{part} \
         AND o.seq > $1 ORDER BY o.seq LIMIT $3) o) o WHERE o.before < $4) \
         UNION ALL \
         (SELECT {COLUMNS}, 1 FROM {t} o WHERE o.published_at IS NULL AND o.parked_at IS NULL{part} \
         AND o.seq + 0 <= $1 AND o.txid = ANY(ARRAY(SELECT pg_snapshot_xip($2::pg_snapshot)))) \
         UNION ALL \
         (SELECT {COLUMNS}, 1 FROM {t} o WHERE o.published_at IS NULL AND o.parked_at IS NULL{part} \
         AND o.seq + 0 <= $1 AND o.txid >= pg_snapshot_xmax($2::pg_snapshot) \
         AND o.txid < pg_snapshot_xmax(pg_current_snapshot())) \
         UNION ALL \
         (SELECT {COLUMNS}, 2 FROM {t} o WHERE o.parked_at = 'infinity' AND o.published_at IS NULL{part} \
         AND o.seq <> ALL($5) ORDER BY o.seq LIMIT $3)) o"
    )
}

/// [`fetch_batch`]'s statement run with `EXPLAIN (ANALYZE, BUFFERS)` at `cursor`: the plan
/// with the rows and buffers each node read (nothing is held back or recorded).
pub async fn explain_batch_analyze(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partition: Partition,
    cursor: &Cursor,
    limit: i64,
) -> QueryResult<Vec<String>> {
    #[derive(QueryableByName)]
    struct PlanLine {
        #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
        line: String,
    }
    let lines: Vec<PlanLine> = diesel::sql_query(format!(
        "EXPLAIN (ANALYZE, BUFFERS) {}",
        batch_sql(table, partition)
    ))
    .bind::<BigInt, _>(cursor.upto_seq)
    .bind::<Text, _>(&cursor.snap)
    .bind::<BigInt, _>(limit)
    .bind::<BigInt, _>(i64::MAX)
    .bind::<Array<BigInt>, _>(Vec::<i64>::new())
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
        super::parking::lock_holds(conn, table).await?;
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

/// Whether the session's role holds `rights` (`has_table_privilege`'s list) on the progress
/// table of `table`, which exists.
async fn may_read_progress(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    rights: &str,
) -> QueryResult<bool> {
    let may: super::Flag =
        diesel::sql_query("SELECT has_table_privilege(to_regclass($1), $2) AS flag")
            .bind::<Text, _>(progress_table(table))
            .bind::<Text, _>(rights)
            .get_result(conn)
            .await?;
    Ok(may.flag == Some(true))
}

/// Marks `published_at` on every row a cursor read and forgets the cursors: for a relay of
/// another mode (unordered, log tailing) taking over a table the ordered relay published
/// from, so that it does not publish those rows again. Returns how many rows it marked.
pub async fn settle_progress(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<usize> {
    if !has_progress(conn, table).await? {
        return Ok(0);
    }
    if !may_read_progress(conn, table, "SELECT, DELETE").await? {
        // a role without rights on the progress was never an ordered relay's: nothing to settle
        // that it could read
        tracing::debug!(
            "no rights on the progress table; an ordered relay's progress is not settled"
        );
        return Ok(0);
    }
    let t = table.quoted();
    let p = progress_table(table);
    let cte = cursors_cte(table);
    conn.transaction(async |conn| {
        diesel::sql_query(format!(
            "SELECT pg_advisory_xact_lock({PROGRESS_LOCK_KEY}, to_regclass($1)::oid::int)"
        ))
        .bind::<Text, _>(t.clone())
        .execute(conn)
        .await?;
        let marked = diesel::sql_query(format!(
            "WITH {cte} UPDATE {t} o SET published_at = now() \
             WHERE o.published_at IS NULL AND o.parked_at IS NULL AND {COVERED}"
        ))
        .execute(conn)
        .await?;
        // released rows not published yet: to be published as any unpublished row
        diesel::sql_query(format!(
            "UPDATE {t} SET parked_at = NULL WHERE parked_at = 'infinity' AND published_at IS NULL"
        ))
        .execute(conn)
        .await?;
        diesel::sql_query(format!("DELETE FROM {p}"))
            .execute(conn)
            .await?;
        Ok(marked)
    })
    .await
}

/// Deletes up to `limit` rows a cursor read more than `older_than` ago (by the time of the
/// last batch recorded before then), oldest first; returns how many. The rows marked
/// `published_at` are [`delete_published`](super::delete_published)'s.
pub async fn delete_read(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    older_than: std::time::Duration,
    limit: i64,
) -> QueryResult<usize> {
    let t = table.quoted();
    diesel::sql_query(format!(
        "WITH {} DELETE FROM {t} WHERE seq IN (SELECT o.seq FROM {t} o \
         WHERE o.published_at IS NULL AND o.parked_at IS NULL \
         AND o.seq <= (SELECT max(upto_seq) FROM c) AND {COVERED} ORDER BY o.seq LIMIT $2 \
         FOR UPDATE SKIP LOCKED)",
        old_cursors_cte(table)
    ))
    .bind::<diesel::sql_types::Double, _>(older_than.as_secs_f64())
    .bind::<BigInt, _>(limit)
    .execute(conn)
    .await
}

/// Like [`delete_read`], but moves the rows into `archive` (see
/// [`archive_published`](super::archive_published)), each with the time of the first batch
/// that covered it as its `published_at`; returns how many it moved.
pub async fn archive_read(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    archive: &OutboxTable,
    older_than: std::time::Duration,
    limit: i64,
) -> QueryResult<usize> {
    let (t, a, p) = (table.quoted(), archive.quoted(), progress_table(table));
    let columns = super::cleanup::ARCHIVE_COLUMNS;
    let dated = columns.replace(
        "published_at",
        &format!(
            "(SELECT p.published_at FROM {p} p WHERE p.upto_seq >= m.seq \
             AND p.partition = m.aggregate_hash % p.partitions \
             AND pg_visible_in_snapshot(m.txid, p.snap) ORDER BY p.upto_seq, p.id LIMIT 1)"
        ),
    );
    diesel::sql_query(format!(
        "WITH {}, moved AS (DELETE FROM {t} WHERE seq IN (SELECT o.seq FROM {t} o \
         WHERE o.published_at IS NULL AND o.parked_at IS NULL \
         AND o.seq <= (SELECT max(upto_seq) FROM c) AND {COVERED} ORDER BY o.seq LIMIT $2 \
         FOR UPDATE SKIP LOCKED) RETURNING {columns}) \
         INSERT INTO {a} ({columns}) SELECT {dated} FROM moved m",
        old_cursors_cte(table)
    ))
    .bind::<diesel::sql_types::Double, _>(older_than.as_secs_f64())
    .bind::<BigInt, _>(limit)
    .execute(conn)
    .await
}

/// `c`: per partition of the newest count, the last cursor recorded more than `$1` seconds ago.
fn old_cursors_cte(table: &OutboxTable) -> String {
    let p = progress_table(table);
    format!(
        "c AS MATERIALIZED (SELECT m.n AS partitions, g.p AS partition, l.upto_seq, l.snap \
         FROM (SELECT partitions AS n FROM {p} ORDER BY id DESC LIMIT 1) m \
         CROSS JOIN generate_series(0, m.n - 1) AS g(p) \
         JOIN LATERAL (SELECT upto_seq, snap FROM {p} WHERE partitions = m.n AND partition = g.p \
         AND published_at < now() - make_interval(secs => $1) ORDER BY id DESC LIMIT 1) l ON true)"
    )
}

/// Deletes the progress rows recorded more than `older_than` ago but the last of each
/// partition; returns how many. What they covered is older than the retention too, and
/// deleted by [`delete_read`] first.
pub async fn prune_progress(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    older_than: std::time::Duration,
) -> QueryResult<usize> {
    let p = progress_table(table);
    diesel::sql_query(format!(
        "DELETE FROM {p} WHERE published_at < now() - make_interval(secs => $1) \
         AND id NOT IN (SELECT max(id) FROM {p} GROUP BY partitions, partition)"
    ))
    .bind::<diesel::sql_types::Double, _>(older_than.as_secs_f64())
    .execute(conn)
    .await
}

/// What the operations need to tell the rows a cursor read from the unpublished ones: for a
/// table with snapshot batches, its cursors (`WITH c AS …`) and [`COVERED`]; for one made
/// before them, nothing is covered.
pub(crate) struct Coverage {
    cte: Option<String>,
}

impl Coverage {
    /// Reads whether an ordered relay records its progress on `table` (since the last
    /// [`settle_progress`]). A role that may not read the progress table was never an ordered
    /// relay's (a log-tailing relay granted only the outbox table): for it, nothing is covered.
    pub(crate) async fn of(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<Self> {
        if !has_progress(conn, table).await? || !may_read_progress(conn, table, "SELECT").await? {
            return Ok(Coverage { cte: None });
        }
        let f: super::Flag = diesel::sql_query(format!(
            "SELECT EXISTS (SELECT 1 FROM {}) AS flag",
            progress_table(table)
        ))
        .get_result(conn)
        .await?;
        Ok(Coverage {
            cte: f.flag.unwrap_or(false).then(|| cursors_cte(table)),
        })
    }

    /// Whether an ordered relay records its progress on the table: a row it read past and
    /// `retry` releases is then marked released (`'infinity'`), for the relay to read apart.
    pub(crate) fn in_use(&self) -> bool {
        self.cte.is_some()
    }

    /// `WITH c AS (…)`, to start the statement with.
    pub(crate) fn with(&self) -> String {
        match &self.cte {
            Some(cte) => format!("WITH {cte} "),
            None => String::new(),
        }
    }

    /// Whether row `o` was read by a cursor.
    pub(crate) fn covered(&self) -> &'static str {
        if self.cte.is_some() { COVERED } else { "false" }
    }

    /// The unpublished rows of `table` (parked and held ones included), to read `FROM … o`.
    /// With cursors, three parts that each use an index: parked rows, rows after the lowest
    /// cursor, and rows at or below it of transactions some cursor's snapshot did not see.
    pub(crate) fn unpublished(&self, table: &OutboxTable) -> String {
        let t = table.quoted();
        if self.cte.is_none() {
            return format!("(SELECT * FROM {t} WHERE published_at IS NULL) o");
        }
        const LOW: &str = "(SELECT COALESCE(min(upto_seq), 0) FROM c)";
        format!(
            "(SELECT o.* FROM {t} o WHERE o.published_at IS NULL AND o.parked_at IS NOT NULL \
             UNION ALL SELECT o.* FROM {t} o WHERE o.published_at IS NULL AND o.parked_at IS NULL \
             AND o.seq > {LOW} AND NOT {COVERED} \
             UNION ALL SELECT o.* FROM {t} o WHERE o.published_at IS NULL AND o.parked_at IS NULL \
             AND o.seq <= {LOW} AND ((o.txid >= (SELECT min(pg_snapshot_xmax(snap)) FROM c) \
             AND o.txid < pg_snapshot_xmax(pg_current_snapshot())) \
             OR o.txid = ANY(ARRAY(SELECT pg_snapshot_xip(snap) FROM c))) AND NOT {COVERED}) o"
        )
    }
}
