//! The poll: reading the unpublished rows in `seq` order, and the session it runs in.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{Array, BigInt, Bool, Integer, Text};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;

use super::rows::OutboxRowText;
use super::{OutboxRow, Partition, hold_back};

/// `SELECT … FROM outbox WHERE unpublished, not parked [, in the partitions] [, not of a
/// held-back aggregate] ORDER BY seq LIMIT n [FOR UPDATE SKIP LOCKED]`.
#[derive(Debug)]
struct FetchBatch<'a> {
    table: &'a OutboxTable,
    partitions: &'a [i32],
    count: u32,
    limit: i64,
    /// `aggregate_type.aggregate_id` of aggregates with a parked row
    held_back: &'a [String],
    /// rows the caller already holds (sent, or acked and not yet marked)
    exclude: &'a [i64],
    /// competing workers: lock the rows, skip rows others locked
    skip_locked: bool,
    /// add the column `held`: whether an earlier row of the row's aggregate is parked (or
    /// held), evaluated for the returned rows alone
    flag_held: bool,
    /// stop once the payloads (as their JSON text) reach this many bytes; the first row is
    /// always taken
    max_bytes: Option<i64>,
}

impl QueryId for FetchBatch<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl Query for FetchBatch<'_> {
    type SqlType = diesel::sql_types::Untyped;
}

impl QueryFragment<Pg> for FetchBatch<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        const COLUMNS: &str = "o.seq, o.id, o.aggregate_type, o.aggregate_id, o.event_type, \
                               o.payload, o.headers, o.created_at, o.attempts";
        // as read from the table: the payload written out as text once, where the byte
        // budget counts it and whence it is returned ([`OutboxRowText`])
        const READ: &str = "o.seq, o.id, o.aggregate_type, o.aggregate_id, o.event_type, \
                            o.payload::text AS payload, o.headers, o.created_at, o.attempts";
        let held = if self.flag_held { ", o.held" } else { "" };
        if self.max_bytes.is_some() {
            // the rows in `seq` order, each with the bytes of the payloads before it; a row is
            // taken while those stay under the budget
            out.push_sql(&format!(
                "SELECT {COLUMNS}{held} FROM (SELECT {COLUMNS}{held}, \
                 COALESCE(sum(octet_length(o.payload)) OVER (ORDER BY o.seq \
                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before FROM ("
            ));
        }
        out.push_sql(&format!("SELECT {READ}"));
        if self.flag_held {
            out.push_sql(&format!(
                ", {} AS held",
                super::parking::earlier_waiting_sql(&self.table.quoted(), "IS NOT NULL")
            ));
        }
        out.push_sql(" FROM ");
        self.table.walk_ast(&mut out)?;
        out.push_sql(" o WHERE o.published_at IS NULL AND o.parked_at IS NULL");
        if self.count > 1 {
            // the count is a literal: each partition count gets its own cached plan
            out.push_sql(&format!(" AND o.aggregate_hash % {} = ANY(", self.count));
            out.push_bind_param::<Array<Integer>, _>(self.partitions)?;
            out.push_sql(")");
        }
        if !self.held_back.is_empty() {
            // an aggregate type has no `.`: the key is unambiguous
            out.push_sql(" AND (o.aggregate_type || '.' || o.aggregate_id) <> ALL(");
            out.push_bind_param::<Array<Text>, _>(self.held_back)?;
            out.push_sql(")");
        }
        if !self.exclude.is_empty() {
            out.push_sql(" AND o.seq <> ALL(");
            out.push_bind_param::<Array<BigInt>, _>(self.exclude)?;
            out.push_sql(")");
            // planned with the array as a constant, PostgreSQL hashes it; a cached generic
            // plan would compare every row with every element
            out.unsafe_to_cache_prepared();
        }
        out.push_sql(" ORDER BY o.seq LIMIT ");
        out.push_bind_param::<BigInt, _>(&self.limit)?;
        if self.skip_locked {
            out.push_sql(" FOR UPDATE SKIP LOCKED");
        }
        if let Some(max_bytes) = &self.max_bytes {
            out.push_sql(") o) o WHERE o.before < ");
            out.push_bind_param::<BigInt, _>(max_bytes)?;
            out.push_sql(" ORDER BY o.seq");
        }
        Ok(())
    }
}

