//! A batch: the statement that reads a partition's next rows, late rows and released rows at
//! a cursor, and what it sets aside behind a parked row.

use std::collections::HashSet;

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{Array, BigInt, Bool, Integer, Text};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;

use super::super::{OutboxRow, Partition};
use super::Cursor;

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
    let fetched: Vec<Fetched> = BatchStatement {
        sql: batch_sql(table, partition),
        cursor,
        limit,
        max_bytes,
        exclude,
    }
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

/// [`batch_sql`] with its binds, as a statement the connection prepares once and keeps (a
/// `sql_query` is planned again at every call, which for this statement costs more than
/// running it on a small batch). Each `$n` of the text takes its bind where it stands, so a
/// value used twice is bound twice.
struct BatchStatement<'a> {
    sql: String,
    cursor: &'a Cursor,
    limit: i64,
    max_bytes: i64,
    exclude: &'a [i64],
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
            let n = rest[at + 1..].bytes().next();
            match n {
                Some(b'1') => out.push_bind_param::<BigInt, _>(&self.cursor.upto_seq)?,
                Some(b'2') => out.push_bind_param::<Text, _>(&self.cursor.snap)?,
                Some(b'3') => out.push_bind_param::<BigInt, _>(&self.limit)?,
                Some(b'4') => out.push_bind_param::<BigInt, _>(&self.max_bytes)?,
                Some(b'5') => out.push_bind_param::<Array<BigInt>, _>(self.exclude)?,
                // a `$` of a quoted name: text
                _ => {
                    out.push_sql("$");
                    rest = &rest[at + 1..];
                    continue;
                }
            }
            rest = &rest[at + 2..];
        }
        out.push_sql(rest);
        Ok(())
    }
}

/// The statement of [`fetch_batch`] for `partition` of `table`; its binds: the cursor's `seq`
/// and snapshot, the row limit, the byte budget, the released rows to leave out.
///
/// The late rows are looked up by transaction id alone, behind an `OFFSET 0` fence, and only
/// then tested for being unpublished: given the test inside, the planner may read every
/// unpublished row through `outbox_ready` and filter it by transaction id, which it prefers
/// whenever the statistics see few distinct transaction ids (a backlog written in a few large
/// transactions): 30 ms a batch with 100,000 rows waiting, against 1.5 ms by `outbox_txid`.
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
         (SELECT {COLUMNS}, 1 FROM (SELECT * FROM {t} o \
         WHERE o.txid = ANY(ARRAY(SELECT pg_snapshot_xip($2::pg_snapshot))) OFFSET 0) o \
         WHERE o.published_at IS NULL AND o.parked_at IS NULL{part} AND o.seq <= $1) \
         UNION ALL \
         (SELECT {COLUMNS}, 1 FROM (SELECT * FROM {t} o \
         WHERE o.txid >= pg_snapshot_xmax($2::pg_snapshot) \
         AND o.txid < pg_snapshot_xmax(pg_current_snapshot()) OFFSET 0) o \
         WHERE o.published_at IS NULL AND o.parked_at IS NULL{part} AND o.seq <= $1) \
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
