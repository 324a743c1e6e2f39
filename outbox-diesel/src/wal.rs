//! Log tailing's database side (feature `async`): the publication and the logical replication
//! slot, reading the committed inserts of the outbox table from the WAL in commit order,
//! confirming a position, the slot's lag, parking and deleting captured rows.
//!
//! A reader reads the slot in one of two ways, both with the built-in `pgoutput` plugin and
//! committed transactions in commit order from the slot's confirmed position:
//!
//! - streaming ([`WalReader::streaming`], what the relay does): a replication connection of its
//!   own (`START_REPLICATION`), which decodes each WAL record once and sends each transaction
//!   as it commits; a position is confirmed by the standby status the reader sends after
//!   JetStream acked everything before it. A read stops at its limits (messages and bytes) even
//!   inside a transaction, so a transaction of any size is handed over in parts and the
//!   reader's memory does not grow with it;
//! - SQL calls on the caller's Diesel connection: `pg_logical_slot_peek_binary_changes` reads
//!   without consuming and `pg_replication_slot_advance` confirms. Simple, but every read
//!   decodes again from the slot's restart position, which PostgreSQL moves only at its
//!   periodic snapshots (about every 15 s): a large backlog is decoded over and over, and a
//!   transaction is read whole.
//!
//! Either way a crash between publishing and confirming can only make the next reader read
//! (and publish) the same transactions again, never skip one.
//!
//! ```no_run
//! use diesel_async::{AsyncConnection, AsyncPgConnection};
//! use outbox_diesel::OutboxTable;
//! use outbox_diesel::wal::{self, SlotState, WalReader};
//!
//! # use std::time::Duration;
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let url = "postgres://relay@db/app";
//! let mut conn = AsyncPgConnection::establish(url).await?;
//! let mut reader = WalReader::new(OutboxTable::DEFAULT, "outbox_slot", "outbox_pub")
//!     .streaming(url, Duration::from_millis(100))?;
//! if reader.setup(&mut conn).await? != SlotState::Ready {
//!     // a new slot: first the rows committed before it, which it will not send
//!     let mut snapshot = AsyncPgConnection::establish(url).await?;
//!     let at = reader.create_slot(&mut conn, &mut snapshot).await?;
//!     let mut after = 0;
//!     loop {
//!         let rows = wal::snapshot_rows(&mut snapshot, &OutboxTable::DEFAULT, after, 500).await?;
//!         let Some(last) = rows.last() else { break };
//!         after = last.seq;
//!         // ... publish `rows` and wait for their acks
//!     }
//!     wal::end_snapshot(&mut snapshot).await?;
//!     reader.finish_slot(&mut conn, at).await?;
//! }
//! let batch = reader.read(&mut conn, 500).await?; // waits up to 100 ms for a transaction
//! for tx in &batch.transactions {
//!     for row in &tx.rows {
//!         println!("{} {} {}", tx.commit_lsn, row.aggregate_id, row.event_type);
//!     }
//! }
//! // ... publish, then confirm what JetStream acked, up to the end of the last transaction
//! // received whole (a larger one comes in parts: its end with its last part)
//! if let Some(end) = batch.transactions.iter().rev().find_map(|tx| tx.end_lsn) {
//!     reader.advance(&mut conn, end).await?;
//! }
//! reader.close(&mut conn).await?; // the last confirmed position reaches the slot
//! # Ok(()) }
//! ```

pub mod pgoutput;

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::result::Error as DieselError;
use diesel::sql_types::{Array, BigInt, Bool, Double, Integer, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use crate::relay::OutboxRow;
use crate::table::{quote_ident, quote_literal};
use crate::{OutboxTable, RawJson};
use pgoutput::{Message, Relation, Tuple, Value};

/// The first key of the session advisory lock that makes a relay the reader of a slot:
/// `pg_try_advisory_lock(SLOT_LOCK_KEY, hashtext(slot))`. It is `'OBLT'` in ASCII; the ordered
/// mode's partition locks use the outbox table's OID there instead, and OIDs of user tables
/// start at 16384 and stay far below it, so the two never meet.
pub const SLOT_LOCK_KEY: i32 = 0x4F42_4C54;

/// A WAL position (`pg_lsn`), written `X/X` as PostgreSQL does.
///
/// ```
/// use outbox_diesel::wal::Lsn;
/// let lsn: Lsn = "16/B374D848".parse()?;
/// assert_eq!(lsn.0, 0x16_B374_D848);
/// assert_eq!(lsn.to_string(), "16/B374D848");
/// # Ok::<(), String>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

impl std::str::FromStr for Lsn {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("{s:?} is not a WAL position (X/X in hexadecimal)");
        let (hi, lo) = s.split_once('/').ok_or_else(bad)?;
        let hi = u32::from_str_radix(hi, 16).map_err(|_| bad())?;
        let lo = u32::from_str_radix(lo, 16).map_err(|_| bad())?;
        Ok(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

/// The slot name derived from a table: `outbox_slot` for `outbox`, `billing_outbox_slot` for
/// `billing.outbox`. Slot names allow lower-case letters, digits and `_` only; other
/// characters become `_`.
///
/// ```
/// use outbox_diesel::wal::{default_publication, default_slot};
/// assert_eq!(default_slot(&"outbox".parse()?), "outbox_slot");
/// assert_eq!(default_slot(&"Billing.Events-1".parse()?), "billing_events_1_slot");
/// assert_eq!(default_publication(&"outbox".parse()?), "outbox_pub");
/// # Ok::<(), outbox_diesel::InvalidTableName>(())
/// ```
pub fn default_slot(table: &OutboxTable) -> String {
    format!("{}_slot", base_name(table))
}

/// The publication name derived from a table: `outbox_pub` for `outbox`.
pub fn default_publication(table: &OutboxTable) -> String {
    format!("{}_pub", base_name(table))
}

fn base_name(table: &OutboxTable) -> String {
    let raw = match table.schema() {
        Some(s) => format!("{s}_{}", table.name()),
        None => table.name().to_owned(),
    };
    let mut out: String = raw
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    out.truncate(58);
    out
}

/// Checks a replication slot name: 1 to 63 of `a-z`, `0-9` and `_`.
pub fn check_slot_name(slot: &str) -> Result<(), String> {
    if slot.is_empty()
        || slot.len() > 63
        || !slot
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(format!(
            "replication slot name {slot:?} may only hold 1 to 63 lower-case letters, digits and `_`"
        ));
    }
    Ok(())
}

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
        "the relay's role may not create publication {publication}: it must own table {table} (and have CREATE on the database); create it once as the table's owner with `CREATE PUBLICATION {publication} FOR TABLE {table} WITH (publish = 'insert, update')`"
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
struct ServerState {
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
async fn classify(conn: &mut AsyncPgConnection, e: DieselError, slot: &str) -> WalError {
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
fn maybe_busy(e: &WalError) -> bool {
    matches!(
        e,
        WalError::SlotBusy { .. } | WalError::Query(DieselError::DatabaseError(..))
    )
}

/// One committed transaction's outbox events, or a part of them.
///
/// A streaming read stops at its limits even inside a transaction: a transaction larger than
/// a read comes in parts, consecutive entries (across reads) with the same `commit_lsn`, each
/// with the next of its events; only the last part has the `end_lsn`. Nothing of a
/// transaction may be confirmed before its last part.
#[derive(Debug, Clone, PartialEq)]
pub struct Transaction {
    /// Its transaction id.
    pub xid: u32,
    /// The start of its commit record (`pgoutput`'s final LSN): known from its first message,
    /// it names the transaction in every part, and follows commit order.
    pub commit_lsn: Lsn,
    /// The end of its commit record: confirm this once every row is acked. `None` on a part
    /// before the last.
    pub end_lsn: Option<Lsn>,
    /// When it committed.
    pub commit_time: DateTime<Utc>,
    /// Its events in this part (all of them when it came whole), in insertion order.
    pub rows: Vec<OutboxRow>,
}

/// What one [`WalReader::read`] found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WalBatch {
    /// Committed transactions with outbox events, in commit order; the first may be the rest of
    /// a transaction begun in an earlier read, the last a first part (see [`Transaction`]).
    pub transactions: Vec<Transaction>,
    /// A position the slot may be confirmed at once every transaction of this batch (and the
    /// rest of one read in part) is acked: when the read reached the end of the WAL, the WAL
    /// flush position before the read (so that a slot whose database writes other tables
    /// does not hold their WAL); else the end of the last transaction read whole, with or
    /// without outbox events. Never inside a transaction read in part.
    pub caught_up_to: Option<Lsn>,
    /// Messages the read returned (for the batch-size limit).
    pub messages: usize,
}

/// Reads a table's committed inserts from a logical replication slot, in commit order.
///
/// Two ways to read: by default each [`WalReader::read`] is one SQL call
/// (`pg_logical_slot_peek_binary_changes`) on the caller's connection, which decodes the WAL
/// again from the slot's restart position every time; after [`WalReader::streaming`] the reader
/// holds a replication connection of its own (`START_REPLICATION`, as a subscriber or
/// Debezium does), which decodes each WAL record once and sends each transaction as it
/// commits. The relay streams; the SQL way suits a one-off read.
#[derive(Debug)]
pub struct WalReader {
    table: OutboxTable,
    slot: String,
    publication: String,
    table_oid: Option<u32>,
    relations: HashMap<u32, Relation>,
    streaming: Option<StreamConfig>,
    stream: Option<Stream>,
    /// A streaming reader's last position confirmed: transactions ending at or before it
    /// are passed over when they come again.
    acked: Lsn,
    /// Whether a missing slot that the record says was read before may be made again.
    recover: bool,
    /// Released parked rows read and not settled yet: (their transaction's `commit_lsn`, `seq`).
    released: Vec<(Lsn, i64)>,
}

/// Where a reader's slot stands, as [`WalReader::setup`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SlotState {
    /// The slot exists and every row recorded before it was published: read it.
    Ready,
    /// There is no slot: [`WalReader::create_slot`] makes it, with the snapshot of the rows
    /// recorded before it.
    Missing,
    /// The slot exists, but the rows recorded before it were not all published (the relay
    /// stopped during its first start): [`WalReader::create_slot`] makes it again.
    Unfinished,
}

/// The name of the relay's record of its slots, beside the outbox table.
pub const SLOTS_TABLE: &str = "outbox_relay_slots";

#[derive(QueryableByName)]
struct SlotRecord {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    confirmed: Option<i64>,
    #[diesel(sql_type = diesel::sql_types::Timestamptz)]
    updated_at: DateTime<Utc>,
}

/// Where and how a streaming reader connects.
#[derive(Clone)]
struct StreamConfig {
    host: String,
    port: u16,
    user: String,
    password: String,
    database: String,
    tls: pgwire_replication::TlsConfig,
    wait: Duration,
}

/// Messages the replication client receives ahead of the reader at most: with the reader's
/// own read (its byte and message limits), what a streaming reader holds.
const READ_AHEAD_MESSAGES: usize = 256;

/// A streaming reader's replication connection and what it has received.
struct Stream {
    client: pgwire_replication::ReplicationClient,
    /// The transaction being received, with its events not handed over yet.
    open: Option<Open>,
    /// The end of the last commit received (of any transaction), or the server's position
    /// from a keepalive between transactions: everything before it was received.
    received_to: Option<Lsn>,
}

/// The password is never shown.
impl fmt::Debug for StreamConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &"***")
            .field("database", &self.database)
            .field("wait", &self.wait)
            .finish()
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("received_to", &self.received_to)
            .field("open", &self.open.as_ref().map(|o| (o.xid, o.rows.len())))
            .finish_non_exhaustive()
    }
}