impl<Conn> diesel::RunQueryDsl<Conn> for FetchBatch<'_> {}

/// Reads up to `limit` rows of `partition` that are not published yet (nor parked), oldest
/// `seq` first, leaving out the aggregates of `held_back` (see [`held_back_aggregates`](super::held_back_aggregates)).
pub async fn fetch_unpublished(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partition: Partition,
    held_back: &[String],
    limit: i64,
) -> QueryResult<Vec<OutboxRow>> {
    let partitions = [partition.index as i32];
    fetch_partitions(conn, table, &partitions, partition.count, held_back, limit).await
}

/// [`fetch_unpublished`] for several partitions (of `count`) at once: one query, in `seq`
/// order across them. Traced as the span `outbox.claim`.
pub async fn fetch_partitions(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partitions: &[i32],
    count: u32,
    held_back: &[String],
    limit: i64,
) -> QueryResult<Vec<OutboxRow>> {
    fetch_partitions_excluding(conn, table, partitions, count, held_back, &[], limit, None).await
}

/// [`fetch_partitions`] leaving out the rows `exclude` (by `seq`): a relay that keeps
/// publishing while it fetches passes the rows it already holds, sent and not yet marked. Each
/// fetch reads from the oldest unpublished row, so a row that committed late, after later
/// ones were fetched, is found by the next fetch, in `seq` order with the rows after it.
///
/// With `max_bytes`, it stops once the payloads taken (as their JSON text) reach that many
/// bytes: the first row always, each further one while the payloads before it stay under the
/// budget. So a batch holds at most `max_bytes` plus one payload whatever the payloads' sizes.
#[allow(clippy::too_many_arguments)]
#[tracing::instrument(name = "outbox.claim", level = "debug", skip_all, fields(outbox.table = %table, outbox.partitions = partitions.len(), outbox.held = exclude.len()))]
pub async fn fetch_partitions_excluding(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partitions: &[i32],
    count: u32,
    held_back: &[String],
    exclude: &[i64],
    limit: i64,
    max_bytes: Option<i64>,
) -> QueryResult<Vec<OutboxRow>> {
    if partitions.is_empty() {
        return Ok(Vec::new());
    }
    FetchBatch {
        table,
        partitions,
        count,
        limit,
        held_back,
        exclude,
        skip_locked: false,
        flag_held: false,
        max_bytes,
    }
    .load::<OutboxRowText>(conn)
    .await
    .map(|rows| rows.into_iter().map(OutboxRow::from).collect())
}

/// A fetched row and whether it is held back.
#[derive(QueryableByName)]
struct Fetched {
    #[diesel(embed)]
    event: OutboxRowText,
    #[diesel(sql_type = Bool)]
    held: bool,
}

/// The ordered relay's poll: like [`fetch_partitions_excluding`], but a row of an aggregate
/// whose earlier row is parked is not returned: it is held back, set aside with `parked_at =
/// '-infinity'` (see [`hold_back`]) the first time a poll meets it. The poll's index
/// (`outbox_ready`: unpublished, not parked, not held) then no longer holds it, so a poll costs
/// the same whatever number of rows wait behind a parked one. [`retry_parked`](super::retry_parked) releases them
/// with the parked row. `max_bytes` bounds the batch's payloads as in
/// [`fetch_partitions_excluding`]. Traced as the span `outbox.claim`.
#[tracing::instrument(name = "outbox.claim", level = "debug", skip_all, fields(outbox.table = %table, outbox.partitions = partitions.len(), outbox.held = exclude.len()))]
pub async fn fetch_ready(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partitions: &[i32],
    count: u32,
    exclude: &[i64],
    limit: i64,
    max_bytes: Option<i64>,
) -> QueryResult<Vec<OutboxRow>> {
    if partitions.is_empty() {
        return Ok(Vec::new());
    }
    let fetched: Vec<Fetched> = FetchBatch {
        table,
        partitions,
        count,
        limit,
        held_back: &[],
        exclude,
        skip_locked: false,
        flag_held: true,
        max_bytes,
    }
    .load(conn)
    .await?;
    let held: Vec<i64> = fetched
        .iter()
        .filter(|f| f.held)
        .map(|f| f.event.seq())
        .collect();
    if !held.is_empty() {
        let n = hold_back(conn, table, &held).await?;
        tracing::debug!(
            held = n,
            "rows held back behind a parked row of their aggregate"
        );
    }
    Ok(fetched
        .into_iter()
        .filter(|f| !f.held)
        .map(|f| f.event.into())
        .collect())
}

