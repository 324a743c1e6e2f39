//! The relay's database side (feature `async`): read the unpublished rows of a partition in
//! `seq` order, mark the acked ones, record failures, and hold a partition's lease.
//!
//! `outbox-nats`'s relay drives these; they are public so that other transports can reuse
//! them. Every function takes the [`OutboxTable`] it works on.

use chrono::{DateTime, Utc};
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{
    Array, BigInt, Bool, Integer, Jsonb, Nullable, Text, Timestamptz, Uuid as SqlUuid,
};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use uuid::Uuid;

use crate::{OutboxTable, RawJson};

/// One outbox row, as the relay publishes it.
#[derive(Debug, Clone, PartialEq, QueryableByName)]
pub struct OutboxRow {
    /// Insertion order.
    #[diesel(sql_type = BigInt)]
    pub seq: i64,
    /// The message id: `Nats-Msg-Id`.
    #[diesel(sql_type = SqlUuid)]
    pub id: Uuid,
    /// The aggregate's type.
    #[diesel(sql_type = Text)]
    pub aggregate_type: String,
    /// The aggregate's id.
    #[diesel(sql_type = Text)]
    pub aggregate_id: String,
    /// The event's type.
    #[diesel(sql_type = Text)]
    pub event_type: String,
    /// The message body: the `jsonb` text as PostgreSQL renders it, published as it is.
    #[diesel(sql_type = Jsonb)]
    pub payload: RawJson,
    /// Extra headers (a JSON object).
    #[diesel(sql_type = Jsonb)]
    pub headers: serde_json::Value,
    /// When it was recorded.
    #[diesel(sql_type = Timestamptz)]
    pub created_at: DateTime<Utc>,
    /// Failed attempts so far.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
}

/// Which rows a relay task works on: all of them, or the rows whose `aggregate_hash` falls
/// in partition `index` of `count` (`aggregate_hash % count = index`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Partition {
    /// This partition's number, `0..count`.
    pub index: u32,
    /// How many partitions the table is split into.
    pub count: u32,
}

impl Partition {
    /// The whole table as one partition.
    pub const ALL: Partition = Partition { index: 0, count: 1 };

    /// The partition an aggregate id falls in: the first 28 bits of the MD5 of the id,
    /// modulo `count`. The same as the table's generated `aggregate_hash % count`.
    ///
    /// ```
    /// use outbox_diesel::relay::Partition;
    /// assert_eq!(Partition::hash("a.b c"), 251735073);
    /// assert_eq!(Partition::of("a.b c", 16).index, 251735073 % 16);
    /// ```
    pub fn of(aggregate_id: &str, count: u32) -> Partition {
        Partition {
            index: Partition::hash(aggregate_id) as u32 % count.max(1),
            count: count.max(1),
        }
    }

    /// The stable hash of an aggregate id: the first 28 bits of its MD5, as the table's
    /// `aggregate_hash` column computes it.
    pub fn hash(aggregate_id: &str) -> i32 {
        use md5::Digest;
        let d = md5::Md5::digest(aggregate_id.as_bytes());
        ((u32::from_be_bytes([d[0], d[1], d[2], d[3]])) >> 4) as i32
    }
}

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
        let held = if self.flag_held { ", o.held" } else { "" };
        if self.max_bytes.is_some() {
            // the rows in `seq` order, each with the bytes of the payloads before it; a row is
            // taken while those stay under the budget
            out.push_sql(&format!(
                "SELECT {COLUMNS}{held} FROM (SELECT {COLUMNS}{held}, \
                 COALESCE(sum(octet_length(o.payload::text)) OVER (ORDER BY o.seq \
                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before FROM ("
            ));
        }
        out.push_sql(&format!("SELECT {COLUMNS}"));
        if self.flag_held {
            out.push_sql(", EXISTS (SELECT 1 FROM ");
            self.table.walk_ast(&mut out)?;
            out.push_sql(
                " p WHERE p.parked_at IS NOT NULL AND p.published_at IS NULL \
                 AND p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id \
                 AND p.seq < o.seq) AS held",
            );
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
/// `seq` first, leaving out the aggregates of `held_back` (see [`held_back_aggregates`]).
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
    .load(conn)
    .await
}

/// A fetched row and whether it is held back.
#[derive(QueryableByName)]
struct Fetched {
    #[diesel(embed)]
    event: OutboxRow,
    #[diesel(sql_type = Bool)]
    held: bool,
}