/// A transaction being received by a streaming reader.
struct Open {
    xid: u32,
    commit_lsn: Lsn,
    commit_time: DateTime<Utc>,
    /// Its events received and not handed over yet.
    rows: Vec<Captured>,
    /// Whether a part of it was handed over: its commit is then returned even without rows
    /// left, for its end.
    parted: bool,
    /// Confirmed already (it ends at or before the confirmed position): passed over.
    stale: bool,
}

/// A transaction (or part) as read, before released parked rows are looked up.
struct Read {
    xid: u32,
    commit_lsn: Lsn,
    end_lsn: Option<Lsn>,
    commit_time: DateTime<Utc>,
    captured: Vec<Captured>,
}

impl fmt::Debug for Captured {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Captured::Row(r) => write!(f, "Row({})", r.seq),
            Captured::Released(seq) => write!(f, "Released({seq})"),
        }
    }
}

#[derive(QueryableByName)]
struct Change {
    #[diesel(sql_type = diesel::sql_types::Binary)]
    data: Vec<u8>,
}

#[derive(QueryableByName)]
struct Position {
    #[diesel(sql_type = Nullable<BigInt>)]
    lsn: Option<i64>,
}

#[derive(QueryableByName)]
struct Flag {
    #[diesel(sql_type = Nullable<Bool>)]
    flag: Option<bool>,
}

#[derive(QueryableByName)]
struct Oid {
    #[diesel(sql_type = Nullable<BigInt>)]
    oid: Option<i64>,
}

#[derive(QueryableByName)]
struct SlotRow {
    #[diesel(sql_type = Nullable<Text>)]
    plugin: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    database: Option<String>,
    #[diesel(sql_type = Nullable<Bool>)]
    here: Option<bool>,
    #[diesel(sql_type = Nullable<Text>)]
    wal_status: Option<String>,
    #[diesel(sql_type = Nullable<BigInt>)]
    confirmed: Option<i64>,
}

#[derive(QueryableByName)]
struct PubRow {
    #[diesel(sql_type = Bool)]
    pubinsert: bool,
    #[diesel(sql_type = Bool)]
    pubupdate: bool,
    #[diesel(sql_type = Bool)]
    has_table: bool,
}

impl WalReader {
    /// A reader of `table`'s inserts through `slot` and `publication`.
    pub fn new(
        table: OutboxTable,
        slot: impl Into<String>,
        publication: impl Into<String>,
    ) -> Self {
        WalReader {
            table,
            slot: slot.into(),
            publication: publication.into(),
            table_oid: None,
            relations: HashMap::new(),
            streaming: None,
            stream: None,
            acked: Lsn(0),
            recover: false,
            released: Vec::new(),
        }
    }

    /// Lets [`WalReader::setup`] accept a missing slot that the relay's record says was read
    /// before (dropped, or lost in a failover), instead of failing with
    /// [`WalError::SlotMissing`]: [`WalReader::create_slot`] then makes a new one and its
    /// snapshot holds every row still in the table and not parked.
    pub fn recover(mut self, recover: bool) -> Self {
        self.recover = recover;
        self
    }

    /// Reads through a replication connection of its own to `database_url` (a URL or
    /// `key=value` string, as `DATABASE_URL`, with its TLS settings: see
    /// [`connect`](crate::connect); the first host of several) instead of SQL calls: each
    /// [`WalReader::read`] then waits up to `wait` for a transaction, returns as soon as one
    /// arrives, and [`WalReader::advance`] reports the position to the server (within a
    /// second; [`WalReader::close`] makes it exact). The role needs `REPLICATION`, as for the
    /// slot; the server's `max_wal_senders` must leave one sender for each reader.
    ///
    /// ```
    /// use std::time::Duration;
    /// use outbox_diesel::OutboxTable;
    /// use outbox_diesel::wal::WalReader;
    ///
    /// let reader = WalReader::new(OutboxTable::DEFAULT, "outbox_slot", "outbox_pub")
    ///     .streaming("postgres://relay@127.0.0.1/app", Duration::from_millis(100))?;
    /// assert!(reader.is_streaming());
    /// # Ok::<(), outbox_diesel::wal::WalError>(())
    /// ```
    pub fn streaming(mut self, database_url: &str, wait: Duration) -> Result<Self, WalError> {
        let bad = |reason: String| WalError::Stream {
            slot: self.slot.clone(),
            reason: format!("cannot use the database URL for replication: {reason}"),
        };
        let opts = crate::PgConnectOptions::parse(database_url).map_err(|e| bad(e.reason))?;
        let config = opts.config();
        let host = match config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
            None => "localhost".to_owned(),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let user = config
            .get_user()
            .map(str::to_owned)
            .or_else(|| std::env::var("USER").ok())
            .ok_or_else(|| bad("no user name".into()))?;
        let password = config
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default();
        let database = config.get_dbname().unwrap_or(&user).to_owned();
        self.streaming = Some(StreamConfig {
            host,
            port,
            user,
            password,
            database,
            tls: opts.replication_tls(),
            wait,
        });
        Ok(self)
    }

    /// Whether [`WalReader::streaming`] was set.
    pub fn is_streaming(&self) -> bool {
        self.streaming.is_some()
    }

    /// The slot's name.
    pub fn slot(&self) -> &str {
        &self.slot
    }

    /// The publication's name.
    pub fn publication(&self) -> &str {
        &self.publication
    }

