//! The ordered batch statement: its text ([`batch_sql`]), its binds for a set of cursors, and
//! the statement the connection prepares once and keeps.

use diesel::QueryResult;
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{Array, BigInt, Integer, Nullable, Text};

use crate::OutboxTable;

use super::super::parking::earlier_waiting_sql;
use super::{Cursor, MAX_PARTITIONS_BY_INDEX};

/// Whether an earlier row of row `o`'s aggregate is parked or held (1), or only released
/// ones are waiting (2), or none (0). Each test stops at the first row it finds, so a row
/// costs the same however many rows of its aggregate wait, and reads the index of parked rows
/// whatever the statistics say ([`earlier_waiting_sql`]). A row looks up only what waits
/// somewhere in the table: while no row waits (one look at that index per statement, an
/// `InitPlan`), nothing; while no row is released (one look at the index of released rows),
/// not released rows. A rotated table's indexes are one per partition, and a look-up probes
/// each: with no row waiting, those two look-ups per row were 12 index probes a row with 4
/// partitions.
pub(super) fn behind_sql(table: &OutboxTable) -> String {
    let t = table.quoted();
    // whether any row waits is asked for the first in the order of the index of parked rows,
    // which no other index gives without a sort: asked only whether one exists (`EXISTS`),
    // the planner took a walk of every unpublished row by `seq` where the statistics made
    // waiting rows look common, and read a 100,000-row backlog before the first parked row in
    // every batch; whether any is released, for the first by `seq`, which the index of
    // released rows gives at its first entry
    let any_waiting = format!(
        "(SELECT p.parked_at FROM {t} p WHERE p.parked_at IS NOT NULL \
         AND p.published_at IS NULL ORDER BY p.aggregate_type, p.aggregate_id LIMIT 1)"
    );
    let any_released = format!(
        "(SELECT p.parked_at FROM {t} p WHERE p.parked_at = 'infinity' \
         AND p.published_at IS NULL ORDER BY p.seq LIMIT 1)"
    );
    format!(
        "CASE WHEN {any_waiting} IS NULL THEN 0 WHEN {} THEN 1 \
         WHEN {any_released} IS NOT NULL AND {} THEN 2 ELSE 0 END",
        earlier_waiting_sql(&t, "< 'infinity'"),
        earlier_waiting_sql(&t, "= 'infinity'")
    )
}

/// [`batch_sql`] with its binds, as a statement the connection prepares once and keeps (a
/// `sql_query` is planned again at every call, which for this statement costs more than
/// running it on a small batch). Each `$n` of the text takes its bind where it stands, so a
/// value used twice is bound twice.
pub(super) struct BatchStatement<'a> {
    sql: String,
    indexes: &'a [i32],
    uptos: &'a [i64],
    snaps: &'a [&'a str],
    limit: i64,
    max_bytes: i64,
    exclude: &'a [i64],
    /// The lowest walked cursor's `seq`, where the walk starts.
    from: i64,
    /// Per cursor, its late pass's `seq` and snapshot, if any.
    afters: &'a [Option<i64>],
    uppers: &'a [Option<&'a str>],
    /// By partition, the `seq` its walked rows come after: its cursor's, or `i64::MAX` for a
    /// partition not walked (in a late pass, or not read by the caller).
    walk: &'a [i64],
    /// The partitions walked.
    walked: &'a [i32],
    /// Per partition walked, the `seq` its rows come after ([`Walk::ByPartition`]).
    walked_after: &'a [i64],
}

/// What [`batch_sql`] binds for `cursors` of partitions of `count`, and the shape of its walk.
pub(super) struct Binds<'c> {
    indexes: Vec<i32>,
    uptos: Vec<i64>,
    snaps: Vec<&'c str>,
    afters: Vec<Option<i64>>,
    uppers: Vec<Option<&'c str>>,
    /// where the walk starts: the lowest walked cursor's `seq`
    from: i64,
    walk: Vec<i64>,
    walked: Vec<i32>,
    walked_after: Vec<i64>,
    some: bool,
    shape: Walk,
}

