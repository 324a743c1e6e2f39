//! The relay's session: what it sets on its connections, the keep-alive that renews its
//! lease, its `LISTEN`, and who it is. Every statement the relay runs outside the poll, the
//! marks and the locks is here, so that `outbox-nats` holds no SQL.

use std::time::Duration;

use diesel::QueryResult;
use diesel::QueryableByName;
use diesel::sql_types::{Integer, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use crate::OutboxTable;

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
///
/// Its prepared statements keep their generic plan from the first call (`plan_cache_mode =
/// force_generic_plan`). PostgreSQL would plan each five times with the binds' values before
/// it compares, and the relay's statements are written so that the values change no plan:
/// every bind of the batch statement is read through a subquery, and the settings above leave
/// the index scans the queries are written for. Four relays sharing 8 partitions planned
/// their batch statements for 125-148 ms of a 100,000-event drain, 25-41 ms with the generic
/// plan alone (a new shape comes with each share a relay holds).
pub async fn prepare_session(conn: &mut AsyncPgConnection) -> QueryResult<()> {
    conn.batch_execute(
        "SET enable_sort = off; SET enable_seqscan = off; SET jit = off; \
         SET synchronous_commit = off; SET plan_cache_mode = force_generic_plan",
    )
    .await
}

/// Prepares a relay's side session (its statistics, its cleanup, `status`, `parked`, `retry`):
/// JIT off. Their statements (the backlog by cursor, the cleanup of covered rows) have
/// estimated costs far above `jit_above_cost` whatever the table holds, and compiling one took about 200 ms, against a
/// few milliseconds to run it.
pub async fn prepare_side_session(conn: &mut AsyncPgConnection) -> QueryResult<()> {
    conn.batch_execute("SET jit = off").await
}

/// Names the session in `pg_stat_activity` (`application_name`), e.g. `outbox-relay`.
pub async fn set_application_name(conn: &mut AsyncPgConnection, name: &str) -> QueryResult<()> {
    diesel::sql_query("SELECT set_config('application_name', $1, false)")
        .bind::<Text, _>(name)
        .execute(conn)
        .await
        .map(drop)
}

/// Makes the server end this session once it has been silent for `lease`: idle inside a
/// transaction (`idle_in_transaction_session_timeout`) or, on PostgreSQL 14 and later, idle
/// outside one (`idle_session_timeout`). A relay whose session ends loses its session advisory
/// locks, so a paused or cut-off relay gives up its partitions after its lease. Returns
/// `false` when the server has no `idle_session_timeout` (PostgreSQL 13 and earlier: only a
/// dropped connection then releases an idle session).
pub async fn set_lease_timeouts(
    conn: &mut AsyncPgConnection,
    lease: Duration,
) -> QueryResult<bool> {
    let ms = lease.as_millis().to_string();
    diesel::sql_query("SELECT set_config('idle_in_transaction_session_timeout', $1, false)")
        .bind::<Text, _>(&ms)
        .execute(conn)
        .await?;
    let has_idle_timeout = diesel::sql_query(
        "SELECT set_config('idle_session_timeout', $1, false) \
         FROM pg_settings WHERE name = 'idle_session_timeout'",
    )
    .bind::<Text, _>(&ms)
    .execute(conn)
    .await?;
    Ok(has_idle_timeout == 1)
}

/// The cheapest round trip: proves the session alive (and so renews its lease) when its other
/// queries are rarer than the lease.
pub async fn keep_alive(conn: &mut AsyncPgConnection) -> QueryResult<()> {
    conn.batch_execute("SELECT 1").await
}

/// `LISTEN` on `table`'s channel ([`OutboxTable::channel`]), for the recording side's
/// `NOTIFY`.
pub async fn listen(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<()> {
    listen_on(conn, &table.channel()).await
}

/// `LISTEN` on `channel`, quoted as an identifier.
pub(crate) async fn listen_on(conn: &mut AsyncPgConnection, channel: &str) -> QueryResult<()> {
    conn.batch_execute(&format!("LISTEN \"{}\"", channel.replace('"', "\"\"")))
        .await
}

/// `UNLISTEN` on `channel`, quoted as an identifier.
pub(crate) async fn unlisten_on(conn: &mut AsyncPgConnection, channel: &str) -> QueryResult<()> {
    conn.batch_execute(&format!("UNLISTEN \"{}\"", channel.replace('"', "\"\"")))
        .await
}

/// This session's backend process id (`pg_backend_pid()`), as `pg_locks` and
/// `pg_stat_activity` show it.
pub async fn backend_pid(conn: &mut AsyncPgConnection) -> QueryResult<i32> {
    #[derive(QueryableByName)]
    struct Pid {
        #[diesel(sql_type = Integer)]
        pid: i32,
    }
    let me: Pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result(conn)
        .await?;
    Ok(me.pid)
}