/// The ordered relay's poll: like [`fetch_partitions_excluding`], but a row of an aggregate
/// whose earlier row is parked is not returned: it is held back, set aside with `parked_at =
/// '-infinity'` (see [`hold_back`]) the first time a poll meets it. The poll's index
/// (`outbox_ready`: unpublished, not parked, not held) then no longer holds it, so a poll costs
/// the same whatever number of rows wait behind a parked one. [`retry_parked`] releases them
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
        .map(|f| f.event.seq)
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
        .map(|f| f.event)
        .collect())
}

/// The first key of the transaction advisory lock that orders [`hold_back`] and
/// [`retry_parked`] on a table (the second is the table's OID): `'OBHD'` in ASCII, far above
/// the OIDs of user tables that the partition locks use there.
pub const HOLD_LOCK_KEY: i32 = 0x4F42_4844;

/// Sets aside the rows `seqs` whose aggregate has an earlier parked (or held) row, with
/// `parked_at = '-infinity'`: unpublished, out of the poll's index, released by
/// [`retry_parked`] with the parked row. A row whose aggregate no longer has one (a `retry`
/// ran meanwhile) is left as it is. Returns how many it set aside.
pub async fn hold_back(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seqs: &[i64],
) -> QueryResult<usize> {
    use diesel_async::AsyncConnection;
    let t = table.quoted();
    conn.transaction(async |conn| {
        lock_holds(conn, table).await?;
        diesel::sql_query(format!(
            "UPDATE {t} o SET parked_at = '-infinity' WHERE o.seq = ANY($1) \
             AND o.published_at IS NULL AND o.parked_at IS NULL AND EXISTS (SELECT 1 FROM {t} p \
             WHERE p.parked_at IS NOT NULL AND p.published_at IS NULL \
             AND p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id \
             AND p.seq < o.seq)"
        ))
        .bind::<Array<BigInt>, _>(seqs)
        .execute(conn)
        .await
    })
    .await
}

/// Serialises holding back and retrying on `table` until the transaction ends: a retry that
/// commits is seen by a later hold, which then leaves the released aggregate's rows alone.
async fn lock_holds(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<()> {
    diesel::sql_query(format!(
        "SELECT pg_advisory_xact_lock({HOLD_LOCK_KEY}, to_regclass($1)::oid::int)"
    ))
    .bind::<Text, _>(table.quoted())
    .execute(conn)
    .await
    .map(drop)
}

#[derive(QueryableByName)]
struct Key {
    #[diesel(sql_type = Text)]
    k: String,
}

/// The aggregates held back by a parked row, as `aggregate_type.aggregate_id` keys: in
/// ordered mode, their later rows wait until the parked row is retried.
pub async fn held_back_aggregates(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<Vec<String>> {
    let keys: Vec<Key> = diesel::sql_query(format!(
        "SELECT DISTINCT aggregate_type || '.' || aggregate_id AS k FROM {} \
         WHERE parked_at > '-infinity'",
        table.quoted()
    ))
    .load(conn)
    .await?;
    Ok(keys.into_iter().map(|k| k.k).collect())
}

/// Prepares a relay's session: its poll must stay an ordered scan of the partial index on
/// unpublished rows whatever the table's statistics say. A table that fills faster than
/// autovacuum analyzes it has statistics that call it empty, and the planner would then sort
/// the whole backlog on every poll; the relay's session therefore disables sorts and
/// sequential scans, which leaves the index scans the queries are written for. It also turns
/// JIT off: a disabled plan node costs 10^10, far above `jit_above_cost`, and compiling the
/// session's small queries (the membership query on `pg_locks`, which must sort) would take
/// most of a second each.
///
/// Its commits (the marks) do not wait for the WAL flush (`synchronous_commit = off`): a mark
/// lost in a database crash only makes the relay publish the row again, which JetStream drops
/// by its message id, the same outcome as a relay that dies between publish and mark.
pub async fn prepare_session(conn: &mut AsyncPgConnection) -> QueryResult<()> {
    use diesel_async::SimpleAsyncConnection;
    conn.batch_execute(
        "SET enable_sort = off; SET enable_seqscan = off; SET jit = off; \
         SET synchronous_commit = off",
    )
    .await
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
    .load(conn)
    .await
}

#[derive(Debug)]
struct MarkPublished<'a> {
    table: &'a OutboxTable,
    seqs: &'a [i64],
}

impl QueryId for MarkPublished<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for MarkPublished<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("UPDATE ");
        self.table.walk_ast(&mut out)?;
        out.push_sql(" SET published_at = now() WHERE seq = ANY(");
        out.push_bind_param::<Array<BigInt>, _>(self.seqs)?;
        out.push_sql(") AND published_at IS NULL");
        Ok(())
    }
}

