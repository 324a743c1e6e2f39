//! What log tailing cannot do, and how an error of a slot operation is sorted: by the server's
//! state read after it, never by the words of its message.

use super::*;

/// What log tailing cannot do, and what to change.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WalError {
    /// Any other database error.
    #[error(transparent)]
    Query(#[from] DieselError),
    /// The server's `wal_level` is below `logical`.
    #[error(
        "log tailing needs wal_level = logical (the server runs with a lower level): run `ALTER SYSTEM SET wal_level = logical` as a superuser and restart PostgreSQL"
    )]
    WalLevel(#[source] DieselError),
    /// The role may not create or read replication slots.
    #[error(
        "the relay's role may not use replication slot {slot}: give it the REPLICATION attribute (`ALTER ROLE <relay> REPLICATION`) or let a superuser create the slot with `SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')`"
    )]
    ReplicationRight {
        /// The slot.
        slot: String,
        /// The refusal.
        #[source]
        source: DieselError,
    },
    /// The role may not create the publication (it must own the table).
    #[error(
        "the relay's role may not create publication {publication}: it must own table {table} (and have CREATE on the database); create it once as the table's owner with `CREATE PUBLICATION {publication} FOR TABLE {table} WITH (publish = 'insert, update', publish_via_partition_root = true)`"
    )]
    PublicationRight {
        /// The publication.
        publication: String,
        /// The table.
        table: String,
        /// The refusal.
        #[source]
        source: DieselError,
    },
    /// The table is partitioned ([`partition_table`](crate::partition_table)) and the
    /// publication sends its rows under the partitions' names.
    #[error(
        "publication {publication} sends the rows of partitioned table {table} under its partitions' names: `ALTER PUBLICATION {publication} SET (publish_via_partition_root = true)`"
    )]
    PublicationNotViaRoot {
        /// The publication.
        publication: String,
        /// The table.
        table: String,
    },
    /// The publication exists but does not publish the table's inserts.
    #[error(
        "publication {publication} exists but does not publish the inserts of table {table}: `ALTER PUBLICATION {publication} ADD TABLE {table}` and `ALTER PUBLICATION {publication} SET (publish = 'insert, update')`, or pass another --publication"
    )]
    PublicationMismatch {
        /// The publication.
        publication: String,
        /// The table.
        table: String,
    },
    /// The slot exists but is not a `pgoutput` slot of this database.
    #[error(
        "replication slot {slot} exists but is {found}, not a pgoutput slot of this database; pass another --slot, or drop it with `SELECT pg_drop_replication_slot('{slot}')` if it is abandoned"
    )]
    SlotMismatch {
        /// The slot.
        slot: String,
        /// What it is.
        found: String,
    },
    /// The slot is gone (dropped, or invalidated by `max_slot_wal_keep_size`).
    #[error(
        "replication slot {slot} is {state}: the WAL it needed is gone, so events recorded meanwhile may be lost; drop it with `SELECT pg_drop_replication_slot('{slot}')` and restart the relay with `--recover-slot`, which makes a new slot and publishes again the rows still in the table"
    )]
    SlotLost {
        /// The slot.
        slot: String,
        /// Its state.
        state: String,
    },
    /// The slot is missing although the relay's record says it was read before: it was
    /// dropped, or the server failed over to a standby that does not have it. What committed
    /// after its last confirmed position may not have been published.
    #[error(
        "replication slot {slot} is missing, but the relay read it before (last confirmed position {confirmed}, recorded {recorded_at}): it was dropped, or the server failed over to a standby without it (slots follow a failover only as PostgreSQL 17 failover slots). Events committed after that position may not have been published. If the recording side keeps its rows (the default), restart once with `--recover-slot`: the relay makes a new slot and publishes again every row still in the table and not parked (consumers drop the copies by message id); events recorded with `delete_after_insert` are not in the table, so those committed between {confirmed} and the new slot cannot be recovered"
    )]
    SlotMissing {
        /// The slot.
        slot: String,
        /// The last position the relay recorded as confirmed.
        confirmed: Lsn,
        /// When it recorded it.
        recorded_at: DateTime<Utc>,
    },
    /// The relay's record of its slots is missing and the role may not create it.
    #[error(
        "the relay keeps a record of its slots in {table}, which is missing, and its role may not create it: create it once as the table's owner with `{sql}` and `GRANT SELECT, INSERT, UPDATE ON {table} TO <relay>`"
    )]
    RecordRight {
        /// The record's table.
        table: String,
        /// The statement that creates it.
        sql: String,
        /// The refusal.
        #[source]
        source: DieselError,
    },
    /// The relay's ordinary connection (for the rows recorded before a new slot) failed.
    #[error("cannot connect to PostgreSQL: {0}")]
    Connect(#[from] crate::ConnectError),
    /// Another session uses the slot at this instant (an `outbox-relay status`, or a reader
    /// that bypassed the lock); retry.
    #[error("replication slot {slot} is in use by another session")]
    SlotBusy {
        /// The slot.
        slot: String,
        /// The refusal.
        #[source]
        source: DieselError,
    },
    /// The replication connection of a streaming reader failed or ended; the next read
    /// connects again.
    #[error("the replication connection reading slot {slot} failed: {reason}")]
    Stream {
        /// The slot.
        slot: String,
        /// What happened.
        reason: String,
    },
    /// The server refused a replication connection.
    #[error(
        "the server refused a replication connection for slot {slot}: {reason}; the relay's role needs the REPLICATION attribute (`ALTER ROLE <relay> REPLICATION`), pg_hba.conf must let it connect to this database, and max_wal_senders must leave a sender free"
    )]
    ReplicationConnection {
        /// The slot.
        slot: String,
        /// The server's refusal.
        reason: String,
    },
    /// The outbox table is missing.
    #[error("the outbox table {0} does not exist (or is not visible to this role)")]
    TableMissing(String),
    /// A message of the WAL could not be decoded.
    #[error("{0}")]
    Decode(#[from] pgoutput::DecodeError),
    /// A reader made without [`WalReader::streaming`] was asked to read: such a reader sets the
    /// slot up and confirms positions; it reads only over a replication connection of its own.
    #[error(
        "this WAL reader has no replication connection to read with: make it with WalReader::streaming(database_url, wait)"
    )]
    NotStreaming,
    /// A captured row lacks a column the relay needs.
    #[error("a captured row of {table} has no usable {column}: {reason}")]
    BadRow {
        /// The table.
        table: String,
        /// The column.
        column: &'static str,
        /// What is wrong.
        reason: String,
    },
}