    /// Prepares `conn` (UTC, ISO dates, so timestamps decode the same everywhere), creates the
    /// publication and the relay's record of its slots (`outbox_relay_slots`, beside the
    /// table) when missing, and says where the slot stands. A streaming reader's missing slot
    /// is made by [`WalReader::create_slot`]; a reader that reads with SQL creates it here
    /// (and sees only what commits after that).
    ///
    /// A missing slot that the record says was read before is [`WalError::SlotMissing`],
    /// unless the reader [recovers](WalReader::recover).
    pub async fn setup(&mut self, conn: &mut AsyncPgConnection) -> Result<SlotState, WalError> {
        check_slot_name(&self.slot).map_err(|reason| WalError::SlotMismatch {
            slot: self.slot.clone(),
            found: reason,
        })?;
        conn.batch_execute("SET TimeZone = 'UTC'; SET DateStyle = 'ISO, YMD'")
            .await?;
        let oid: Oid = diesel::sql_query(format!(
            "SELECT to_regclass({})::oid::bigint AS oid",
            quote_literal(&self.table.quoted())
        ))
        .get_result(conn)
        .await?;
        let oid = oid
            .oid
            .ok_or_else(|| WalError::TableMissing(self.table.to_string()))?;
        self.table_oid = Some(oid as u32);
        self.ensure_publication(conn).await?;
        self.ensure_record(conn).await?;
        let record = self.record(conn).await?;
        let exists = self.check_slot(conn).await?;
        match (exists, record) {
            (true, Some(r)) if r.state == "snapshot" => Ok(SlotState::Unfinished),
            (true, r) => {
                if r.is_none() {
                    // a slot made before the record existed, or by hand
                    self.write_record(conn, "streaming", None).await?;
                }
                Ok(SlotState::Ready)
            }
            (false, Some(r)) if r.state == "streaming" && !self.recover => {
                Err(WalError::SlotMissing {
                    slot: self.slot.clone(),
                    confirmed: Lsn(r.confirmed.unwrap_or_default() as u64),
                    recorded_at: r.updated_at,
                })
            }
            (false, _) if self.streaming.is_none() => {
                self.create_slot_sql(conn).await?;
                self.write_record(conn, "streaming", None).await?;
                Ok(SlotState::Ready)
            }
            (false, _) => Ok(SlotState::Missing),
        }
    }

    fn record_table(&self) -> String {
        match self.table.schema() {
            Some(s) => format!("{}.{SLOTS_TABLE}", quote_ident(s)),
            None => SLOTS_TABLE.to_owned(),
        }
    }