impl<Conn> diesel::RunQueryDsl<Conn> for MarkPublished<'_> {}

/// Sets `published_at` on the rows `seqs` (those JetStream acked); returns how many it marked.
/// Traced as the span `outbox.mark`.
#[tracing::instrument(name = "outbox.mark", level = "debug", skip_all, fields(outbox.table = %table, batch.len = seqs.len()))]
pub async fn mark_published(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seqs: &[i64],
) -> QueryResult<usize> {
    if seqs.is_empty() {
        return Ok(0);
    }
    MarkPublished { table, seqs }.execute(conn).await
}

/// Deletes the rows `seqs` (those JetStream acked) instead of marking them: for a relay that
/// keeps no published history, about a sixth of the database work of
/// [`mark_published`] and the later cleanup together. Returns how many it deleted. Traced as
/// the span `outbox.mark`.
#[tracing::instrument(name = "outbox.mark", level = "debug", skip_all, fields(outbox.table = %table, batch.len = seqs.len()))]
pub async fn delete_acked(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seqs: &[i64],
) -> QueryResult<usize> {
    if seqs.is_empty() {
        return Ok(0);
    }
    diesel::sql_query(format!(
        "DELETE FROM {} WHERE seq = ANY($1)",
        table.quoted()
    ))
    .bind::<Array<BigInt>, _>(seqs)
    .execute(conn)
    .await
}

/// Counts a failed publish of row `seq` with its error; parks the row (it is then skipped,
/// and holds back the later rows of its aggregate) when `park` is set.
pub async fn record_failure(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seq: i64,
    error: &str,
    park: bool,
) -> QueryResult<()> {
    diesel::sql_query(format!(
        "UPDATE {} SET attempts = attempts + 1, last_error = $1, \
         parked_at = CASE WHEN $2 THEN now() ELSE parked_at END WHERE seq = $3",
        table.quoted()
    ))
    .bind::<Text, _>(error)
    .bind::<Bool, _>(park)
    .bind::<BigInt, _>(seq)
    .execute(conn)
    .await
    .map(drop)
}

#[derive(QueryableByName)]
struct Flag {
    #[diesel(sql_type = Nullable<Bool>)]
    flag: Option<bool>,
}

