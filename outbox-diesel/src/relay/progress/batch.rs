//! A batch: the statement that reads a partition's next rows, late rows and released rows at
//! a cursor, and what it sets aside behind a parked row.

use std::collections::HashSet;

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{Array, BigInt, Bool, Integer, Nullable, Text};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;

use super::super::{OutboxRow, Partition};
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
    /// The row's partition (`aggregate_hash % count`).
    #[diesel(sql_type = Integer)]
    p: i32,
    /// 0: no earlier row of the aggregate is parked, held or released; 1: one is
    /// parked or held; 2: only released ones
    #[diesel(sql_type = Integer)]
    behind: i32,
    /// A late row: how many late rows its partition has (the statement returns those within
    /// the batch's limits).
    #[diesel(sql_type = BigInt)]
    late_total: i64,
    #[diesel(sql_type = Text)]
    snap: String,
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
    Ok(batches.pop().map(|(_, b)| b).unwrap_or(Batch {
        rows: Vec::new(),
        next: cursor.clone(),
        held: 0,
    }))
}

/// Reads the next batch of each of `cursors`' partitions (of `count`) in one statement: up
/// to `limit` rows after the lowest cursor in one walk through those partitions (and while
/// their payloads stay under `max_bytes`, the first always), the late rows of each within the
/// same limits, and up to `limit` released rows other than `exclude` (those the caller holds).
/// Returns a batch per partition, in the order of `cursors`.
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
#[tracing::instrument(name = "outbox.claim", level = "debug", skip_all, fields(outbox.table = %table, outbox.partitions = cursors.len()))]
pub async fn fetch_batches(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    count: u32,
    cursors: &[(u32, Cursor)],
    exclude: &[i64],
    limit: i64,
    max_bytes: i64,
) -> QueryResult<Vec<(u32, Batch)>> {
    if cursors.is_empty() {
        return Ok(Vec::new());
    }
    let binds = Binds::of(count, cursors);
    let fetched: Vec<Fetched> = binds
        .statement(table, count, "", exclude, limit, max_bytes)
        .load(conn)
        .await?;
    // the statement's snapshot, when it returned a row; with none, nothing was there to read:
    // a late pass has ended, the other cursors stay
    let snap = <[Fetched]>::first(&fetched).map(|f| f.snap.clone());
    // how far the walk went: every row of the walked partitions up to there that `snap` sees
    // (returned, or at or below its own partition's cursor)
    let walked = fetched
        .iter()
        .filter(|f| f.part == 0)
        .map(|f| f.event.seq)
        .max();
    // per partition: the late rows returned, their highest `seq`, and how many there are
    let mut late: std::collections::HashMap<i32, (i64, i64, i64)> = Default::default();
    for f in fetched.iter().filter(|f| f.part == 1) {
        let e = late.entry(f.p).or_insert((0, i64::MIN, f.late_total));
        e.0 += 1;
        e.1 = e.1.max(f.event.seq);
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
        let batch = Batch {
            rows: Vec::new(),
            next,
            held: 0,
        };
        batches.push((*p, batch));
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
        if aside.contains(&f.event.seq) {
            batch.held += usize::from(held.contains(&f.event.seq));
            continue;
        }
        let source = match f.part {
            0 => Source::Next,
            1 => Source::Late,
            _ => Source::Released,
        };
        batch.rows.push((f.event, source));
    }
    for (_, batch) in &mut batches {
        batch.rows.sort_by_key(|(r, _)| r.seq);
    }
    Ok(batches)
}