    async fn ensure_record(&self, conn: &mut AsyncPgConnection) -> Result<(), WalError> {
        let t = self.record_table();
        let found: Oid = diesel::sql_query(format!(
            "SELECT to_regclass({})::oid::bigint AS oid",
            quote_literal(&t)
        ))
        .get_result(conn)
        .await?;
        if found.oid.is_some() {
            return Ok(());
        }
        let sql = format!(
            "CREATE TABLE IF NOT EXISTS {t} (slot_name text PRIMARY KEY, table_name text NOT NULL, \
             state text NOT NULL CHECK (state IN ('snapshot', 'streaming')), confirmed_lsn pg_lsn, \
             created_at timestamptz NOT NULL DEFAULT now(), updated_at timestamptz NOT NULL DEFAULT now())"
        );
        match conn.batch_execute(&sql).await {
            Ok(()) => Ok(()),
            // decided on the server's state, not on the message (worded in the language of
            // the server's lc_messages)
            Err(e @ DieselError::DatabaseError(..)) => {
                let now: Oid = diesel::sql_query(format!(
                    "SELECT to_regclass({})::oid::bigint AS oid",
                    quote_literal(&t)
                ))
                .get_result(conn)
                .await?;
                if now.oid.is_some() {
                    // another relay created it meanwhile
                    return Ok(());
                }
                let may: Flag = diesel::sql_query(
                    "SELECT has_schema_privilege(COALESCE($1, current_schema()), 'CREATE') AS flag",
                )
                .bind::<Nullable<Text>, _>(self.table.schema())
                .get_result(conn)
                .await?;
                if may.flag == Some(false) {
                    Err(WalError::RecordRight {
                        table: t,
                        sql,
                        source: e,
                    })
                } else {
                    Err(e.into())
                }
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn record(&self, conn: &mut AsyncPgConnection) -> Result<Option<SlotRecord>, WalError> {
        let rows: Vec<SlotRecord> = diesel::sql_query(format!(
            "SELECT state, (confirmed_lsn - '0/0'::pg_lsn)::bigint AS confirmed, updated_at \
             FROM {} WHERE slot_name = $1",
            self.record_table()
        ))
        .bind::<Text, _>(&self.slot)
        .load(conn)
        .await?;
        Ok(rows.into_iter().next())
    }

    async fn write_record(
        &self,
        conn: &mut AsyncPgConnection,
        state: &str,
        confirmed: Option<Lsn>,
    ) -> Result<(), WalError> {
        diesel::sql_query(format!(
            "INSERT INTO {} (slot_name, table_name, state, confirmed_lsn) VALUES ($1, $2, $3, $4::pg_lsn) \
             ON CONFLICT (slot_name) DO UPDATE SET table_name = EXCLUDED.table_name, \
             state = EXCLUDED.state, confirmed_lsn = EXCLUDED.confirmed_lsn, updated_at = now()",
            self.record_table()
        ))
        .bind::<Text, _>(&self.slot)
        .bind::<Text, _>(self.table.to_string())
        .bind::<Text, _>(state)
        .bind::<Nullable<Text>, _>(confirmed.map(|l| l.to_string()))
        .execute(conn)
        .await?;
        Ok(())
    }

    /// Records `confirmed` as the slot's last confirmed position in the relay's record (what
    /// [`WalError::SlotMissing`] reports when the slot is lost).
    pub async fn save_position(
        &self,
        conn: &mut AsyncPgConnection,
        confirmed: Lsn,
    ) -> Result<(), WalError> {
        diesel::sql_query(format!(
            "UPDATE {} SET confirmed_lsn = $2::pg_lsn, updated_at = now() \
             WHERE slot_name = $1 AND state = 'streaming' \
             AND (confirmed_lsn IS NULL OR confirmed_lsn < $2::pg_lsn)",
            self.record_table()
        ))
        .bind::<Text, _>(&self.slot)
        .bind::<Text, _>(confirmed.to_string())
        .execute(conn)
        .await?;
        Ok(())
    }

    /// Makes the streaming reader's slot (dropping an [unfinished](SlotState::Unfinished) one
    /// first) with an exported snapshot, and opens on `snapshot` a read-only repeatable-read
    /// transaction on that snapshot: it sees exactly the rows committed before the slot's
    /// consistent point, which the slot will not send. Read them with [`snapshot_rows`], end
    /// the transaction with [`end_snapshot`], then [`WalReader::finish_slot`]. Returns the
    /// consistent point.
    ///
    /// Until `finish_slot`, the record says the slot is unfinished, so that a relay that stops
    /// meanwhile makes it again (and publishes the rows before it again) on its next start.
    /// Creating a slot waits for the transactions running at that moment to end.
    pub async fn create_slot(
        &mut self,
        conn: &mut AsyncPgConnection,
        snapshot: &mut AsyncPgConnection,
    ) -> Result<Lsn, WalError> {
        let Some(cfg) = self.streaming.clone() else {
            return Err(self.stream_error("only a streaming reader makes its slot with a snapshot"));
        };
        let mut tries = 0;
        while self.check_slot(conn).await? {
            // the sender of a reader that stopped during its first start may linger a moment
            end_stale_sender(conn, &self.slot).await?;
            let dropped = match diesel::sql_query("SELECT pg_drop_replication_slot($1)")
                .bind::<Text, _>(&self.slot)
                .execute(conn)
                .await
            {
                Ok(n) => Ok(n),
                Err(e) => Err(classify(conn, e, &self.slot).await),
            };
            match dropped {
                Ok(_) => {
                    tracing::info!(slot = %self.slot, "unfinished replication slot dropped");
                }
                Err(e) if maybe_busy(&e) && tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e),
            }
        }
        self.write_record(conn, "snapshot", None).await?;
        tracing::info!(slot = %self.slot, "creating the replication slot (this waits for the transactions running now to end)");
        let mut client =
            pgwire_replication::ReplicationClient::connect_gated(self.replication_config(&cfg))
                .await
                .map_err(|e| self.connection_error(e))?;
        let result = self.export_and_import(&mut client, snapshot).await;
        client.abort();
        let at = result?;
        self.acked = Lsn(0);
        tracing::info!(slot = %self.slot, lsn = %at, "replication slot created");
        Ok(at)
    }

    async fn export_and_import(
        &self,
        client: &mut pgwire_replication::ReplicationClient,
        snapshot: &mut AsyncPgConnection,
    ) -> Result<Lsn, WalError> {
        let rows = client
            .simple_query(&format!(
                "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput EXPORT_SNAPSHOT",
                self.slot
            ))
            .await
            .map_err(|e| self.connection_error(e))?;
        let col = |i: usize| {
            rows.as_slice()
                .first()
                .and_then(|r| r.get(i))
                .and_then(|v| v.as_ref())
                .map(|b| String::from_utf8_lossy(b).into_owned())
        };
        let (Some(point), Some(name)) = (col(1), col(2)) else {
            return Err(self.stream_error("CREATE_REPLICATION_SLOT returned no snapshot"));
        };
        let at: Lsn = point.parse().map_err(|e: String| self.stream_error(e))?;
        // the exported snapshot lives while the replication session is idle: import it now
        snapshot
            .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .await?;
        snapshot
            .batch_execute(&format!(
                "SET TRANSACTION SNAPSHOT {}",
                quote_literal(&name)
            ))
            .await?;
        Ok(at)
    }

    /// Records that every row recorded before the slot made by [`WalReader::create_slot`] was
    /// published: from now on the slot is read, and a missing slot is an error.
    pub async fn finish_slot(&self, conn: &mut AsyncPgConnection, at: Lsn) -> Result<(), WalError> {
        self.write_record(conn, "streaming", Some(at)).await
    }

    async fn ensure_publication(&self, conn: &mut AsyncPgConnection) -> Result<(), WalError> {
        let found: Vec<PubRow> = diesel::sql_query(format!(
            "SELECT p.pubinsert, p.pubupdate, (p.puballtables OR EXISTS (SELECT 1 FROM pg_publication_rel r \
             WHERE r.prpubid = p.oid AND r.prrelid = to_regclass({}))) AS has_table \
             FROM pg_publication p WHERE p.pubname = $1",
            quote_literal(&self.table.quoted())
        ))
        .bind::<Text, _>(&self.publication)
        .load(conn)
        .await?;
        match found.as_slice().first() {
            Some(p) if p.pubinsert && p.has_table => {
                if !p.pubupdate {
                    tracing::warn!(publication = %self.publication, "the publication does not publish updates: `outbox-relay retry` of a parked event is not seen by log tailing");
                }
                Ok(())
            }
            Some(_) => Err(WalError::PublicationMismatch {
                publication: self.publication.clone(),
                table: self.table.to_string(),
            }),
            None => {
                let sql = format!(
                    "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert, update')",
                    quote_ident(&self.publication),
                    self.table.quoted()
                );
                match conn.batch_execute(&sql).await {
                    Ok(()) => {
                        tracing::info!(publication = %self.publication, table = %self.table, "publication created");
                        Ok(())
                    }
                    // decided on the server's state, not on the message (worded in the
                    // language of the server's lc_messages)
                    Err(e @ DieselError::DatabaseError(..)) => {
                        let now: Vec<PubRow> = diesel::sql_query(
                            "SELECT true AS pubinsert, true AS pubupdate, true AS has_table \
                             FROM pg_publication WHERE pubname = $1",
                        )
                        .bind::<Text, _>(&self.publication)
                        .load(conn)
                        .await?;
                        if !now.is_empty() {
                            // another relay created it meanwhile
                            return Ok(());
                        }
                        let may: Flag = diesel::sql_query(
                            "SELECT pg_has_role(current_user, c.relowner, 'USAGE') \
                             AND has_database_privilege(current_database(), 'CREATE') AS flag \
                             FROM pg_class c WHERE c.oid = to_regclass($1)",
                        )
                        .bind::<Text, _>(self.table.quoted())
                        .get_result(conn)
                        .await?;
                        if may.flag == Some(false) {
                            Err(WalError::PublicationRight {
                                publication: self.publication.clone(),
                                table: self.table.to_string(),
                                source: e,
                            })
                        } else {
                            Err(e.into())
                        }
                    }
                    Err(e) => Err(e.into()),
                }
            }
        }
    }

    /// Whether the slot exists; an error when it is not a usable slot of this database.
    async fn check_slot(&self, conn: &mut AsyncPgConnection) -> Result<bool, WalError> {
        let found: Vec<SlotRow> = diesel::sql_query(
            "SELECT s.plugin::text AS plugin, d.datname::text AS database, \
             d.datname = current_database() AS here, s.wal_status, \
             (s.confirmed_flush_lsn - '0/0'::pg_lsn)::bigint AS confirmed \
             FROM pg_replication_slots s LEFT JOIN pg_database d ON d.oid = s.datoid \
             WHERE s.slot_name = $1",
        )
        .bind::<Text, _>(&self.slot)
        .load(conn)
        .await?;
        if let Some(s) = found.as_slice().first() {
            if s.plugin.as_deref() != Some("pgoutput") || s.here != Some(true) {
                return Err(WalError::SlotMismatch {
                    slot: self.slot.clone(),
                    found: format!(
                        "a slot of plugin {} in database {}",
                        s.plugin.as_deref().unwrap_or("none (physical)"),
                        s.database.as_deref().unwrap_or("none")
                    ),
                });
            }
            if s.wal_status.as_deref() == Some("lost") || s.confirmed.is_none() {
                return Err(WalError::SlotLost {
                    slot: self.slot.clone(),
                    state: s.wal_status.clone().unwrap_or_else(|| "invalid".into()),
                });
            }
            return Ok(true);
        }
        Ok(false)
    }

    /// Creates the slot with the SQL function (no snapshot): for a reader that reads with SQL.
    async fn create_slot_sql(&self, conn: &mut AsyncPgConnection) -> Result<Option<Lsn>, WalError> {
        let created: Result<Position, _> = diesel::sql_query(
            "SELECT (lsn - '0/0'::pg_lsn)::bigint AS lsn \
             FROM pg_create_logical_replication_slot($1, 'pgoutput')",
        )
        .bind::<Text, _>(&self.slot)
        .get_result(conn)
        .await;
        match created {
            Ok(p) => {
                let at = Lsn(p.lsn.unwrap_or_default() as u64);
                tracing::info!(slot = %self.slot, lsn = %at, "replication slot created");
                Ok(Some(at))
            }
            // another reader created it meanwhile
            Err(e) if self.check_slot(conn).await.unwrap_or(false) => {
                tracing::debug!(slot = %self.slot, error = %e, "replication slot created meanwhile");
                Ok(None)
            }
            Err(e) => Err(classify(conn, e, &self.slot).await),
        }
    }

    /// Reads the committed transactions after the slot's confirmed position, in commit
    /// order, until about `limit` messages. A streaming reader stops there even inside a
    /// transaction, which then comes in parts (see [`Transaction`]); a reader that reads with
    /// SQL reads a larger transaction whole. Nothing is consumed: the same transactions come
    /// again until [`WalReader::advance`] confirms past them.
    ///
    /// Only inserts into the outbox table count, except rows recorded as parked (a parked
    /// event written back by the relay). An update that releases a parked row
    /// (`outbox-relay retry`: `parked_at` back to `NULL`) brings the row back as an event.
    /// Deletes are ignored.
    pub async fn read(
        &mut self,
        conn: &mut AsyncPgConnection,
        limit: usize,
    ) -> Result<WalBatch, WalError> {
        let wait = self.streaming.as_ref().map_or(Duration::ZERO, |c| c.wait);
        self.read_within(conn, limit, usize::MAX, wait).await
    }

    /// [`WalReader::read`], stopping also once the messages read hold `max_bytes` (a streaming
    /// reader, even inside a transaction: it holds no more than that of what it hands over),
    /// and waiting up to `wait` instead of the configured time for the first message
    /// (`Duration::ZERO`: only what has arrived). The same as `read` for a reader that reads
    /// with SQL.
    pub async fn read_within(
        &mut self,
        conn: &mut AsyncPgConnection,
        limit: usize,
        max_bytes: usize,
        wait: Duration,
    ) -> Result<WalBatch, WalError> {
        let limit = limit.max(1);
        if let Some(mut cfg) = self.streaming.clone() {
            cfg.wait = wait;
            return self.read_stream(conn, &cfg, limit, max_bytes.max(1)).await;
        }
        self.read_sql(conn, limit).await
    }

    async fn read_sql(
        &mut self,
        conn: &mut AsyncPgConnection,
        limit: usize,
    ) -> Result<WalBatch, WalError> {
        let flush: Position =
            diesel::sql_query("SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::bigint AS lsn")
                .get_result(conn)
                .await?;
        let changes: Vec<Change> = match diesel::sql_query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1::name, NULL, $2, \
             'proto_version', '1', 'publication_names', $3)",
        )
        .bind::<Text, _>(&self.slot)
        .bind::<Integer, _>(i32::try_from(limit).unwrap_or(i32::MAX))
        .bind::<Text, _>(quote_ident(&self.publication))
        .load(conn)
        .await
        {
            Ok(changes) => changes,
            Err(e) => return Err(classify(conn, e, &self.slot).await),
        };
        let messages = changes.len();
        let mut transactions = Vec::new();
        let mut current: Option<(u32, Lsn, Vec<Captured>)> = None;
        let mut last_commit = None;
        for change in &changes {
            match pgoutput::decode(&change.data)? {
                Message::Begin { xid, final_lsn, .. } => {
                    current = Some((xid, Lsn(final_lsn), Vec::new()))
                }
                Message::Commit {
                    end_lsn,
                    commit_time_micros,
                    ..
                } => {
                    last_commit = Some(Lsn(end_lsn));
                    if let Some((xid, commit_lsn, captured)) = current.take()
                        && !captured.is_empty()
                    {
                        transactions.push(Read {
                            xid,
                            commit_lsn,
                            end_lsn: Some(Lsn(end_lsn)),
                            commit_time: pgoutput::commit_time(commit_time_micros),
                            captured,
                        });
                    }
                }
                other => self.capture(other, current.as_mut().map(|c| &mut c.2))?,
            }
        }
        let transactions = self.resolve(conn, transactions).await?;
        let caught_up_to = if messages < limit {
            flush.lsn.map(|l| Lsn(l as u64)).max(last_commit)
        } else {
            last_commit
        };
        Ok(WalBatch {
            transactions,
            caught_up_to,
            messages,
        })
    }