/// Whether `table` exists (and is visible to this role).
pub async fn table_exists(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<bool> {
    let f: Flag = diesel::sql_query("SELECT to_regclass($1) IS NOT NULL AS flag")
        .bind::<Text, _>(table.quoted())
        .get_result(conn)
        .await?;
    Ok(f.flag.unwrap_or(false))
}

/// Tries to take the session advisory lock that makes this connection the owner of
/// `partition` of `table`; `true` when it got it (or already held it).
///
/// The lock is `pg_try_advisory_lock(<table oid>, <partition index>)`: it is released when
/// the connection closes, so a dead relay's partitions are free as soon as PostgreSQL notices
/// its connection is gone.
pub async fn try_lock_partition(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partition: Partition,
) -> QueryResult<bool> {
    let f: Flag =
        diesel::sql_query("SELECT pg_try_advisory_lock(to_regclass($1)::oid::int, $2) AS flag")
            .bind::<Text, _>(table.quoted())
            .bind::<Integer, _>(partition.index as i32)
            .get_result(conn)
            .await?;
    Ok(f.flag.unwrap_or(false))
}

/// Releases the lock taken by [`try_lock_partition`].
pub async fn unlock_partition(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partition: Partition,
) -> QueryResult<bool> {
    let f: Flag =
        diesel::sql_query("SELECT pg_advisory_unlock(to_regclass($1)::oid::int, $2) AS flag")
            .bind::<Text, _>(table.quoted())
            .bind::<Integer, _>(partition.index as i32)
            .get_result(conn)
            .await?;
    Ok(f.flag.unwrap_or(false))
}

/// The backlog of a table: unpublished rows, the age of the oldest, parked rows, and the rows
/// whose publishing was attempted and failed (in doubt).
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct Backlog {
    /// Rows not published yet (parked ones included).
    #[diesel(sql_type = BigInt)]
    pub unpublished: i64,
    /// Seconds since the oldest unpublished row was recorded; 0 when there is none.
    #[diesel(sql_type = diesel::sql_types::Double)]
    pub oldest_age_seconds: f64,
    /// Rows the relay gave up on.
    #[diesel(sql_type = BigInt)]
    pub parked: i64,
    /// Unpublished rows with failed attempts (`attempts > 0`, parked ones included): their
    /// publishing was tried, so JetStream may hold a copy, and a re-publish older than the
    /// stream's duplicate window is a real duplicate.
    #[diesel(sql_type = BigInt)]
    pub in_doubt: i64,
    /// Seconds since the oldest in-doubt row was recorded; 0 when there is none.
    #[diesel(sql_type = diesel::sql_types::Double)]
    pub oldest_in_doubt_age_seconds: f64,
}

/// Reads the backlog of `table`.
pub async fn backlog(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<Backlog> {
    diesel::sql_query(format!(
        "SELECT count(*) AS unpublished, \
         COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8 AS oldest_age_seconds, \
         count(*) FILTER (WHERE parked_at > '-infinity') AS parked, \
         count(*) FILTER (WHERE attempts > 0) AS in_doubt, \
         COALESCE(EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE attempts > 0)), 0)::float8 \
         AS oldest_in_doubt_age_seconds \
         FROM {} WHERE published_at IS NULL",
        table.quoted()
    ))
    .get_result(conn)
    .await
}

/// The backlog of one partition (see [`partition_backlog`]).
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct PartitionBacklog {
    /// The partition: `aggregate_hash % count`.
    #[diesel(sql_type = Integer)]
    pub partition: i32,
    /// Its unpublished rows (parked ones included).
    #[diesel(sql_type = BigInt)]
    pub unpublished: i64,
    /// Seconds since its oldest unpublished row was recorded; 0 when there is none.
    #[diesel(sql_type = diesel::sql_types::Double)]
    pub oldest_age_seconds: f64,
    /// Its parked rows.
    #[diesel(sql_type = BigInt)]
    pub parked: i64,
}

/// The backlog of every partition of `table` split into `count` partitions, partition by
/// partition (`0..count`, empty ones included).
pub async fn partition_backlog(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    count: u32,
) -> QueryResult<Vec<PartitionBacklog>> {
    diesel::sql_query(format!(
        "SELECT p.partition, COALESCE(b.unpublished, 0) AS unpublished, \
         COALESCE(b.oldest_age_seconds, 0)::float8 AS oldest_age_seconds, \
         COALESCE(b.parked, 0) AS parked \
         FROM generate_series(0, $1 - 1) AS p(partition) LEFT JOIN ( \
         SELECT aggregate_hash % $1 AS partition, count(*) AS unpublished, \
         EXTRACT(EPOCH FROM now() - min(created_at))::float8 AS oldest_age_seconds, \
         count(*) FILTER (WHERE parked_at > '-infinity') AS parked \
         FROM {} WHERE published_at IS NULL GROUP BY 1) b USING (partition) ORDER BY 1",
        table.quoted()
    ))
    .bind::<Integer, _>(count.max(1) as i32)
    .load(conn)
    .await
}

/// What vacuum knows of the outbox table (`pg_stat_user_tables`): dead rows slow the poll
/// until vacuum removes them, and it can only remove those older than the oldest snapshot
/// still open (see [`oldest_transaction`]).
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct TableStats {
    /// Live rows, as PostgreSQL's statistics estimate them.
    #[diesel(sql_type = BigInt)]
    pub live_rows: i64,
    /// Dead rows (deleted or updated row versions) not vacuumed yet.
    #[diesel(sql_type = BigInt)]
    pub dead_rows: i64,
    /// The table's size on disk with its indexes and TOAST, in bytes.
    #[diesel(sql_type = BigInt)]
    pub total_bytes: i64,
    /// When autovacuum last vacuumed it.
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub last_autovacuum: Option<DateTime<Utc>>,
    /// When it was last vacuumed by hand.
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub last_vacuum: Option<DateTime<Utc>>,
    /// How often autovacuum vacuumed it (since the statistics were reset).
    #[diesel(sql_type = BigInt)]
    pub autovacuum_count: i64,
    /// When autovacuum last analyzed it.
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub last_autoanalyze: Option<DateTime<Utc>>,
}

/// Reads the vacuum figures of `table`; `None` when the statistics have no row for it.
pub async fn table_stats(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<Option<TableStats>> {
    use diesel::OptionalExtension;
    diesel::sql_query(
        "SELECT n_live_tup AS live_rows, n_dead_tup AS dead_rows, \
         pg_total_relation_size(relid) AS total_bytes, last_autovacuum, last_vacuum, \
         autovacuum_count, last_autoanalyze \
         FROM pg_stat_user_tables WHERE relid = to_regclass($1)",
    )
    .bind::<Text, _>(table.quoted())
    .get_result(conn)
    .await
    .optional()
}

/// The open transaction or snapshot of this database that has held back vacuum longest (see
/// [`oldest_transaction`]).
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct OldestTransaction {
    /// Its backend's pid (`pg_stat_activity.pid`).
    #[diesel(sql_type = Integer)]
    pub pid: i32,
    /// Its role.
    #[diesel(sql_type = Nullable<Text>)]
    pub role: Option<String>,
    /// Its `application_name`.
    #[diesel(sql_type = Nullable<Text>)]
    pub application_name: Option<String>,
    /// Its address; `None` for a Unix socket.
    #[diesel(sql_type = Nullable<Text>)]
    pub client_addr: Option<String>,
    /// Its state: `active`, `idle in transaction`, ...
    #[diesel(sql_type = Nullable<Text>)]
    pub state: Option<String>,
    /// Seconds since its transaction (or, outside one, its query) started.
    #[diesel(sql_type = diesel::sql_types::Double)]
    pub age_seconds: f64,
    /// Transactions started since its snapshot (`age(backend_xmin)`): vacuum keeps every row
    /// version deleted within them.
    #[diesel(sql_type = Integer)]
    pub xmin_age: i32,
}

/// The session of this database whose snapshot is oldest (other than the caller's), if any
/// holds one: every row deleted or updated since it started stays on disk, and the poll wades
/// through it, until it ends. An `idle in transaction` session here is the classic cause of a
/// poll that slows from sub-millisecond to tens of milliseconds.
///
/// A role sees the snapshots of other roles' sessions only with `pg_read_all_stats` (e.g.
/// through `pg_monitor`); without it this shows the oldest of its own role's sessions.
pub async fn oldest_transaction(
    conn: &mut AsyncPgConnection,
) -> QueryResult<Option<OldestTransaction>> {
    use diesel::OptionalExtension;
    diesel::sql_query(
        "SELECT pid, usename::text AS role, application_name, host(client_addr) AS client_addr, \
         state, COALESCE(EXTRACT(EPOCH FROM now() - COALESCE(xact_start, query_start)), 0)::float8 \
         AS age_seconds, age(COALESCE(backend_xmin, backend_xid)) AS xmin_age \
         FROM pg_stat_activity \
         WHERE COALESCE(backend_xmin, backend_xid) IS NOT NULL AND pid <> pg_backend_pid() \
         AND datid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         ORDER BY age(COALESCE(backend_xmin, backend_xid)) DESC, xact_start LIMIT 1",
    )
    .get_result(conn)
    .await
    .optional()
}

/// Deletes up to `limit` rows published more than `older_than` ago, oldest first (found
/// through the partial index `outbox_published`), skipping rows another cleaner has locked
/// (`SKIP LOCKED`, so concurrent cleaners never wait on each other); returns how many.
/// Bounded batches keep locks short; call it until it returns less than `limit`. Unpublished
/// rows, and so the relay's poll, are never touched.
pub async fn delete_published(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    older_than: std::time::Duration,
    limit: i64,
) -> QueryResult<usize> {
    let t = table.quoted();
    diesel::sql_query(format!(
        "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} WHERE published_at IS NOT NULL \
         AND published_at < now() - make_interval(secs => $1) ORDER BY published_at LIMIT $2 \
         FOR UPDATE SKIP LOCKED)"
    ))
    .bind::<diesel::sql_types::Double, _>(older_than.as_secs_f64())
    .bind::<BigInt, _>(limit)
    .execute(conn)
    .await
}

/// The plan of the relay's poll of `partitions` (of `count`; `[0]` of 1 for the whole table)
/// as `EXPLAIN` prints it, line by line, planned in `conn`'s session: call
/// [`prepare_session`] first to see the plan the relay gets. The poll should be an `Index
/// Scan using outbox_ready` (the partial index on unpublished rows that are neither parked
/// nor held back) under a `Limit`, with no `Sort` and no `Seq Scan`.
pub async fn explain_poll(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partitions: &[i32],
    count: u32,
    limit: i64,
) -> QueryResult<Vec<String>> {
    #[derive(QueryableByName)]
    struct PlanLine {
        #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
        line: String,
    }
    let fetch = FetchBatch {
        table,
        partitions,
        count,
        limit,
        held_back: &[],
        exclude: &[],
        skip_locked: false,
        flag_held: true,
        max_bytes: None,
    };
    let lines: Vec<PlanLine> = Explain(fetch).load(conn).await?;
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
    #[derive(QueryableByName)]
    struct PlanLine {
        #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
        line: String,
    }
    let fetch = FetchBatch {
        table,
        partitions,
        count,
        limit,
        held_back: &[],
        exclude: &[],
        skip_locked: false,
        flag_held: true,
        max_bytes: None,
    };
    let lines: Vec<PlanLine> = ExplainAnalyze(fetch).load(conn).await?;
    Ok(lines.into_iter().map(|l| l.line).collect())
}

/// `EXPLAIN (ANALYZE, BUFFERS)` in front of a query.
#[derive(Debug)]
struct ExplainAnalyze<Q>(Q);

impl<Q> QueryId for ExplainAnalyze<Q> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Q> Query for ExplainAnalyze<Q> {
    type SqlType = diesel::sql_types::Untyped;
}

impl<Q: QueryFragment<Pg>> QueryFragment<Pg> for ExplainAnalyze<Q> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("EXPLAIN (ANALYZE, BUFFERS) ");
        self.0.walk_ast(out.reborrow())
    }
}

impl<Q, Conn> diesel::RunQueryDsl<Conn> for ExplainAnalyze<Q> {}

/// `EXPLAIN` in front of a query.
#[derive(Debug)]
struct Explain<Q>(Q);

impl<Q> QueryId for Explain<Q> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Q> Query for Explain<Q> {
    type SqlType = diesel::sql_types::Untyped;
}

impl<Q: QueryFragment<Pg>> QueryFragment<Pg> for Explain<Q> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("EXPLAIN ");
        self.0.walk_ast(out.reborrow())
    }
}