impl<'c> Binds<'c> {
    /// `indexed`: the table has the partition index of `count` (see
    /// [`partition_index`](crate::partition_index)).
    pub(super) fn of(count: u32, cursors: &'c [(u32, Cursor)], indexed: bool) -> Binds<'c> {
        // where the walk takes each partition's rows from, by partition: after its cursor; a
        // partition not read here, or in a late pass, not at all
        let walking: Vec<(u32, i64)> = cursors
            .iter()
            .filter(|(_, c)| c.late.is_none())
            .map(|(p, c)| (*p, c.upto_seq))
            .collect();
        let some = cursors.len() < count as usize;
        let differ = walking.windows(2).any(|w| w[0].1 != w[1].1);
        let shape = if indexed
            && count > 1
            && !walking.is_empty()
            && walking.len() <= MAX_PARTITIONS_BY_INDEX
            && (some || differ)
        {
            Walk::ByPartition(walking.len().next_power_of_two())
        } else if differ {
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
            snaps: cursors.iter().map(|(_, c)| c.snap.as_str()).collect(),
            afters: cursors.iter().map(|(_, c)| c.late_after_seq()).collect(),
            uppers: cursors.iter().map(|(_, c)| c.late_snap()).collect(),
            from: walking.iter().map(|(_, u)| *u).min().unwrap_or(i64::MAX),
            walked: walking.iter().map(|(p, _)| *p as i32).collect(),
            walked_after: walking.iter().map(|(_, u)| *u).collect(),
            walk,
            some,
            shape,
        }
    }

    /// The statement with these binds, its text after `prefix` (e.g. `EXPLAIN`).
    pub(super) fn statement<'a>(
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
            walked_after: &self.walked_after,
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
                12 => out.push_bind_param::<Array<BigInt>, _>(self.walked_after)?,
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
    /// Each partition walked (`$11`) by the partition index after its own cursor (`$12`),
    /// their rows merged in `seq` order: a relay that owns some partitions reads none of the
    /// others' rows. The statement has this many walks (the partitions walked, rounded up to a
    /// power of two so that a session prepares few statements; a walk past the end of `$11`
    /// reads nothing).
    ByPartition(usize),
}

/// The statement of [`fetch_batches`](crate::relay::fetch_batches) for partitions of `count` of `table`, `some` when the
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
/// PostgreSQL less per event (BENCHMARKS.md, section 12). With the partition index of `count`
/// (`indexed`), a relay that reads some of the partitions (at most
/// [`MAX_PARTITIONS_BY_INDEX`]), or reads them at different cursors, walks each one by that
/// index from its own cursor and takes their rows merged in `seq` order ([`Walk::ByPartition`]), a `Merge Append` that stops at
/// the row limit: it reads no row of a partition it does not read, where the walk by `seq`
/// fetches each one to test its partition (BENCHMARKS.md, section 20), and a busy partition
/// fills the batch whichever partitions are quiet.
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
///   pass began. A cursor at `seq` 0 (nothing read: its snapshot sees nothing, and no row is
///   at or below it) takes no part in it: it made the range every row of the table.
///
/// Each partition's late rows come in `seq` order within the row limit and the byte budget,
/// each with how many were found (those of a transaction with many counted up to `limit + 1`), so that
/// the caller knows when they did not all fit: the first `limit` of them by `seq` are among
/// those found, since a row is at most as far into its own transaction's rows as into all of
/// them. In a late pass, only those after the pass's `seq` that the pass's snapshot sees.
fn batch_sql(table: &OutboxTable, count: u32, some: bool, shape: Walk) -> String {
    const COLUMNS: &str = "o.seq, o.id, o.aggregate_type, o.aggregate_id, o.event_type, \
                           o.payload, o.headers, o.created_at, o.attempts";
    // the columns as read from the table: the payload written out as text once, where the
    // byte budget counts it and whence it is returned (PostgreSQL would otherwise write each
    // payload out twice, for its length and to send it: about a third of the statement's
    // time on a batch of 500 small rows)
    const READ: &str = "o.seq, o.id, o.aggregate_type, o.aggregate_id, o.event_type, \
                        o.payload::text AS payload, o.headers, o.created_at, o.attempts";
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
        Walk::ByPartition(_) => String::new(),
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
                "(SELECT {READ}, c.p FROM lx o JOIN c ON c.p = {p} \
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
    // the next rows: one walk by `seq` through the partitions read, or (by the partition
    // index) each partition's own, merged by `seq`. A partition's rows are written as its
    // equality with `p` (so that PostgreSQL knows each walk comes in `seq` order and merges
    // them, reading no more than the limit), `seq` after its cursor (where the index scan
    // starts: behind the equality, a row comparison's `seq` starts nothing, and the scan read
    // the partition's every entry up to the cursor), and the same range as a row comparison on
    // the partition index's columns, which no other index serves. Written without it, the
    // planner walked `ready` for each partition and passed over the others' rows where the
    // statistics did not yet show how the partitions' rows spread (a new table)
    let partition_walk = |i: usize| {
        let (wp, after) = (
            format!("((SELECT $11::int4[]))[{i}]"),
            format!("((SELECT $12::int8[]))[{i}]"),
        );
        format!(
            "(SELECT {READ}, {p} AS p FROM {t} o WHERE {p} = {wp} AND o.seq > {after} \
             AND ({p}, o.seq) > ({wp}, {after}) \
             AND o.published_at IS NULL AND o.parked_at IS NULL ORDER BY o.seq)"
        )
    };
    let from = match shape {
        // one walk is in `seq` order already: a second `ORDER BY` after its own is refused
        Walk::ByPartition(1) => format!("{} LIMIT {limit}", partition_walk(1)),
        Walk::ByPartition(walks) => format!(
            "{} ORDER BY seq LIMIT {limit}",
            (1..=walks)
                .map(partition_walk)
                .collect::<Vec<_>>()
                .join(" UNION ALL ")
        ),
        _ => format!(
            "SELECT {READ}, {p} AS p FROM {t} o WHERE o.published_at IS NULL \
             AND o.parked_at IS NULL AND o.seq > (SELECT $7::int8){walked} \
             ORDER BY o.seq LIMIT {limit}"
        ),
    };
    let next = format!(
        "(SELECT {COLUMNS}, 0 AS part, o.p, 0::int8 AS late_total FROM (SELECT {COLUMNS}, o.p, \
         COALESCE(sum(octet_length(o.payload)) \
         OVER (ORDER BY o.seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before \
         FROM ({from}) o) o WHERE o.before < $5)"
    );
    format!(
        "WITH cur AS MATERIALIZED (SELECT pg_current_snapshot() AS s), \
         c AS MATERIALIZED (SELECT c.p, c.upto, c.snap::pg_snapshot AS snap, c.after, \
         c.upper::pg_snapshot AS upper \
         FROM unnest((SELECT $1::int4[]), (SELECT $2::int8[]), (SELECT $3::text[]), \
         (SELECT $8::int8[]), (SELECT $9::text[])) AS c(p, upto, snap, after, upper)){few} \
         SELECT {COLUMNS}, o.part, o.p, {behind} AS behind, o.late_total, NULL::text AS snap FROM ( \
         {next} \
         UNION ALL \
         (SELECT {COLUMNS}, 1, o.p, o.total FROM (SELECT {COLUMNS}, o.p, \
         row_number() OVER w AS rn, count(*) OVER (PARTITION BY o.p) AS total, \
         COALESCE(sum(octet_length(o.payload)) \
         OVER (w ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before FROM ( \
         {looked_up}(SELECT {READ}, c.p FROM c CROSS JOIN LATERAL (SELECT x FROM pg_snapshot_xip(c.snap) \
         AS x WHERE {per_cursor}) AS x(txid) \
         CROSS JOIN LATERAL (SELECT * FROM (SELECT * FROM {t} o \
         WHERE (o.txid, o.seq) > (x.txid, COALESCE(c.after, {min})) \
         AND (o.txid, o.seq) <= (x.txid, c.upto) ORDER BY o.txid, o.seq OFFSET 0) o \
         WHERE {p} = c.p AND o.published_at IS NULL AND o.parked_at IS NULL AND {in_pass} \
         LIMIT {limit} + 1) o) \
         UNION ALL \
         (SELECT {READ}, c.p FROM (SELECT * FROM {t} o \
         WHERE o.txid >= (SELECT min(pg_snapshot_xmax(c.snap)) FROM c WHERE c.upto > 0) \
         AND o.txid < (SELECT max(pg_snapshot_xmax(COALESCE(c.upper, (SELECT s FROM cur)))) FROM c) \
         OFFSET 0) o \
         JOIN c ON c.p = {p} WHERE o.published_at IS NULL AND o.parked_at IS NULL \
         AND o.seq <= c.upto AND o.txid >= pg_snapshot_xmax(c.snap) AND {in_pass})) o \
         WINDOW w AS (PARTITION BY o.p ORDER BY o.seq)) o WHERE o.rn <= $4 AND o.before < $5) \
         UNION ALL \
         (SELECT {READ}, 2, {p}, 0::int8 FROM {t} o WHERE o.parked_at = 'infinity' \
         AND o.published_at IS NULL{owned} AND o.seq <> ALL($6) ORDER BY o.seq LIMIT {limit})) o \
         UNION ALL \
         SELECT 0::int8, '00000000-0000-0000-0000-000000000000'::uuid, '', '', '', '', \
         '{{}}'::jsonb, 'epoch'::timestamptz, 0, {SNAPSHOT_PART}, 0, 0, 0::int8, \
         (SELECT s::text FROM cur)"
    )
}

/// The `part` of the statement's last row, which carries its snapshot (`pg_current_snapshot()`
/// as text) and no event: the snapshot lists every transaction in progress, which may be many,
/// and is sent once a batch rather than on each of its rows.
pub(super) const SNAPSHOT_PART: i32 = 3;

#[cfg(test)]
mod tests {
    use super::*;