/// For competing workers, inside a transaction: locks and returns up to `limit` unpublished,
/// unparked rows, oldest first, skipping rows other workers hold. Order across workers is not
/// kept. With `max_bytes`, it returns rows only while their payloads stay within that budget
/// (as [`fetch_partitions_excluding`] does); the rows it locked and did not return stay locked
/// until the transaction ends. Traced as the span `outbox.claim`.
#[tracing::instrument(name = "outbox.claim", level = "debug", skip_all, fields(outbox.table = %table))]
pub async fn claim_unpublished(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    limit: i64,
    max_bytes: Option<i64>,
) -> QueryResult<Vec<OutboxRow>> {
    FetchBatch {
        table,
        partitions: &[],
        count: 1,
        limit,
        held_back: &[],
        exclude: &[],
        skip_locked: true,
        flag_held: false,
        max_bytes,
    }
    .load::<OutboxRowText>(conn)
    .await
    .map(|rows| rows.into_iter().map(OutboxRow::from).collect())
}

/// A line of an `EXPLAIN`'s output.
#[derive(QueryableByName)]
pub(crate) struct PlanLine {
    #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
    pub(crate) line: String,
}

/// The relay's poll of `partitions` as [`explain_poll`] shows it.
fn polled<'a>(
    table: &'a OutboxTable,
    partitions: &'a [i32],
    count: u32,
    limit: i64,
) -> FetchBatch<'a> {
    FetchBatch {
        table,
        partitions,
        count,
        limit,
        held_back: &[],
        exclude: &[],
        skip_locked: false,
        flag_held: true,
        max_bytes: None,
    }
}

/// The plan of the relay's poll of `partitions` (of `count`; `[0]` of 1 for the whole table)
/// as `EXPLAIN` prints it, line by line, planned in `conn`'s session: call
/// [`prepare_session`](super::prepare_session) first to see the plan the relay gets. The poll should be an `Index
/// Scan using outbox_ready` (the partial index on unpublished rows that are neither parked
/// nor held back) under a `Limit`, with no `Sort` and no `Seq Scan`.
pub async fn explain_poll(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partitions: &[i32],
    count: u32,
    limit: i64,
) -> QueryResult<Vec<String>> {
    let lines: Vec<PlanLine> = Explain {
        query: polled(table, partitions, count, limit),
        analyze: false,
    }
    .load(conn)
    .await?;
    Ok(lines.into_iter().map(|l| l.line).collect())
}

/// [`explain_poll`] run with `EXPLAIN (ANALYZE, BUFFERS)`: the poll executed, with the rows
/// and buffers each node read. What it costs shows in the first line's `Buffers:` figure.
pub async fn explain_poll_analyze(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partitions: &[i32],
    count: u32,
    limit: i64,
) -> QueryResult<Vec<String>> {
    let lines: Vec<PlanLine> = Explain {
        query: polled(table, partitions, count, limit),
        analyze: true,
    }
    .load(conn)
    .await?;
    Ok(lines.into_iter().map(|l| l.line).collect())
}

/// `EXPLAIN` in front of a query, with `ANALYZE, BUFFERS` when `analyze` (the query runs).
#[derive(Debug)]
struct Explain<Q> {
    query: Q,
    analyze: bool,
}

impl<Q> QueryId for Explain<Q> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Q> Query for Explain<Q> {
    type SqlType = diesel::sql_types::Untyped;
}

impl<Q: QueryFragment<Pg>> QueryFragment<Pg> for Explain<Q> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(if self.analyze {
            "EXPLAIN (ANALYZE, BUFFERS) "
        } else {
            "EXPLAIN "
        });
        self.query.walk_ast(out.reborrow())
    }
}

impl<Q, Conn> diesel::RunQueryDsl<Conn> for Explain<Q> {}