impl<Q, Conn> diesel::RunQueryDsl<Conn> for Explain<Q> {}

/// Like [`delete_published`], but moves the rows into `archive` in the same statement (a
/// table with the outbox's columns, e.g. `CREATE TABLE outbox_archive (LIKE outbox)`);
/// returns how many it moved.
pub async fn archive_published(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    archive: &OutboxTable,
    older_than: std::time::Duration,
    limit: i64,
) -> QueryResult<usize> {
    const COLUMNS: &str = "seq, id, aggregate_type, aggregate_id, event_type, payload, headers, \
         created_at, published_at, aggregate_hash, attempts, last_error, parked_at";
    let (t, a) = (table.quoted(), archive.quoted());
    diesel::sql_query(format!(
        "WITH moved AS (DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} \
         WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1) \
         ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED) RETURNING {COLUMNS}) \
         INSERT INTO {a} ({COLUMNS}) SELECT {COLUMNS} FROM moved"
    ))
    .bind::<diesel::sql_types::Double, _>(older_than.as_secs_f64())
    .bind::<BigInt, _>(limit)
    .execute(conn)
    .await
}

/// A relay session holding a partition's lease.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct PartitionOwner {
    /// The partition.
    #[diesel(sql_type = Integer)]
    pub partition: i32,
    /// The owner's backend process id (`pg_stat_activity.pid`).
    #[diesel(sql_type = Integer)]
    pub pid: i32,
    /// The owner's `application_name`.
    #[diesel(sql_type = Nullable<Text>)]
    pub application_name: Option<String>,
    /// The owner's address.
    #[diesel(sql_type = Nullable<Text>)]
    pub client_addr: Option<String>,
    /// Seconds since the owner's current state began.
    #[diesel(sql_type = diesel::sql_types::Double)]
    pub state_age_seconds: f64,
}