/// [`batch_sql`] with its binds, as a statement the connection prepares once and keeps (a
/// `sql_query` is planned again at every call, which for this statement costs more than
/// running it on a small batch). Each `$n` of the text takes its bind where it stands, so a
/// value used twice is bound twice.
struct BatchStatement<'a> {
    sql: String,
    indexes: &'a [i32],
    uptos: &'a [i64],
    snaps: &'a [String],
    limit: i64,
    max_bytes: i64,
    exclude: &'a [i64],
    /// The lowest walked cursor's `seq`, where the walk starts.
    from: i64,
    /// Per cursor, its late pass's `seq` and snapshot, if any.
    afters: &'a [Option<i64>],
    uppers: &'a [Option<String>],
    /// By partition, the `seq` its walked rows come after: its cursor's, or `i64::MAX` for a
    /// partition not walked (in a late pass, or not read by the caller).
    walk: &'a [i64],
    /// The partitions walked.
    walked: &'a [i32],
}

/// What [`batch_sql`] binds for `cursors` of partitions of `count`, and the shape of its walk.
struct Binds {
    indexes: Vec<i32>,
    uptos: Vec<i64>,
    snaps: Vec<String>,
    afters: Vec<Option<i64>>,
    uppers: Vec<Option<String>>,
    /// where the walk starts: the lowest walked cursor's `seq`
    from: i64,
    walk: Vec<i64>,
    walked: Vec<i32>,
    some: bool,
    shape: Walk,
}

impl Binds {
    fn of(count: u32, cursors: &[(u32, Cursor)]) -> Binds {
        // where the walk takes each partition's rows from, by partition: after its cursor; a
        // partition not read here, or in a late pass, not at all
        let walking: Vec<(u32, i64)> = cursors
            .iter()
            .filter(|(_, c)| c.late.is_none())
            .map(|(p, c)| (*p, c.upto_seq))
            .collect();
        let some = cursors.len() < count as usize;
        let shape = if walking.windows(2).any(|w| w[0].1 != w[1].1) {
            Walk::EachAfterItsCursor
        } else if some || walking.len() < cursors.len() {
            Walk::Some
        } else {
            Walk::All
        };
        // the cursors by partition, bound only when they differ
        let mut walk = Vec::new();
        if shape == Walk::EachAfterItsCursor {
            walk = vec![i64::MAX; count.max(1) as usize];
            for (p, upto) in &walking {
                if let Some(after) = walk.get_mut(*p as usize) {
                    *after = *upto;
                }
            }
        }
        Binds {
            indexes: cursors.iter().map(|(p, _)| *p as i32).collect(),
            uptos: cursors.iter().map(|(_, c)| c.upto_seq).collect(),
            snaps: cursors.iter().map(|(_, c)| c.snap.clone()).collect(),
            afters: cursors.iter().map(|(_, c)| c.late_after_seq()).collect(),
            uppers: cursors
                .iter()
                .map(|(_, c)| c.late_snap().map(str::to_owned))
                .collect(),
            from: walking.iter().map(|(_, u)| *u).min().unwrap_or(i64::MAX),
            walked: walking.iter().map(|(p, _)| *p as i32).collect(),
            walk,
            some,
            shape,
        }
    }

    /// The statement with these binds, its text after `prefix` (e.g. `EXPLAIN`).
    fn statement<'a>(
        &'a self,
        table: &OutboxTable,
        count: u32,
        prefix: &str,
        exclude: &'a [i64],
        limit: i64,
        max_bytes: i64,
    ) -> BatchStatement<'a> {
        BatchStatement {
            sql: format!("{prefix}{}", batch_sql(table, count, self.some, self.shape)),
            indexes: &self.indexes,
            uptos: &self.uptos,
            snaps: &self.snaps,
            limit,
            max_bytes,
            exclude,
            from: self.from,
            afters: &self.afters,
            uppers: &self.uppers,
            walk: &self.walk,
            walked: &self.walked,
        }
    }
}

impl QueryId for BatchStatement<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl Query for BatchStatement<'_> {
    type SqlType = diesel::sql_types::Untyped;
}