    /// Adds what one change means for the outbox to the open transaction's `rows`: an insert
    /// (not written back as parked) is an event, an update that releases a parked row brings
    /// it back; a relation is remembered; the rest is ignored.
    fn capture(
        &mut self,
        message: Message,
        rows: Option<&mut Vec<Captured>>,
    ) -> Result<(), WalError> {
        match message {
            Message::Relation(r) => {
                self.relations.insert(r.oid, r);
            }
            Message::Insert { relation, tuple } => {
                if let (Some(rows), Some(rel)) = (rows, self.our_relation(relation))
                    && !is_set(&tuple, rel, "parked_at")
                {
                    rows.push(Captured::Row(Box::new(self.to_row(rel, &tuple)?)));
                }
            }
            Message::Update { relation, tuple } => {
                if let (Some(rows), Some(rel)) = (rows, self.our_relation(relation))
                    && is_null(&tuple, rel, "parked_at")
                    && is_null(&tuple, rel, "published_at")
                    && is_set(&tuple, rel, "last_error")
                {
                    let seq = text(&tuple, rel, "seq")
                        .and_then(|s| s.parse::<i64>().ok())
                        .ok_or_else(|| self.bad("seq", "missing in an update".into()))?;
                    rows.push(Captured::Released(seq));
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The transactions with their rows: a released parked row is read as it is now.
    async fn resolve(
        &mut self,
        conn: &mut AsyncPgConnection,
        transactions: Vec<Read>,
    ) -> Result<Vec<Transaction>, WalError> {
        let released: Vec<i64> = transactions
            .iter()
            .flat_map(|t| t.captured.iter())
            .filter_map(|c| match c {
                Captured::Released(seq) => Some(*seq),
                Captured::Row(_) => None,
            })
            .collect();
        for t in &transactions {
            for c in &t.captured {
                if let Captured::Released(seq) = c {
                    self.released.push((t.commit_lsn, *seq));
                }
            }
        }
        let mut current_rows: HashMap<i64, OutboxRow> = if released.is_empty() {
            HashMap::new()
        } else {
            rows_by_seq(conn, &self.table, &released)
                .await?
                .into_iter()
                .map(|r| (r.seq, r))
                .collect()
        };
        let transactions = transactions
            .into_iter()
            .map(|t| Transaction {
                xid: t.xid,
                commit_lsn: t.commit_lsn,
                end_lsn: t.end_lsn,
                commit_time: t.commit_time,
                rows: t
                    .captured
                    .into_iter()
                    .filter_map(|c| match c {
                        Captured::Row(r) => Some(*r),
                        Captured::Released(seq) => current_rows.remove(&seq),
                    })
                    .collect(),
            })
            .collect::<Vec<_>>();
        Ok(transactions)
    }

    fn our_relation(&self, oid: u32) -> Option<&Relation> {
        if Some(oid) != self.table_oid {
            return None;
        }
        self.relations.get(&oid)
    }

    fn bad(&self, column: &'static str, reason: String) -> WalError {
        WalError::BadRow {
            table: self.table.to_string(),
            column,
            reason,
        }
    }

    fn to_row(&self, rel: &Relation, t: &Tuple) -> Result<OutboxRow, WalError> {
        let need = |column: &'static str| {
            text(t, rel, column).ok_or_else(|| self.bad(column, "missing or NULL".into()))
        };
        let json = |column: &'static str| -> Result<serde_json::Value, WalError> {
            serde_json::from_str(need(column)?).map_err(|e| self.bad(column, e.to_string()))
        };
        Ok(OutboxRow {
            seq: need("seq")?
                .parse()
                .map_err(|e: std::num::ParseIntError| self.bad("seq", e.to_string()))?,
            id: need("id")?
                .parse()
                .map_err(|e: uuid::Error| self.bad("id", e.to_string()))?,
            aggregate_type: need("aggregate_type")?.to_owned(),
            aggregate_id: need("aggregate_id")?.to_owned(),
            event_type: need("event_type")?.to_owned(),
            payload: RawJson::from_postgres(need("payload")?.to_owned()),
            headers: match text(t, rel, "headers") {
                Some(_) => json("headers")?,
                None => serde_json::Value::Object(Default::default()),
            },
            created_at: text(t, rel, "created_at")
                .and_then(parse_timestamptz)
                .unwrap_or_else(Utc::now),
            attempts: text(t, rel, "attempts")
                .and_then(|a| a.parse().ok())
                .unwrap_or(0),
        })
    }

    /// Confirms that everything up to `to` is published: the slot will not return it again
    /// and PostgreSQL may recycle the WAL before it. Returns the slot's confirmed position.
    /// A position at or before the current one changes nothing.
    pub async fn advance(
        &mut self,
        conn: &mut AsyncPgConnection,
        to: Lsn,
    ) -> Result<Lsn, WalError> {
        if self.streaming.is_some() {
            if to <= self.acked {
                return Ok(self.acked);
            }
            self.acked = to;
            match &self.stream {
                Some(st) => st.client.update_applied_lsn(pgwire_replication::Lsn(to.0)),
                // no replication connection holds the slot: confirm it directly
                None => {
                    self.advance_sql(conn, to).await?;
                }
            }
            return Ok(to);
        }
        self.advance_sql(conn, to).await
    }

    async fn advance_sql(&self, conn: &mut AsyncPgConnection, to: Lsn) -> Result<Lsn, WalError> {
        let p: Position = match diesel::sql_query(
            "SELECT (CASE WHEN s.confirmed_flush_lsn < $2::pg_lsn \
             THEN (SELECT end_lsn FROM pg_replication_slot_advance($1::name, $2::pg_lsn)) \
             ELSE s.confirmed_flush_lsn END - '0/0'::pg_lsn)::bigint AS lsn \
             FROM pg_replication_slots s WHERE s.slot_name = $1",
        )
        .bind::<Text, _>(&self.slot)
        .bind::<Text, _>(to.to_string())
        .get_result(conn)
        .await
        {
            Ok(p) => p,
            Err(e) => return Err(classify(conn, e, &self.slot).await),
        };
        Ok(Lsn(p.lsn.unwrap_or_default() as u64))
    }

    /// Settles the released parked rows (`outbox-relay retry`) read in transactions confirmed
    /// by `confirmed`: their `last_error` is cleared, so that the cleanup of captured rows, which
    /// passes over rows with a `last_error`, may delete them. A released row keeps it until
    /// then, so the cleanup cannot delete it before the reader has read the release.
    pub async fn settle_released(
        &mut self,
        conn: &mut AsyncPgConnection,
        confirmed: Lsn,
    ) -> Result<(), WalError> {
        let seqs: Vec<i64> = self
            .released
            .iter()
            .filter(|(commit, _)| confirms(confirmed, *commit))
            .map(|(_, seq)| *seq)
            .collect();
        if seqs.is_empty() {
            return Ok(());
        }
        diesel::sql_query(format!(
            "UPDATE {} SET last_error = NULL WHERE seq = ANY($1) AND parked_at IS NULL",
            self.table.quoted()
        ))
        .bind::<Array<BigInt>, _>(&seqs)
        .execute(conn)
        .await?;
        self.released
            .retain(|(commit, _)| !confirms(confirmed, *commit));
        Ok(())
    }

    /// The slot's confirmed position now.
    pub async fn confirmed(&self, conn: &mut AsyncPgConnection) -> Result<Option<Lsn>, WalError> {
        let p: Vec<Position> = diesel::sql_query(
            "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint AS lsn \
             FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind::<Text, _>(&self.slot)
        .load(conn)
        .await?;
        Ok(p.as_slice()
            .first()
            .and_then(|p| p.lsn)
            .map(|l| Lsn(l as u64)))
    }
}

/// The streaming way of reading (see [`WalReader::streaming`]).
impl WalReader {
    async fn read_stream(
        &mut self,
        conn: &mut AsyncPgConnection,
        cfg: &StreamConfig,
        limit: usize,
        max_bytes: usize,
    ) -> Result<WalBatch, WalError> {
        if self.stream.is_none() {
            self.connect(conn, cfg).await?;
        }
        let Some(mut st) = self.stream.take() else {
            return Ok(WalBatch::default());
        };
        let result = self.receive(&mut st, cfg, limit, max_bytes).await;
        match result {
            Ok((transactions, messages, caught_up)) => {
                // never inside the transaction being received: `received_to` is a commit's
                // end, or a position between transactions
                let caught_up_to = if caught_up && st.open.is_none() {
                    st.received_to
                } else {
                    transactions
                        .iter()
                        .rev()
                        .find_map(|t| t.end_lsn)
                        .or(st.received_to)
                };
                self.stream = Some(st);
                let transactions = self.resolve(conn, transactions).await?;
                Ok(WalBatch {
                    transactions,
                    caught_up_to,
                    messages,
                })
            }
            // the connection is gone: the next read connects again from the confirmed position
            Err(e) => {
                st.client.abort();
                Err(e)
            }
        }
    }

    /// Receives until `limit` messages or `max_bytes` of them, or until nothing more is ready
    /// (after waiting up to `cfg.wait` for the first message). A limit reached inside a
    /// transaction hands over its events received so far as a part; the rest follows on later
    /// reads. Returns the transactions (and parts) with events, the messages received, and
    /// whether it stopped for want of more.
    async fn receive(
        &mut self,
        st: &mut Stream,
        cfg: &StreamConfig,
        limit: usize,
        max_bytes: usize,
    ) -> Result<(Vec<Read>, usize, bool), WalError> {
        use pgwire_replication::ReplicationEvent as Event;
        let deadline = tokio::time::Instant::now() + cfg.wait;
        let mut transactions = Vec::new();
        let mut messages = 0usize;
        let mut bytes = 0usize;
        loop {
            if messages >= limit || bytes >= max_bytes {
                if let Some(open) = st.open.as_mut()
                    && !open.rows.is_empty()
                {
                    open.parted = true;
                    transactions.push(Read {
                        xid: open.xid,
                        commit_lsn: open.commit_lsn,
                        end_lsn: None,
                        commit_time: open.commit_time,
                        captured: std::mem::take(&mut open.rows),
                    });
                }
                return Ok((transactions, messages, false));
            }
            // wait for the first message; then take what is ready (a transaction being
            // received is finished on a later read if it is not all here yet)
            let until = if messages == 0 {
                deadline
            } else {
                tokio::time::Instant::now()
            };
            let event = match tokio::time::timeout_at(until, st.client.recv()).await {
                Err(_) => return Ok((transactions, messages, true)),
                Ok(Ok(Some(e))) => e,
                Ok(Ok(None)) => {
                    return Err(self.stream_error("the server ended the replication stream"));
                }
                Ok(Err(e)) => return Err(self.stream_error(e)),
            };
            match event {
                Event::Begin {
                    xid,
                    final_lsn,
                    commit_time_micros,
                } => {
                    messages += 1;
                    let commit_lsn = Lsn(final_lsn.0);
                    st.open = Some(Open {
                        xid,
                        commit_lsn,
                        // the protocol's own Begin: PostgreSQL's epoch, not decoded by `pgoutput`
                        commit_time: pgoutput::pg_time(commit_time_micros),
                        rows: Vec::new(),
                        parted: false,
                        stale: confirms(self.acked, commit_lsn),
                    });
                }
                Event::XLogData { data, .. } => {
                    messages += 1;
                    bytes += data.len();
                    let message = pgoutput::decode(&data)?;
                    let rows = st.open.as_mut().filter(|o| !o.stale).map(|o| &mut o.rows);
                    self.capture(message, rows)?;
                }
                Event::Commit { end_lsn, .. } => {
                    messages += 1;
                    let end = Lsn(end_lsn.0);
                    st.received_to = st.received_to.max(Some(end));
                    // Begin carried the commit time already
                    if let Some(open) = st.open.take()
                        && (!open.rows.is_empty() || open.parted)
                        && !open.stale
                        && end > self.acked
                    {
                        transactions.push(Read {
                            xid: open.xid,
                            commit_lsn: open.commit_lsn,
                            end_lsn: Some(end),
                            commit_time: open.commit_time,
                            captured: open.rows,
                        });
                    }
                }
                Event::KeepAlive { wal_end, .. } => {
                    if st.open.is_none() {
                        st.received_to = st.received_to.max(Some(Lsn(wal_end.0)));
                    }
                }
                Event::Message { .. } | Event::StoppedAt { .. } => {}
            }
        }
    }

    fn stream_error(&self, reason: impl fmt::Display) -> WalError {
        WalError::Stream {
            slot: self.slot.clone(),
            reason: reason.to_string(),
        }
    }

    /// Opens the replication connection at the confirmed position. A replication connection
    /// still holding the slot after its relay lost the slot's lock (a paused or cut-off
    /// reader, whose sender lingers until `wal_sender_timeout`) is ended first: the caller
    /// holds the lock now.
    async fn connect(
        &mut self,
        conn: &mut AsyncPgConnection,
        cfg: &StreamConfig,
    ) -> Result<(), WalError> {
        let confirmed = self.confirmed(conn).await?.unwrap_or_default();
        self.acked = self.acked.max(confirmed);
        let mut tries = 0;
        loop {
            let config = self.replication_config(cfg);
            let started = async {
                crate::ensure_crypto_provider();
                let mut client = pgwire_replication::ReplicationClient::connect(config).await?;
                client.wait_started().await?;
                Ok::<_, pgwire_replication::PgWireError>(client)
            };
            match started.await {
                Ok(client) => {
                    self.relations.clear();
                    self.stream = Some(Stream {
                        client,
                        open: None,
                        received_to: None,
                    });
                    tracing::debug!(slot = %self.slot, lsn = %self.acked, "replication stream started");
                    return Ok(());
                }
                // object_in_use: the slot's previous sender has not ended yet
                Err(e) if server_sqlstate(&e) == Some("55006") && tries < 50 => {
                    tries += 1;
                    end_stale_sender(conn, &self.slot).await?;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(self.connection_error(e)),
            }
        }
    }

    fn replication_config(&self, cfg: &StreamConfig) -> pgwire_replication::ReplicationConfig {
        pgwire_replication::ReplicationConfig::new(
            cfg.host.clone(),
            cfg.user.clone(),
            cfg.password.clone(),
            cfg.database.clone(),
            self.slot.clone(),
            // `publication_names` is a list of identifiers: quoted, a name keeps its case and
            // may hold any character
            quote_ident(&self.publication),
        )
        .with_port(cfg.port)
        .with_tls(cfg.tls.clone())
        .with_start_lsn(pgwire_replication::Lsn(self.acked.0))
        .with_ack_lsn(pgwire_replication::Lsn(self.acked.0))
        .with_status_interval(Duration::from_secs(1))
        .with_buffer_size(READ_AHEAD_MESSAGES)
        .with_options("-c TimeZone=UTC -c DateStyle=ISO,YMD")
        .with_application_name("outbox-relay")
    }

    fn connection_error(&self, e: pgwire_replication::PgWireError) -> WalError {
        let reason = e.to_string();
        // insufficient_privilege (no REPLICATION) or an invalid authorization (pg_hba.conf,
        // credentials): retrying cannot fix them. Decided on the code, which does not change
        // with the server's lc_messages.
        let refused = matches!(e, pgwire_replication::PgWireError::Auth(_))
            || matches!(server_sqlstate(&e), Some(code) if code == "42501" || code.starts_with("28"));
        if refused {
            WalError::ReplicationConnection {
                slot: self.slot.clone(),
                reason,
            }
        } else {
            self.stream_error(reason)
        }
    }

    /// Checks that a streaming reader may open its replication connection (the role's
    /// `REPLICATION` attribute, `pg_hba.conf`, a free sender), without touching the slot: a
    /// start-up check, so that what retrying cannot fix is a clear error at once. Does nothing
    /// for a reader that reads with SQL.
    pub async fn check_replication(&self) -> Result<(), WalError> {
        let Some(cfg) = &self.streaming else {
            return Ok(());
        };
        crate::ensure_crypto_provider();
        let mut client =
            pgwire_replication::ReplicationClient::connect_gated(self.replication_config(cfg))
                .await
                .map_err(|e| self.connection_error(e))?;
        let identified = client.identify_system().await;
        client.abort();
        identified.map(drop).map_err(|e| self.connection_error(e))
    }

    /// Ends a streaming reader's replication connection after telling the server the last
    /// confirmed position, and confirms it on `conn` too, so that a clean stop leaves nothing
    /// to read again. Reading afterwards connects again.
    pub async fn close(&mut self, conn: &mut AsyncPgConnection) -> Result<(), WalError> {
        if let Some(mut st) = self.stream.take() {
            let stopped = tokio::time::timeout(Duration::from_secs(5), st.client.shutdown()).await;
            if !matches!(stopped, Ok(Ok(()))) {
                st.client.abort();
            }
        }
        if self.streaming.is_none() || self.acked == Lsn(0) {
            return Ok(());
        }
        // the sender lets go of the slot as it exits
        for _ in 0..100 {
            match self.advance_sql(conn, self.acked).await {
                Err(e) if maybe_busy(&e) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => {
                    other?;
                    return self.save_position(conn, self.acked).await;
                }
            }
        }
        Ok(())
    }

    /// Drops what was received and not confirmed: the next read starts again from the last
    /// confirmed position (after a failed publish, to send the same transactions again).
    pub fn rewind(&mut self) {
        if let Some(mut st) = self.stream.take() {
            st.client.abort();
        }
    }
}

/// Whether a slot confirmed at `confirmed` is past the transaction whose commit record starts
/// at `commit_lsn` ([`Transaction::commit_lsn`]). A confirmed position is the end of a commit
/// record or a position between transactions, never inside a commit record: past its start is
/// past its end.
pub fn confirms(confirmed: Lsn, commit_lsn: Lsn) -> bool {
    confirmed > commit_lsn
}

/// Ends the walsender that holds `slot`, if any (not a SQL session that reads it for an
/// instant, such as `outbox-relay status`).
async fn end_stale_sender(conn: &mut AsyncPgConnection, slot: &str) -> Result<(), WalError> {
    diesel::sql_query(
        "SELECT pg_terminate_backend(s.active_pid) FROM pg_replication_slots s \
         JOIN pg_stat_activity a ON a.pid = s.active_pid \
         WHERE s.slot_name = $1 AND a.backend_type = 'walsender'",
    )
    .bind::<Text, _>(slot)
    .execute(conn)
    .await?;
    Ok(())
}

enum Captured {
    Row(Box<OutboxRow>),
    Released(i64),
}

fn text<'t>(t: &'t Tuple, rel: &Relation, column: &str) -> Option<&'t str> {
    match t.get(rel, column)? {
        Value::Text(s) => Some(s.as_str()),
        _ => None,
    }
}

fn is_set(t: &Tuple, rel: &Relation, column: &str) -> bool {
    matches!(t.get(rel, column), Some(Value::Text(_)))
}

fn is_null(t: &Tuple, rel: &Relation, column: &str) -> bool {
    matches!(t.get(rel, column), Some(Value::Null) | None)
}

/// Parses `timestamptz` output in the ISO style (`2026-12-01 10:00:00.123456+00`).
fn parse_timestamptz(s: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f%#z")
        .ok()
        .map(|d| d.with_timezone(&Utc))
}

/// The SQLSTATE of an error the server sent on the replication connection, which
/// `pgwire-replication` appends to the message as `(SQLSTATE XXXXX)`.
fn server_sqlstate(e: &pgwire_replication::PgWireError) -> Option<&str> {
    let pgwire_replication::PgWireError::Server(text) = e else {
        return None;
    };
    let code = text.rsplit_once("(SQLSTATE ")?.1.strip_suffix(')')?;
    (code.len() == 5 && code.bytes().all(|b| b.is_ascii_alphanumeric())).then_some(code)
}

/// Tries to take the session advisory lock that makes this connection the one reader of
/// `slot` (`pg_try_advisory_lock(SLOT_LOCK_KEY, hashtext(slot))`); `true` when it has it. It
/// is released when the connection closes, so a standby takes over as soon as PostgreSQL
/// notices that the reader's connection is gone.
pub async fn try_lock_slot(conn: &mut AsyncPgConnection, slot: &str) -> diesel::QueryResult<bool> {
    let f: Flag = diesel::sql_query(format!(
        "SELECT pg_try_advisory_lock({SLOT_LOCK_KEY}, hashtext($1)) AS flag"
    ))
    .bind::<Text, _>(slot)
    .get_result(conn)
    .await?;
    Ok(f.flag.unwrap_or(false))
}

/// Releases the lock of [`try_lock_slot`].
pub async fn unlock_slot(conn: &mut AsyncPgConnection, slot: &str) -> diesel::QueryResult<bool> {
    let f: Flag = diesel::sql_query(format!(
        "SELECT pg_advisory_unlock({SLOT_LOCK_KEY}, hashtext($1)) AS flag"
    ))
    .bind::<Text, _>(slot)
    .get_result(conn)
    .await?;
    Ok(f.flag.unwrap_or(false))
}

/// A replication slot's state and how far it lags.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct SlotLag {
    /// The slot.
    #[diesel(sql_type = Text)]
    pub slot: String,
    /// Its confirmed position (`X/X`).
    #[diesel(sql_type = Nullable<Text>)]
    pub confirmed_flush_lsn: Option<String>,
    /// Bytes of WAL written since its confirmed position: what a reader has yet to confirm.
    #[diesel(sql_type = BigInt)]
    pub lag_bytes: i64,
    /// Bytes of WAL the slot keeps on disk (from its restart position).
    #[diesel(sql_type = BigInt)]
    pub retained_bytes: i64,
    /// PostgreSQL's `wal_status`: `reserved`, `extended`, `unreserved` (about to be lost) or
    /// `lost`.
    #[diesel(sql_type = Nullable<Text>)]
    pub wal_status: Option<String>,
    /// Bytes that may still be written before the slot is lost to `max_slot_wal_keep_size`;
    /// `None` when that setting is unlimited.
    #[diesel(sql_type = Nullable<BigInt>)]
    pub safe_wal_size: Option<i64>,
    /// The relay session that holds the reader's lock.
    #[diesel(sql_type = Nullable<Integer>)]
    pub reader_pid: Option<i32>,
}

/// The lag of `slot`, or `None` when it does not exist.
pub async fn slot_lag(
    conn: &mut AsyncPgConnection,
    slot: &str,
) -> diesel::QueryResult<Option<SlotLag>> {
    let rows: Vec<SlotLag> = diesel::sql_query(format!(
        "SELECT s.slot_name::text AS slot, s.confirmed_flush_lsn::text AS confirmed_flush_lsn, \
         COALESCE((pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint, 0) AS lag_bytes, \
         COALESCE((pg_current_wal_lsn() - s.restart_lsn)::bigint, 0) AS retained_bytes, \
         s.wal_status, s.safe_wal_size, \
         (SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
          AND l.objsubid = 2 AND l.classid = {SLOT_LOCK_KEY} AND l.objid = hashtext(s.slot_name::text)::oid \
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) LIMIT 1) AS reader_pid \
         FROM pg_replication_slots s WHERE s.slot_name = $1"
    ))
    .bind::<Text, _>(slot)
    .load(conn)
    .await?;
    Ok(rows.into_iter().next())
}