/// The sessions that hold partition leases of `table`, by partition.
pub async fn partition_owners(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<Vec<PartitionOwner>> {
    diesel::sql_query(
        "SELECT l.objid::int AS partition, l.pid, a.application_name, host(a.client_addr) AS client_addr, \
         COALESCE(EXTRACT(EPOCH FROM now() - a.state_change), 0)::float8 AS state_age_seconds \
         FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         AND l.classid = to_regclass($1)::oid ORDER BY 1",
    )
    .bind::<Text, _>(table.quoted())
    .load(conn)
    .await
}

/// A relay process taking part in the partition balancing of a table.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct Member {
    /// Its session's backend pid.
    #[diesel(sql_type = Integer)]
    pub pid: i32,
    /// The partition count it runs with.
    #[diesel(sql_type = Integer)]
    pub partitions: i32,
    /// Its place in the order the live relays joined (1 for the first): the lowest is the
    /// oldest. Counted from `pg_locks`, which every role may read.
    #[diesel(sql_type = BigInt)]
    pub joined: i64,
    /// When its session started; `None` when this role may not see it (another role's
    /// session, without `pg_read_all_stats`).
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub backend_start: Option<DateTime<Utc>>,
}

/// The largest partition count: each partition is a session advisory lock in PostgreSQL's
/// shared lock table (`max_locks_per_transaction` × `max_connections` entries, 6,400 by
/// default), which the relays of every table share with the database's other locks.
pub const MAX_PARTITIONS: u32 = 1024;