impl QueryFragment<Pg> for BatchStatement<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        let mut rest = self.sql.as_str();
        while let Some(at) = rest.find('$') {
            out.push_sql(&rest[..at]);
            let digits = rest[at + 1..]
                .bytes()
                .take_while(u8::is_ascii_digit)
                .count();
            let n: u32 = rest[at + 1..at + 1 + digits].parse().unwrap_or(0);
            match n {
                1 => out.push_bind_param::<Array<Integer>, _>(self.indexes)?,
                2 => out.push_bind_param::<Array<BigInt>, _>(self.uptos)?,
                3 => out.push_bind_param::<Array<Text>, _>(self.snaps)?,
                4 => out.push_bind_param::<BigInt, _>(&self.limit)?,
                5 => out.push_bind_param::<BigInt, _>(&self.max_bytes)?,
                6 => out.push_bind_param::<Array<BigInt>, _>(self.exclude)?,
                7 => out.push_bind_param::<BigInt, _>(&self.from)?,
                8 => out.push_bind_param::<Array<Nullable<BigInt>>, _>(self.afters)?,
                9 => out.push_bind_param::<Array<Nullable<Text>>, _>(self.uppers)?,
                10 => out.push_bind_param::<Array<BigInt>, _>(self.walk)?,
                11 => out.push_bind_param::<Array<Integer>, _>(self.walked)?,
                // a `$` of a quoted name: text
                _ => {
                    out.push_sql("$");
                    rest = &rest[at + 1..];
                    continue;
                }
            }
            rest = &rest[at + 1 + digits..];
        }
        out.push_sql(rest);
        Ok(())
    }
}

/// Which rows the walk of [`batch_sql`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Walk {
    /// Every partition's, all after the same cursor.
    All,
    /// Those of the partitions walked (`$11`), all after the same cursor.
    Some,
    /// Each partition's after its own cursor (`$10`): cursors differ after a take-over.
    EachAfterItsCursor,
}