    fn cursors(partitions: impl IntoIterator<Item = u32>) -> Vec<(u32, Cursor)> {
        partitions
            .into_iter()
            .map(|p| (p, Cursor::start()))
            .collect()
    }

    #[test]
    fn partitions_read_by_the_partition_index_are_merged_in_walks_of_a_power_of_two() {
        let some = cursors([1, 3, 5]);
        assert_eq!(Binds::of(8, &some, true).shape, Walk::ByPartition(4));
        assert_eq!(Binds::of(8, &some, false).shape, Walk::Some);
        let sql = batch_sql(&OutboxTable::DEFAULT, 8, true, Walk::ByPartition(4));
        // each walk binds its cursor twice: its start, and the row comparison
        assert_eq!(sql.matches("((SELECT $12::int8[]))[").count(), 8, "{sql}");
        assert!(sql.contains("((SELECT $11::int4[]))[4]"), "{sql}");
        assert!(!sql.contains("((SELECT $11::int4[]))[5]"), "{sql}");
        // a relay reading every partition at one cursor walks `ready` once
        assert_eq!(Binds::of(8, &cursors(0..8), true).shape, Walk::All);
    }

    #[test]
    fn more_partitions_than_a_statement_merges_walk_the_ready_index() {
        let most = cursors(0..MAX_PARTITIONS_BY_INDEX as u32);
        assert_eq!(
            Binds::of(1024, &most, true).shape,
            Walk::ByPartition(MAX_PARTITIONS_BY_INDEX)
        );
        let more = cursors(0..MAX_PARTITIONS_BY_INDEX as u32 + 1);
        assert_eq!(Binds::of(1024, &more, true).shape, Walk::Some);
    }
}