/// The low half of a membership key with this bit set carries a partition count; without
/// it, a join ticket.
const COUNT_KEY: i64 = 1 << 31;

/// Announces this session as a relay of `table` running with `partitions` partitions, with
/// two session advisory locks on 64-bit keys whose high half is the table's OID:
///
/// - a shared lock on `2^31 + partitions`, which tells [`members`] the session's partition
///   count;
/// - an exclusive lock on its join ticket, one more than the highest ticket of the live
///   relays: the order in which they joined, which [`members`] reports as
///   [`Member::joined`].
///
/// Both show in `pg_locks`, which any role may read (unlike another role's
/// `pg_stat_activity` row), so relays running as different roles see each other. The
/// partition locks ([`try_lock_partition`]) use the two-key form, another key space. The
/// locks last as long as the session. Returns the ticket.
pub async fn join_members(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partitions: u32,
) -> QueryResult<i64> {
    if partitions == 0 || partitions > MAX_PARTITIONS {
        return Err(diesel::result::Error::QueryBuilderError(
            format!("partition count {partitions} is out of range 1..={MAX_PARTITIONS}").into(),
        ));
    }
    let name = table.quoted();
    diesel::sql_query("SELECT pg_advisory_lock_shared((to_regclass($1)::oid::bigint << 32) | $2)")
        .bind::<Text, _>(&name)
        .bind::<BigInt, _>(COUNT_KEY | partitions as i64)
        .execute(conn)
        .await?;
    #[derive(QueryableByName)]
    struct Ticket {
        #[diesel(sql_type = BigInt)]
        ticket: i64,
        #[diesel(sql_type = Bool)]
        taken: bool,
    }
    // two relays joining at once may pick the same ticket: the one that gets its lock keeps
    // it, the other picks again
    for _ in 0..1000 {
        let t: Ticket = diesel::sql_query(
            "SELECT t.ticket, pg_try_advisory_lock((t.oid::bigint << 32) | t.ticket) AS taken \
             FROM (SELECT c.oid, COALESCE((SELECT max(l.objid::bigint) FROM pg_locks l \
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.classid = c.oid \
             AND l.objid::bigint < 2147483648 \
             AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())), \
             0) + 1 AS ticket FROM (SELECT to_regclass($1)::oid AS oid) c) t",
        )
        .bind::<Text, _>(&name)
        .get_result(conn)
        .await?;
        if t.ticket >= COUNT_KEY {
            return Err(diesel::result::Error::QueryBuilderError(
                "the relays' join tickets are exhausted (2^31 joins while some relay stayed up); stop every relay of the table once to restart them".into(),
            ));
        }
        if t.taken {
            return Ok(t.ticket);
        }
    }
    Err(diesel::result::Error::QueryBuilderError(
        "could not take a join ticket: other relays kept taking the same ones".into(),
    ))
}

