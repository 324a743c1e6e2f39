//! Statistics: the backlog, the table's vacuum figures, the oldest open snapshot.

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Integer, Nullable, Text, Timestamptz};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;

use super::Flag;
use super::progress::Coverage;

/// A parked row: not held back behind one (`'-infinity'`), nor released (`'infinity'`).
pub(crate) const PARKED: &str = "o.parked_at > '-infinity' AND o.parked_at < 'infinity'";

/// Whether `table` exists (and is visible to this role).
pub async fn table_exists(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<bool> {
    let f: Flag = diesel::sql_query("SELECT to_regclass($1) IS NOT NULL AS flag")
        .bind::<Text, _>(table.quoted())
        .get_result(conn)
        .await?;
    Ok(f.flag.unwrap_or(false))
}

/// The channel on which the relay that reads `table`'s backlog sends the figures to its other
/// relays (see [`AdvisoryLock::Statistics`](super::AdvisoryLock::Statistics)):
/// `outbox_stats_<table OID>`, which fits any table name in PostgreSQL's 63-byte channel names
/// and is the table's in this database whatever its name's case or schema. An error when the
/// table does not exist.
pub async fn statistics_channel(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<String> {
    channel_of(conn, table, "outbox_stats_").await
}

/// `<prefix><table OID>`: a channel of the relays of `table`. An error when the table does
/// not exist.
pub(crate) async fn channel_of(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    prefix: &str,
) -> QueryResult<String> {
    #[derive(QueryableByName)]
    struct Channel {
        #[diesel(sql_type = Nullable<Text>)]
        name: Option<String>,
    }
    let c: Channel = diesel::sql_query("SELECT $1 || to_regclass($2)::oid::int8 AS name")
        .bind::<Text, _>(prefix)
        .bind::<Text, _>(table.quoted())
        .get_result(conn)
        .await?;
    c.name.ok_or_else(|| {
        diesel::result::Error::QueryBuilderError(
            format!("the outbox table {table} does not exist (or this role may not see it)").into(),
        )
    })
}

/// `LISTEN` on `channel` (a [`statistics_channel`]), for the figures another relay sends.
pub async fn listen_statistics(conn: &mut AsyncPgConnection, channel: &str) -> QueryResult<()> {
    super::session::listen_on(conn, channel).await
}

/// Sends `payloads` on `channel` with `NOTIFY`, in order, in one transaction: a listener
/// receives all of them, one after the other, or none. Each must be under 8,000 bytes.
pub async fn notify_statistics(
    conn: &mut AsyncPgConnection,
    channel: &str,
    payloads: &[String],
) -> QueryResult<()> {
    diesel::sql_query("SELECT pg_notify($1, x) FROM unnest($2::text[]) AS x")
        .bind::<Text, _>(channel)
        .bind::<diesel::sql_types::Array<Text>, _>(payloads)
        .execute(conn)
        .await
        .map(drop)
}

/// The backlog of a table: unpublished rows, the age of the oldest, parked rows, and the rows
/// whose publishing was attempted and failed (in doubt).
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize, serde::Deserialize)]
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
    let sql = backlog_sql(conn, table).await?;
    diesel::sql_query(sql).get_result(conn).await
}

/// Runs [`backlog`]'s statement without reading a row (`LIMIT 0`): it fails as [`backlog`]
/// would (a column missing, no right on the table or on its progress), at the cost of planning
/// it, where [`backlog`] reads every unpublished row. What a relay checks at its start.
pub async fn check_backlog(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<()> {
    let sql = backlog_sql(conn, table).await?;
    diesel::sql_query(format!("SELECT b.* FROM ({sql}) AS b LIMIT 0"))
        .execute(conn)
        .await
        .map(drop)
}

/// The figures of a backlog ([`Backlog`]'s columns) over the unpublished rows `o`, NULL ages
/// where there is no such row.
fn figures_sql() -> String {
    format!(
        "count(*) AS unpublished, \
         EXTRACT(EPOCH FROM now() - min(o.created_at))::float8 AS oldest_age_seconds, \
         count(*) FILTER (WHERE {PARKED}) AS parked, \
         count(*) FILTER (WHERE o.attempts > 0) AS in_doubt, \
         EXTRACT(EPOCH FROM now() - min(o.created_at) FILTER (WHERE o.attempts > 0))::float8 \
         AS oldest_in_doubt_age_seconds"
    )
}

/// [`backlog`]'s statement.
async fn backlog_sql(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<String> {
    let cov = Coverage::of(conn, table).await?;
    Ok(format!(
        "{}SELECT b.unpublished, COALESCE(b.oldest_age_seconds, 0)::float8 AS oldest_age_seconds, \
         b.parked, b.in_doubt, \
         COALESCE(b.oldest_in_doubt_age_seconds, 0)::float8 AS oldest_in_doubt_age_seconds \
         FROM (SELECT {} FROM {}) b",
        cov.with(),
        figures_sql(),
        cov.unpublished(table)
    ))
}

/// The backlog of one partition (see [`partition_backlog`]).
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize, serde::Deserialize)]
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
/// partition (`0..count`, empty ones included): [`backlogs`] without the table's.
pub async fn partition_backlog(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    count: u32,
) -> QueryResult<Vec<PartitionBacklog>> {
    backlogs(conn, table, count).await.map(|(_, parts)| parts)
}