#[derive(QueryableByName)]
pub(super) struct ServerState {
    #[diesel(sql_type = Text)]
    wal_level: String,
    #[diesel(sql_type = Bool)]
    may_replicate: bool,
    #[diesel(sql_type = Nullable<Integer>)]
    active_pid: Option<i32>,
    #[diesel(sql_type = Integer)]
    me: i32,
}

/// Sorts an error of a slot operation by the server's state, read right after it (the level
/// of its WAL, the role's right to use slots, the session holding the slot), never by the
/// message, which the server words in the language of its `lc_messages`.
pub(super) async fn classify(conn: &mut AsyncPgConnection, e: DieselError, slot: &str) -> WalError {
    if !matches!(e, DieselError::DatabaseError(..)) {
        return WalError::Query(e);
    }
    let state: Result<ServerState, _> = diesel::sql_query(
        "SELECT current_setting('wal_level') AS wal_level, \
         COALESCE((SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user), \
         false) AS may_replicate, \
         (SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1) AS active_pid, \
         pg_backend_pid() AS me",
    )
    .bind::<Text, _>(slot)
    .get_result(conn)
    .await;
    match state {
        Ok(s) if s.wal_level != "logical" => WalError::WalLevel(e),
        Ok(s) if !s.may_replicate => WalError::ReplicationRight {
            slot: slot.to_owned(),
            source: e,
        },
        Ok(s) if s.active_pid.is_some_and(|pid| pid != s.me) => WalError::SlotBusy {
            slot: slot.to_owned(),
            source: e,
        },
        // a session in a failed transaction cannot say: the error stands as it is
        _ => WalError::Query(e),
    }
}

/// Whether `e` may be a slot held a moment longer by a sender that is exiting: busy, or a
/// database error the state read after it could no longer tell from busy.
pub(super) fn maybe_busy(e: &WalError) -> bool {
    matches!(
        e,
        WalError::SlotBusy { .. } | WalError::Query(DieselError::DatabaseError(..))
    )
}

/// The SQLSTATE of an error the server sent on the replication connection, which
/// `pgwire-replication` appends to the message as `(SQLSTATE XXXXX)`.
pub(super) fn server_sqlstate(e: &pgwire_replication::PgWireError) -> Option<&str> {
    let pgwire_replication::PgWireError::Server(text) = e else {
        return None;
    };
    let code = text.rsplit_once("(SQLSTATE ")?.1.strip_suffix(')')?;
    (code.len() == 5 && code.bytes().all(|b| b.is_ascii_alphanumeric())).then_some(code)
}