/// The relays of `table` alive now (see [`join_members`]), in the order they joined.
pub async fn members(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<Vec<Member>> {
    diesel::sql_query(
        "SELECT t.pid, (c.objid::bigint - 2147483648)::int AS partitions, \
         t.objid::bigint AS joined, a.backend_start \
         FROM pg_locks t JOIN pg_locks c ON c.pid = t.pid AND c.locktype = 'advisory' \
         AND c.granted AND c.objsubid = 1 AND c.database = t.database AND c.classid = t.classid \
         AND c.objid::bigint >= 2147483648 \
         LEFT JOIN pg_stat_activity a ON a.pid = t.pid \
         WHERE t.locktype = 'advisory' AND t.granted AND t.objsubid = 1 \
         AND t.objid::bigint < 2147483648 \
         AND t.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         AND t.classid = to_regclass($1)::oid ORDER BY t.objid::bigint, t.pid",
    )
    .bind::<Text, _>(table.quoted())
    .load(conn)
    .await
}

/// A row the relay gave up on.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct ParkedRow {
    /// Its `seq`.
    #[diesel(sql_type = BigInt)]
    pub seq: i64,
    /// Its message id.
    #[diesel(sql_type = SqlUuid)]
    pub id: Uuid,
    /// Its aggregate's type.
    #[diesel(sql_type = Text)]
    pub aggregate_type: String,
    /// Its aggregate's id.
    #[diesel(sql_type = Text)]
    pub aggregate_id: String,
    /// Its event type.
    #[diesel(sql_type = Text)]
    pub event_type: String,
    /// Failed attempts.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    /// The last error.
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    /// When it was parked.
    #[diesel(sql_type = Timestamptz)]
    pub parked_at: DateTime<Utc>,
    /// Unpublished rows of its aggregate held back behind it.
    #[diesel(sql_type = BigInt)]
    pub held_back: i64,
}

/// The parked rows of `table`, oldest first.
pub async fn parked(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<Vec<ParkedRow>> {
    let t = table.quoted();
    diesel::sql_query(format!(
        "SELECT p.seq, p.id, p.aggregate_type, p.aggregate_id, p.event_type, p.attempts, \
         p.last_error, p.parked_at, (SELECT count(*) FROM {t} o WHERE o.published_at IS NULL \
         AND (o.parked_at IS NULL OR o.parked_at = '-infinity') \
         AND o.aggregate_type = p.aggregate_type \
         AND o.aggregate_id = p.aggregate_id AND o.seq > p.seq) AS held_back \
         FROM {t} p WHERE p.parked_at > '-infinity' AND p.published_at IS NULL ORDER BY p.seq"
    ))
    .load(conn)
    .await
}

/// Un-parks the row `seq` (or every parked row when `None`) and resets its attempts, so the
/// relay publishes it again, and releases the rows held back behind it (see [`hold_back`]);
/// returns how many parked rows it released (held-back rows are not counted). Rows still
/// behind another parked row of their aggregate are held back again by the next poll.
pub async fn retry_parked(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seq: Option<i64>,
) -> QueryResult<usize> {
    use diesel_async::AsyncConnection;
    let t = table.quoted();
    conn.transaction(async |conn| {
        lock_holds(conn, table).await?;
        #[derive(QueryableByName)]
        struct Count {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let parked: Count = diesel::sql_query(format!(
            "SELECT count(*) AS n FROM {t} WHERE parked_at > '-infinity' \
             AND published_at IS NULL AND ($1::bigint IS NULL OR seq = $1)"
        ))
        .bind::<Nullable<BigInt>, _>(seq)
        .get_result(conn)
        .await?;
        diesel::sql_query(format!(
            "UPDATE {t} o SET parked_at = NULL, attempts = 0 WHERE o.parked_at IS NOT NULL \
             AND o.published_at IS NULL AND ($1::bigint IS NULL OR o.seq = $1 \
             OR (o.parked_at = '-infinity' AND o.seq > $1 AND EXISTS (SELECT 1 FROM {t} p \
             WHERE p.seq = $1 AND p.parked_at > '-infinity' \
             AND p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id)))"
        ))
        .bind::<Nullable<BigInt>, _>(seq)
        .execute(conn)
        .await?;
        Ok(parked.n as usize)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_matches_postgres() {
        // SELECT ('x' || substr(md5(x), 1, 7))::bit(28)::integer
        assert_eq!(Partition::hash("a.b c"), 251735073);
        assert_eq!(Partition::hash("x"), 165498438);
    }
}