/// A partition's backlog with its rows in doubt, which [`backlogs`] adds up to the table's.
#[derive(QueryableByName)]
struct PartitionFigures {
    #[diesel(embed)]
    backlog: PartitionBacklog,
    #[diesel(sql_type = BigInt)]
    in_doubt: i64,
    #[diesel(sql_type = diesel::sql_types::Double)]
    oldest_in_doubt_age_seconds: f64,
}

/// The backlog of `table` and of each of its `count` partitions (see [`backlog`] and
/// [`partition_backlog`]), read in one pass over the unpublished rows: the table's figures
/// are its partitions' added up (the counts summed, the oldest ages the greatest), so they
/// agree, and the rows are read once (a relay reads its backlog every `--stats-interval`,
/// which a backlog of millions makes a scan of millions).
pub async fn backlogs(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    count: u32,
) -> QueryResult<(Backlog, Vec<PartitionBacklog>)> {
    let sql = backlogs_sql(conn, table).await?;
    let parts: Vec<PartitionFigures> = diesel::sql_query(sql)
        .bind::<Integer, _>(count.max(1) as i32)
        .load(conn)
        .await?;
    // the oldest of the partitions that have such rows (0 when none has)
    let oldest = |age: &dyn Fn(&PartitionFigures) -> Option<f64>| {
        parts.iter().filter_map(age).reduce(f64::max).unwrap_or(0.0)
    };
    let total = Backlog {
        unpublished: parts.iter().map(|p| p.backlog.unpublished).sum(),
        oldest_age_seconds: oldest(&|p| {
            (p.backlog.unpublished > 0).then_some(p.backlog.oldest_age_seconds)
        }),
        parked: parts.iter().map(|p| p.backlog.parked).sum(),
        in_doubt: parts.iter().map(|p| p.in_doubt).sum(),
        oldest_in_doubt_age_seconds: oldest(&|p| {
            (p.in_doubt > 0).then_some(p.oldest_in_doubt_age_seconds)
        }),
    };
    Ok((total, parts.into_iter().map(|p| p.backlog).collect()))
}

/// [`backlogs`]'s statement (its bind: the partition count).
async fn backlogs_sql(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<String> {
    let cov = Coverage::of(conn, table).await?;
    Ok(format!(
        "{}SELECT p.partition, COALESCE(b.unpublished, 0) AS unpublished, \
         COALESCE(b.oldest_age_seconds, 0)::float8 AS oldest_age_seconds, \
         COALESCE(b.parked, 0) AS parked, COALESCE(b.in_doubt, 0) AS in_doubt, \
         COALESCE(b.oldest_in_doubt_age_seconds, 0)::float8 AS oldest_in_doubt_age_seconds \
         FROM generate_series(0, $1 - 1) AS p(partition) LEFT JOIN ( \
         SELECT o.aggregate_hash % $1 AS partition, {} \
         FROM {} GROUP BY 1) b USING (partition) ORDER BY 1",
        cov.with(),
        figures_sql(),
        cov.unpublished(table)
    ))
}

/// [`backlogs`]'s statement run with `EXPLAIN (ANALYZE, BUFFERS)`: the plan with the rows,
/// loops and buffers of each node.
pub async fn explain_backlogs_analyze(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    count: u32,
) -> QueryResult<Vec<String>> {
    let sql = backlogs_sql(conn, table).await?;
    let lines: Vec<super::poll::PlanLine> =
        diesel::sql_query(format!("EXPLAIN (ANALYZE, BUFFERS) {sql}"))
            .bind::<Integer, _>(count.max(1) as i32)
            .load(conn)
            .await?;
    Ok(lines.into_iter().map(|l| l.line).collect())
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

/// Reads the vacuum figures of `table` (of a rotated table, its partitions' summed, and the
/// latest of their times); `None` when the statistics have no row for it.
pub async fn table_stats(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<Option<TableStats>> {
    use diesel::OptionalExtension;
    diesel::sql_query(
        "SELECT sum(n_live_tup)::int8 AS live_rows, sum(n_dead_tup)::int8 AS dead_rows, \
         sum(pg_total_relation_size(relid))::int8 AS total_bytes, \
         max(last_autovacuum) AS last_autovacuum, max(last_vacuum) AS last_vacuum, \
         sum(autovacuum_count)::int8 AS autovacuum_count, \
         max(last_autoanalyze) AS last_autoanalyze \
         FROM pg_stat_user_tables WHERE relid = to_regclass($1) \
         OR relid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = to_regclass($1)) \
         HAVING count(*) > 0",
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