/// The statement of [`fetch_batches`] for partitions of `count` of `table`, `some` when the
/// relay reads only some of them, the walk's `shape`; its binds: the partitions, their cursors'
/// `seq`s and snapshots, the row limit, the byte budget, the released rows to leave out, the
/// lowest walked cursor's `seq`, the late passes' `seq`s and snapshots (NULL for a cursor
/// without one), by partition the `seq` its walked rows come after (`i64::MAX`: not walked),
/// and the partitions walked.
///
/// The planner sees no bind's value: each is read through a subquery (`(SELECT $n)`), so that
/// the plan of a call is the same with or without the values, and PostgreSQL keeps the
/// session's generic plan. With the values in sight, a relay caught up (a cursor at the end
/// of the table, a few rows a batch) got custom plans cheaper than the generic one by the
/// estimates, and PostgreSQL planned the statement again at every call: 0.8 ms a batch against
/// 0.08 for running the generic plan.
///
/// The next rows are one walk through the rows after the lowest cursor, each taken when it is
/// above its own partition's cursor: the row limit and the byte budget count only those. A
/// partition taken over far behind the others (cursors differ then) gets its own rows in its
/// first batch, instead of a batch's worth of rows the others had read before at a time.
/// While the cursors agree (the steady state) the walk tests the partition alone, which costs
/// PostgreSQL less per event (BENCHMARKS.md, section 12).
///
/// A row is late for its partition when that cursor's snapshot had its transaction in
/// progress (`xip`, below `xmax`) or not begun (at or above `xmax`): two disjoint parts.
///
/// - Of the transactions in progress, only those the statement's snapshot sees ended are
///   looked up: a bulk load still running behind the cursor would otherwise cost every batch a
///   visit of every row it has written so far, none of them visible. With several
///   partitions each is looked up once for all the cursors (`lx`): its first 17 rows in the
///   range of all cursors, in `seq` order. A transaction with 16 or fewer is read whole there;
///   one with more (`many`), and with one partition every one, is read per cursor, in `seq`
///   order from where a late pass stands, `limit + 1` rows at most. Both
///   read a range of `outbox_txid` (`txid, seq`) written as row comparisons, which no other
///   index can serve (with `seq` bounds alone the planner may walk the primary key and filter
///   by transaction id), and only then test for being unpublished (given the test inside, the
///   planner may read every unpublished row through `outbox_ready` and filter it by
///   transaction id). So the batch that finds a late transaction, and each part of its late
///   pass, reads its own rows and not every row of the transaction left (a bulk load of
///   millions committed late made one batch of seconds, and a pass was quadratic in its rows),
///   and a writer's few late rows cost one look-up however many partitions the relay reads
///   (one per partition made 8 partitions read three times the buffers of one).
/// - The transactions begun after the snapshot are looked up by a range of transaction ids,
///   up to the statement's snapshot, or in a late pass up to the pass's (its rows must be
///   visible to it): the parts of a long pass do not read again every row written since the
///   pass began.
///
/// Each partition's late rows come in `seq` order within the row limit and the byte budget,
/// each with how many were found (those of a transaction with many counted up to `limit + 1`), so that
/// the caller knows when they did not all fit: the first `limit` of them by `seq` are among
/// those found, since a row is at most as far into its own transaction's rows as into all of
/// them. In a late pass, only those after the pass's `seq` that the pass's snapshot sees.
fn batch_sql(table: &OutboxTable, count: u32, some: bool, shape: Walk) -> String {
    const COLUMNS: &str = "o.seq, o.id, o.aggregate_type, o.aggregate_id, o.event_type, \
                           o.payload, o.headers, o.created_at, o.attempts";
    let t = table.quoted();
    // the count is a literal: each partition count gets its own cached plan
    let p = if count > 1 {
        format!("(o.aggregate_hash % {count})::int4")
    } else {
        "0".to_owned()
    };
    let owned = if some {
        format!(" AND {p} = ANY((SELECT $1::int4[])::int4[])")
    } else {
        String::new()
    };
    let walked = match shape {
        Walk::All => String::new(),
        Walk::Some => format!(" AND {p} = ANY((SELECT $11::int4[])::int4[])"),
        Walk::EachAfterItsCursor => format!(" AND o.seq > ((SELECT $10::int8[]))[{p} + 1]"),
    };
    let behind = behind_sql(table);
    let in_pass = "(c.after IS NULL OR o.seq > c.after) \
                   AND (c.upper IS NULL OR pg_visible_in_snapshot(o.txid, c.upper))";
    let min = i64::MIN;
    let limit = "(SELECT $4::int8)";
    // With several partitions, a transaction with at most this many late rows is looked up
    // once for all the cursors; one with more, per cursor, `limit + 1` rows at most each. With
    // one the look-up per cursor is one per transaction, and the statement keeps the fewer
    // plan nodes (the shared look-up costs an empty batch 0.07 ms).
    const FEW: i64 = 16;
    let ended = "pg_visible_in_snapshot(x, (SELECT s FROM cur))";
    let (few, looked_up, per_cursor) = if count > 1 {
        (
            format!(
                ", lx AS MATERIALIZED (SELECT o.* FROM (SELECT DISTINCT x FROM c, \
                 pg_snapshot_xip(c.snap) AS x WHERE {ended}) AS xs(x) \
                 CROSS JOIN LATERAL (SELECT * FROM {t} o \
                 WHERE (o.txid, o.seq) > (xs.x, (SELECT min(COALESCE(c.after, {min})) FROM c)) \
                 AND (o.txid, o.seq) <= (xs.x, (SELECT max(c.upto) FROM c)) \
                 ORDER BY o.txid, o.seq LIMIT {FEW} + 1) o), \
                 many AS MATERIALIZED (SELECT txid FROM lx GROUP BY txid HAVING count(*) > {FEW})"
            ),
            format!(
                "(SELECT {COLUMNS}, c.p FROM lx o JOIN c ON c.p = {p} \
                 WHERE o.txid NOT IN (SELECT txid FROM many) \
                 AND o.published_at IS NULL AND o.parked_at IS NULL AND o.seq <= c.upto \
                 AND o.txid < pg_snapshot_xmax(c.snap) \
                 AND NOT pg_visible_in_snapshot(o.txid, c.snap) AND {in_pass}) \
                 UNION ALL "
            ),
            "x IN (SELECT txid FROM many)".to_owned(),
        )
    } else {
        (String::new(), String::new(), ended.to_owned())
    };
    format!(
        "WITH cur AS MATERIALIZED (SELECT pg_current_snapshot() AS s), \
         c AS MATERIALIZED (SELECT c.p, c.upto, c.snap::pg_snapshot AS snap, c.after, \
         c.upper::pg_snapshot AS upper \
         FROM unnest((SELECT $1::int4[]), (SELECT $2::int8[]), (SELECT $3::text[]), \
         (SELECT $8::int8[]), (SELECT $9::text[])) AS c(p, upto, snap, after, upper)){few} \
         SELECT {COLUMNS}, o.part, o.p, {behind} AS behind, o.late_total, (SELECT s::text FROM cur) AS snap FROM ( \
         (SELECT {COLUMNS}, 0 AS part, o.p, 0::int8 AS late_total FROM (SELECT {COLUMNS}, o.p, \
         COALESCE(sum(octet_length(o.payload::text)) \
         OVER (ORDER BY o.seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before \
         FROM (SELECT {COLUMNS}, {p} AS p FROM {t} o WHERE o.published_at IS NULL \
         AND o.parked_at IS NULL AND o.seq > (SELECT $7::int8){walked} \
         ORDER BY o.seq LIMIT {limit}) o) o WHERE o.before < $5) \
         UNION ALL \
         (SELECT {COLUMNS}, 1, o.p, o.total FROM (SELECT {COLUMNS}, o.p, \
         row_number() OVER w AS rn, count(*) OVER (PARTITION BY o.p) AS total, \
         COALESCE(sum(octet_length(o.payload::text)) \
         OVER (w ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before FROM ( \
         {looked_up}(SELECT {COLUMNS}, c.p FROM c CROSS JOIN LATERAL (SELECT x FROM pg_snapshot_xip(c.snap) \
         AS x WHERE {per_cursor}) AS x(txid) \
         CROSS JOIN LATERAL (SELECT * FROM (SELECT * FROM {t} o \
         WHERE (o.txid, o.seq) > (x.txid, COALESCE(c.after, {min})) \
         AND (o.txid, o.seq) <= (x.txid, c.upto) ORDER BY o.txid, o.seq OFFSET 0) o \
         WHERE {p} = c.p AND o.published_at IS NULL AND o.parked_at IS NULL AND {in_pass} \
         LIMIT {limit} + 1) o) \
         UNION ALL \
         (SELECT {COLUMNS}, c.p FROM (SELECT * FROM {t} o \
         WHERE o.txid >= (SELECT min(pg_snapshot_xmax(c.snap)) FROM c) \
         AND o.txid < (SELECT max(pg_snapshot_xmax(COALESCE(c.upper, (SELECT s FROM cur)))) FROM c) \
         OFFSET 0) o \
         JOIN c ON c.p = {p} WHERE o.published_at IS NULL AND o.parked_at IS NULL \
         AND o.seq <= c.upto AND o.txid >= pg_snapshot_xmax(c.snap) AND {in_pass})) o \
         WINDOW w AS (PARTITION BY o.p ORDER BY o.seq)) o WHERE o.rn <= $4 AND o.before < $5) \
         UNION ALL \
         (SELECT {COLUMNS}, 2, {p}, 0::int8 FROM {t} o WHERE o.parked_at = 'infinity' \
         AND o.published_at IS NULL{owned} AND o.seq <> ALL($6) ORDER BY o.seq LIMIT {limit})) o \
         LEFT JOIN c ON c.p = o.p"
    )
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
    let binds = Binds::of(count, cursors);
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
