//! Log tailing's database side (feature `async`): the publication and the logical replication
//! slot, reading the committed inserts of the outbox table from the WAL in commit order,
//! confirming a position, the slot's lag, parking and deleting captured rows.
//!
//! A reader reads the slot over a replication connection of its own
//! ([`WalReader::streaming`]; `START_REPLICATION` with the built-in `pgoutput` plugin): the
//! server decodes each WAL record once and sends each transaction as it commits, in commit
//! order from the slot's confirmed position. A read stops at its limits (messages and bytes)
//! even inside a transaction, so a transaction of any size is handed over in parts and the
//! reader's memory does not grow with it. A position is confirmed by the standby status the
//! reader sends after JetStream acked everything before it (or with
//! `pg_replication_slot_advance` when no replication connection holds the slot). Logical
//! decoding's SQL interface (`pg_logical_slot_peek_binary_changes`) is not a reading path: every
//! call decodes again from the slot's restart position, which PostgreSQL moves only at its
//! periodic snapshots, so a backlog is decoded over and over; `status` uses it only to look at
//! the oldest unconfirmed transaction. A reader made without `streaming` sets the slot up and
//! confirms, and refuses to read ([`WalError::NotStreaming`]).
//!
//! A crash between publishing and confirming can only make the next reader read (and
//! publish) the same transactions again, never skip one.
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

mod captured;
mod decode;
mod error;
pub mod pgoutput;
mod publication;
mod slot;
mod status;
mod stream;

pub use captured::{delete_captured, end_snapshot, park, pending_age_seconds, snapshot_rows};
use decode::Captured;
pub use error::WalError;
pub use slot::{SLOTS_TABLE, SlotState};
pub use status::{SlotLag, slot_lag};
use stream::{Stream, StreamConfig};

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

pub use crate::relay::SLOT_LOCK_KEY;

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
/// It reads over a replication connection of its own, made by [`WalReader::streaming`]
/// (`START_REPLICATION`, as a subscriber or Debezium does), which decodes each WAL record once
/// and sends each transaction as it commits; a reader made without it sets the slot up and
/// advances it, and its [`WalReader::read`] returns [`WalError::NotStreaming`].
#[derive(Debug)]
pub struct WalReader {
    table: OutboxTable,
    slot: String,
    publication: String,
    table_oid: Option<u32>,
    /// The schema the table was found in, to know it when it is made again under its name.
    table_namespace: Option<String>,
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
    /// How often the caller's session is sent a query while the reader waits on its
    /// replication connection (making the slot).
    keep_alive: Duration,
}

/// A transaction (or part) as read, before released parked rows are looked up.
struct Read {
    xid: u32,
    commit_lsn: Lsn,
    end_lsn: Option<Lsn>,
    commit_time: DateTime<Utc>,
    captured: Vec<Captured>,
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
    #[diesel(sql_type = Nullable<Text>)]
    namespace: Option<String>,
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
            table_namespace: None,
            relations: HashMap::new(),
            streaming: None,
            stream: None,
            acked: Lsn(0),
            recover: false,
            released: Vec::new(),
            keep_alive: Duration::from_secs(1),
        }
    }

    /// How often the caller's session is sent a query (`SELECT 1`) while the reader waits on
    /// its replication connection, which making the slot does until every transaction running
    /// then has ended (default every second): a session that holds a lock, and that
    /// PostgreSQL would end after `idle_session_timeout` of silence, keeps it however long the
    /// wait.
    pub fn keep_session_alive(mut self, every: Duration) -> Self {
        self.keep_alive = every.max(Duration::from_millis(10));
        self
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

    /// Reads the committed transactions after the slot's confirmed position, in commit
    /// order, until about `limit` messages. A streaming reader stops there even inside a
    /// transaction, which then comes in parts (see [`Transaction`]). Nothing is consumed: the same transactions come
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
    /// (`Duration::ZERO`: only what has arrived; the messages that come within a millisecond
    /// of the first are taken with it). A reader made without
    /// [`WalReader::streaming`] refuses ([`WalError::NotStreaming`]).
    pub async fn read_within(
        &mut self,
        conn: &mut AsyncPgConnection,
        limit: usize,
        max_bytes: usize,
        wait: Duration,
    ) -> Result<WalBatch, WalError> {
        let limit = limit.max(1);
        let Some(mut cfg) = self.streaming.clone() else {
            return Err(WalError::NotStreaming);
        };
        cfg.wait = wait;
        self.read_stream(conn, &cfg, limit, max_bytes.max(1)).await
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
}

/// The streaming way of reading (see [`WalReader::streaming`]).
impl WalReader {
    /// Drops what was received and not confirmed: the next read starts again from the last
    /// confirmed position (after a failed publish, to send the same transactions again).
    pub fn rewind(&mut self) {
        if let Some(mut st) = self.stream.take() {
            st.client.abort();
        }
    }

    /// Waits until the replication connection has something for the next read (a message, or
    /// its end), or until `until`; `true` when it has. The message is kept for that read.
    /// Cancel-safe: a caller may wait on it beside other work (the acks of what it sent) and
    /// read as soon as either comes, where a read that found nothing would have had it wait
    /// for that work alone. Without a replication connection (before the first read, after
    /// [`WalReader::rewind`]) it waits until `until` and returns `false`: the next read
    /// connects.
    pub async fn wait_readable(&mut self, until: tokio::time::Instant) -> bool {
        match self.stream.as_mut() {
            Some(st) => st.wait_readable(until).await,
            None => {
                tokio::time::sleep_until(until).await;
                false
            }
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

#[cfg(test)]
mod tests {
    use super::decode::parse_timestamptz;
    use super::error::server_sqlstate;
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