/// Seconds since the oldest transaction the slot has not confirmed committed (0 when there
/// is none), read by decoding up to one transaction. It needs the REPLICATION right, and
/// fails while a reader is using the slot at that instant; retry then.
pub async fn pending_age_seconds(
    conn: &mut AsyncPgConnection,
    slot: &str,
    publication: &str,
) -> Result<f64, WalError> {
    let changes: Vec<Change> = match diesel::sql_query(
        "SELECT data FROM pg_logical_slot_peek_binary_changes($1::name, NULL, 1, \
         'proto_version', '1', 'publication_names', $2)",
    )
    .bind::<Text, _>(slot)
    .bind::<Text, _>(quote_ident(publication))
    .load(conn)
    .await
    {
        Ok(changes) => changes,
        Err(e) => return Err(classify(conn, e, slot).await),
    };
    for change in &changes {
        if let Message::Begin {
            commit_time_micros, ..
        } = pgoutput::decode(&change.data)?
        {
            let age = Utc::now() - pgoutput::commit_time(commit_time_micros);
            return Ok(age.to_std().unwrap_or_default().as_secs_f64());
        }
    }
    Ok(0.0)
}

/// Records an event the relay gave up on: its row gets `parked_at`, `attempts` and
/// `last_error`, and is written back (with its `seq`) when the recording side deleted it.
/// The reader passes over parked rows; `outbox-relay parked` lists them and `outbox-relay
/// retry` releases them, which the reader sees as an update and publishes.
pub async fn park(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    row: &OutboxRow,
    attempts: i32,
    error: &str,
) -> diesel::QueryResult<()> {
    diesel::sql_query(format!(
        "INSERT INTO {} (seq, id, aggregate_type, aggregate_id, event_type, payload, headers, \
         created_at, attempts, last_error, parked_at) OVERRIDING SYSTEM VALUE \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, now()) \
         ON CONFLICT (id) DO UPDATE SET attempts = EXCLUDED.attempts, \
         last_error = EXCLUDED.last_error, parked_at = now()",
        table.quoted()
    ))
    .bind::<BigInt, _>(row.seq)
    .bind::<diesel::sql_types::Uuid, _>(row.id)
    .bind::<Text, _>(&row.aggregate_type)
    .bind::<Text, _>(&row.aggregate_id)
    .bind::<Text, _>(&row.event_type)
    .bind::<diesel::sql_types::Jsonb, _>(&row.payload)
    .bind::<diesel::sql_types::Jsonb, _>(&row.headers)
    .bind::<diesel::sql_types::Timestamptz, _>(row.created_at)
    .bind::<Integer, _>(attempts)
    .bind::<Text, _>(error)
    .execute(conn)
    .await
    .map(drop)
}

/// Deletes up to `limit` captured rows: rows with `seq` at most `up_to_seq` (the highest
/// `seq` the relay has confirmed), recorded more than `older_than` ago, not parked, and
/// without a `last_error` (a parked row released by `outbox-relay retry` keeps it until the
/// reader has published it: its release is an UPDATE that the reader reads the row for).
/// Returns how many. Deleting a row never affects delivery: its insert is in the WAL.
pub async fn delete_captured(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    up_to_seq: i64,
    older_than: Duration,
    limit: i64,
) -> diesel::QueryResult<usize> {
    let t = table.quoted();
    diesel::sql_query(format!(
        "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} WHERE seq <= $1 AND parked_at IS NULL \
         AND last_error IS NULL AND created_at < now() - make_interval(secs => $2) ORDER BY seq LIMIT $3 \
         FOR UPDATE SKIP LOCKED)"
    ))
    .bind::<BigInt, _>(up_to_seq)
    .bind::<Double, _>(older_than.as_secs_f64())
    .bind::<BigInt, _>(limit)
    .execute(conn)
    .await
}

/// The rows `seqs` of `table` as they are now.
async fn rows_by_seq(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seqs: &[i64],
) -> diesel::QueryResult<Vec<OutboxRow>> {
    diesel::sql_query(format!(
        "SELECT seq, id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, \
         attempts FROM {} WHERE seq = ANY($1) AND parked_at IS NULL ORDER BY seq",
        table.quoted()
    ))
    .bind::<Array<BigInt>, _>(seqs)
    .load(conn)
    .await
}

/// Up to `limit` rows after `after_seq`, in `seq` order, that no relay has published and
/// that are not parked, as the snapshot transaction of [`WalReader::create_slot`] sees them:
/// the rows committed before the slot's consistent point.
pub async fn snapshot_rows(
    snapshot: &mut AsyncPgConnection,
    table: &OutboxTable,
    after_seq: i64,
    limit: i64,
) -> diesel::QueryResult<Vec<OutboxRow>> {
    diesel::sql_query(format!(
        "SELECT seq, id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, \
         attempts FROM {} WHERE published_at IS NULL AND parked_at IS NULL AND seq > $1 \
         ORDER BY seq LIMIT $2",
        table.quoted()
    ))
    .bind::<BigInt, _>(after_seq)
    .bind::<BigInt, _>(limit)
    .load(snapshot)
    .await
}

/// Ends the snapshot transaction of [`WalReader::create_slot`].
pub async fn end_snapshot(snapshot: &mut AsyncPgConnection) -> diesel::QueryResult<()> {
    snapshot.batch_execute("COMMIT").await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_round_trips() {
        for s in ["0/0", "0/16B3748", "16/B374D848", "FFFFFFFF/FFFFFFFF"] {
            let l: Lsn = s.parse().expect("lsn");
            assert_eq!(l.to_string(), s);
        }
        assert!("16B374D848".parse::<Lsn>().is_err());
        assert!(Lsn(1) < Lsn(2));
    }

    #[test]
    fn parses_iso_timestamptz() {
        let t = parse_timestamptz("2026-12-01 10:00:00.123456+00").expect("ts");
        assert_eq!(t.to_rfc3339(), "2026-12-01T10:00:00.123456+00:00");
        let t = parse_timestamptz("2026-12-01 10:00:00+05:30").expect("ts");
        assert_eq!(t.to_rfc3339(), "2026-12-01T04:30:00+00:00");
    }

    #[test]
    fn replication_errors_are_decided_on_their_sqlstate_in_any_language() {
        use pgwire_replication::PgWireError;
        let busy = PgWireError::Server(
            "Replikations-Slot »s« ist aktiv für PID 4711 (SQLSTATE 55006)".into(),
        );
        assert_eq!(server_sqlstate(&busy), Some("55006"));
        let denied = PgWireError::Server(
            "doit être super-utilisateur ou avoir l'attribut REPLICATION (SQLSTATE 42501)".into(),
        );
        assert_eq!(server_sqlstate(&denied), Some("42501"));
        assert_eq!(
            server_sqlstate(&PgWireError::Server("no code".into())),
            None
        );
        assert_eq!(
            server_sqlstate(&PgWireError::Protocol("x (SQLSTATE 55006)".into())),
            None
        );
    }

    #[test]
    fn slot_names() {
        assert!(check_slot_name("outbox_slot").is_ok());
        assert!(check_slot_name("Outbox").is_err());
        assert!(check_slot_name("").is_err());
        assert!(check_slot_name(&"a".repeat(64)).is_err());
    }

    fn stream_config(url: &str) -> StreamConfig {
        let r = WalReader::new(OutboxTable::DEFAULT, "s", "p")
            .streaming(url, Duration::from_millis(5))
            .expect("a usable URL");
        r.streaming.expect("streaming set")
    }

    #[test]
    fn the_replication_connection_uses_the_database_url() {
        let c = stream_config("postgres://relay:s%40cret@db.internal:6432/app");
        assert_eq!(
            (&*c.host, c.port, &*c.user, &*c.password, &*c.database),
            ("db.internal", 6432, "relay", "s@cret", "app")
        );
        assert_eq!(c.wait, Duration::from_millis(5));
        let c = stream_config("host=/var/run/postgresql user=relay dbname=app");
        assert_eq!(
            (&*c.host, c.port, &*c.user, &*c.database),
            ("/var/run/postgresql", 5432, "relay", "app")
        );
        // the database defaults to the user's name, as libpq does
        assert_eq!(stream_config("postgres://relay@db").database, "relay");
        let err = WalReader::new(OutboxTable::DEFAULT, "s", "p")
            .streaming("postgres://db:notaport/app", Duration::ZERO)
            .expect_err("a bad port");
        assert!(
            err.to_string().contains("cannot use the database URL"),
            "{err}"
        );
    }
}
