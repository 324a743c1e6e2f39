//! Operations on a running deployment: `status`, `parked`, `retry`, as library functions
//! that return typed reports. The `outbox-relay` binary prints them (text through
//! [`Display`](std::fmt::Display), `--json` through serde); a service can serve or check them
//! itself.

#[cfg(feature = "admin")]
pub mod admin;

use std::fmt;
use std::time::Duration;

use diesel::QueryResult;
use diesel_async::AsyncPgConnection;
use outbox_diesel::OutboxTable;
use outbox_diesel::relay as db;
use outbox_diesel::wal;

use crate::ModeKind;

/// What [`status`] reports on, and what counts as stalled.
///
/// ```
/// use std::time::Duration;
/// use outbox_nats::operations::StatusOptions;
///
/// let options = StatusOptions::new(outbox_diesel::OutboxTable::DEFAULT)
///     .stall_after(Duration::from_secs(60));
/// assert_eq!(options.stall_after, Duration::from_secs(60));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StatusOptions {
    /// The outbox table.
    pub table: OutboxTable,
    /// The relays' mode: in log-tailing mode rows are never marked published, so only the
    /// slot's lag counts toward a stall.
    pub mode: ModeKind,
    /// Stalled when the oldest unpublished row (or unconfirmed transaction of the slot) is
    /// older than this (default 30 s).
    pub stall_after: Duration,
    /// The replication slot to report on (default `{table}_slot`; reported when it exists).
    pub slot: Option<String>,
    /// The slot's publication (default `{table}_pub`).
    pub publication: Option<String>,
    /// The slot lags when its unconfirmed WAL exceeds this (default 1 GiB).
    pub slot_lag_warn_bytes: u64,
    /// The partition count to break the backlog down by (default: the running relays').
    pub partitions: Option<u32>,
}

impl StatusOptions {
    /// The defaults for `table`.
    pub fn new(table: OutboxTable) -> Self {
        StatusOptions {
            table,
            mode: ModeKind::Ordered,
            stall_after: Duration::from_secs(30),
            slot: None,
            publication: None,
            slot_lag_warn_bytes: 1 << 30,
            partitions: None,
        }
    }

    /// Sets [`mode`](Self::mode).
    pub fn mode(mut self, mode: ModeKind) -> Self {
        self.mode = mode;
        self
    }

    /// Sets [`stall_after`](Self::stall_after).
    pub fn stall_after(mut self, stall_after: Duration) -> Self {
        self.stall_after = stall_after;
        self
    }

    /// Sets [`slot`](Self::slot).
    pub fn slot(mut self, slot: impl Into<String>) -> Self {
        self.slot = Some(slot.into());
        self
    }

    /// Sets [`publication`](Self::publication).
    pub fn publication(mut self, publication: impl Into<String>) -> Self {
        self.publication = Some(publication.into());
        self
    }

    /// Sets [`slot_lag_warn_bytes`](Self::slot_lag_warn_bytes).
    pub fn slot_lag_warn_bytes(mut self, bytes: u64) -> Self {
        self.slot_lag_warn_bytes = bytes;
        self
    }

    /// Sets [`partitions`](Self::partitions).
    pub fn partitions(mut self, partitions: u32) -> Self {
        self.partitions = Some(partitions);
        self
    }

    /// The options that report on the relays `config` runs: its table and mode, and the mode's
    /// partition count (ordered) or slot, publication and slot-lag threshold (log tailing);
    /// the defaults for the rest.
    ///
    /// ```
    /// use outbox_nats::{LogTailing, ModeKind, RelayConfig, operations::StatusOptions};
    ///
    /// let config = RelayConfig::new("postgres://localhost/app").mode(LogTailing::default());
    /// let options = StatusOptions::for_relay(&config);
    /// assert_eq!(options.mode, ModeKind::LogTailing);
    /// assert_eq!(options.slot.as_deref(), Some("outbox_slot"));
    /// ```
    pub fn for_relay(config: &crate::RelayConfig) -> Self {
        let mut options = StatusOptions::new(config.table.clone()).mode(config.mode.kind());
        match &config.mode {
            crate::Mode::Ordered(o) => options.partitions = Some(o.partitions),
            crate::Mode::Unordered(_) => {}
            crate::Mode::LogTailing(l) => {
                options.slot = Some(l.slot_name(&config.table));
                options.publication = Some(l.publication_name(&config.table));
                options.slot_lag_warn_bytes = l.slot_lag_warn_bytes;
            }
        }
        options
    }
}

/// The state of an outbox table and its relays (`outbox-relay status`; its `--json` form is
/// this type's serde form, documented in the README).
#[derive(Debug, Clone, serde::Serialize)]
#[non_exhaustive]
pub struct Status {
    /// The table.
    pub table: String,
    /// Its backlog.
    pub backlog: db::Backlog,
    /// Whether the oldest unpublished row (or the slot's oldest unconfirmed transaction) is
    /// older than [`stall_after_seconds`](Self::stall_after_seconds).
    pub stalled: bool,
    /// The stall threshold.
    pub stall_after_seconds: f64,
    /// The partitions' owners.
    pub owners: Vec<db::PartitionOwner>,
    /// The replication slot, when it exists.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<SlotStatus>,
    /// The partition count of the breakdown: the one asked for, or the running relays'.
    pub partition_count: Option<u32>,
    /// The backlog of each partition with its owner.
    pub partitions: Vec<PartitionStatus>,
    /// The running relays.
    pub relays: Vec<db::Member>,
    /// Vacuum's figures of the table.
    pub table_stats: Option<db::TableStats>,
    /// The oldest open snapshot of the database.
    pub oldest_transaction: Option<db::OldestTransaction>,
    /// The figures that could not be read, each with the server's reason: they are left out
    /// above (`owners` and `relays` empty, `table_stats` and `oldest_transaction` null), which
    /// does not mean that there are none. Absent from the JSON when everything was read.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unread: Vec<Unread>,
}

/// A figure of a [`Status`] that could not be read.
#[derive(Debug, Clone, serde::Serialize)]
#[non_exhaustive]
pub struct Unread {
    /// The figure: `owners`, `relays`, `table_stats` or `oldest_transaction`.
    pub figure: &'static str,
    /// Why, as the server said it.
    pub error: String,
}

/// The figure `result` read, or `None` with the reason in `unread`.
fn figure<T>(unread: &mut Vec<Unread>, figure: &'static str, result: QueryResult<T>) -> Option<T> {
    match result {
        Ok(v) => Some(v),
        Err(e) => {
            unread.push(Unread {
                figure,
                error: e.to_string(),
            });
            None
        }
    }
}

/// One partition's backlog and owner in a [`Status`].
#[derive(Debug, Clone, serde::Serialize)]
#[non_exhaustive]
pub struct PartitionStatus {
    /// Its backlog.
    #[serde(flatten)]
    pub backlog: db::PartitionBacklog,
    /// The backend pid of the relay session that owns it.
    pub owner_pid: Option<i32>,
    /// That session's `application_name`.
    pub owner_application_name: Option<String>,
}

/// A replication slot's figures in a [`Status`].
#[derive(Debug, Clone, serde::Serialize)]
#[non_exhaustive]
pub struct SlotStatus {
    /// Its position, lag and reader.
    #[serde(flatten)]
    pub lag: wal::SlotLag,
    /// Seconds since the oldest unconfirmed transaction committed; `None` when it could not
    /// be read (a reader streams the slot, or the role lacks REPLICATION).
    pub lag_seconds: Option<f64>,
    /// Past [`StatusOptions::slot_lag_warn_bytes`] or [`StatusOptions::stall_after`].
    pub lagging: bool,
}

/// The partition count in force: the oldest running relay's (a relay with another count
/// waits until the older ones are gone).
fn partition_count(relays: &[db::Member]) -> Option<u32> {
    relays.first().map(|m| m.partitions.max(1) as u32)
}

/// Reads the state of the outbox table and its relays. Only the backlog must be readable;
/// figures the role may not read (another role's sessions, a slot without REPLICATION) are
/// left out, and those whose query failed are named in [`Status::unread`].
pub async fn status(conn: &mut AsyncPgConnection, options: &StatusOptions) -> QueryResult<Status> {
    let table = &options.table;
    let mut unread = Vec::new();
    let owners = db::partition_owners(conn, table).await;
    let owners = figure(&mut unread, "owners", owners).unwrap_or_default();
    let relays = db::members(conn, table).await;
    let relays = figure(&mut unread, "relays", relays).unwrap_or_default();
    let partition_count = options.partitions.or_else(|| partition_count(&relays));
    let (backlog, parts) = match partition_count {
        // the table's and the partitions' figures from one snapshot: they add up
        Some(n) => db::backlogs(conn, table, n).await?,
        None => (db::backlog(conn, table).await?, Vec::new()),
    };
    let partitions = parts
        .into_iter()
        .map(|backlog| {
            let owner = owners.iter().find(|o| o.partition == backlog.partition);
            PartitionStatus {
                owner_pid: owner.map(|o| o.pid),
                owner_application_name: owner.and_then(|o| o.application_name.clone()),
                backlog,
            }
        })
        .collect();
    let table_stats = db::table_stats(conn, table).await;
    let table_stats = figure(&mut unread, "table_stats", table_stats).flatten();
    let oldest_transaction = db::oldest_transaction(conn).await;
    let oldest_transaction =
        figure(&mut unread, "oldest_transaction", oldest_transaction).flatten();
    let slot = slot_status(conn, options).await;
    let stall_after = options.stall_after.as_secs_f64();
    let slot_stalled = slot
        .as_ref()
        .and_then(|s| s.lag_seconds)
        .is_some_and(|s| s > stall_after);
    let stalled = match options.mode {
        ModeKind::LogTailing => slot_stalled,
        _ => backlog.oldest_age_seconds > stall_after || slot_stalled,
    };
    Ok(Status {
        table: table.to_string(),
        backlog,
        stalled,
        stall_after_seconds: stall_after,
        owners,
        slot,
        partition_count,
        partitions,
        relays,
        table_stats,
        oldest_transaction,
        unread,
    })
}

/// The slot's lag, when the slot exists. Reading its age decodes up to one transaction and
/// needs the slot for an instant, so it is unknown while a reader streams the slot.
async fn slot_status(conn: &mut AsyncPgConnection, options: &StatusOptions) -> Option<SlotStatus> {
    let slot = options
        .slot
        .clone()
        .unwrap_or_else(|| wal::default_slot(&options.table));
    let publication = options
        .publication
        .clone()
        .unwrap_or_else(|| wal::default_publication(&options.table));
    let lag = wal::slot_lag(conn, &slot).await.ok().flatten()?;
    let mut lag_seconds = None;
    for _ in 0..5 {
        match wal::pending_age_seconds(conn, &slot, &publication).await {
            Ok(s) => {
                lag_seconds = Some(s);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(30)).await,
        }
    }
    let lagging = lag.lag_bytes as u64 > options.slot_lag_warn_bytes
        || lag_seconds.is_some_and(|s| s > options.stall_after.as_secs_f64());
    Some(SlotStatus {
        lag,
        lag_seconds,
        lagging,
    })
}

/// The parked rows of `table`, oldest first: the events the relay gave up on, each holding
/// back the later events of its aggregate (`outbox-relay parked`).
pub async fn parked(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<Vec<db::ParkedRow>> {
    db::parked(conn, table).await
}

/// Which parked rows [`retry`] releases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// The row with this `seq`.
    Seq(i64),
    /// Every parked row.
    All,
}

/// A [`retry`] that released nothing it was asked to.
#[derive(Debug, thiserror::Error)]
pub enum RetryError {
    /// No parked row has this `seq`.
    #[error("no parked row with seq {0}")]
    NotParked(i64),
    /// The update failed.
    #[error(transparent)]
    Query(#[from] diesel::result::Error),
}

/// Releases parked rows (`outbox-relay retry`): the relay publishes them, in order with the
/// rows they held back, at once when it listens on the table's channel (`retry` notifies it),
/// or on its next poll. Returns how many were released.
pub async fn retry(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    which: Retry,
) -> Result<usize, RetryError> {
    let seq = match which {
        Retry::Seq(seq) => Some(seq),
        Retry::All => None,
    };
    match db::retry_parked(conn, table, seq).await? {
        0 if seq.is_some() => Err(RetryError::NotParked(seq.unwrap_or_default())),
        n => Ok(n),
    }
}

impl fmt::Display for Status {
    /// The text form of `outbox-relay status`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.backlog;
        writeln!(f, "table            {}", self.table)?;
        writeln!(f, "unpublished      {}", b.unpublished)?;
        writeln!(f, "oldest age       {:.3}s", b.oldest_age_seconds)?;
        writeln!(f, "parked           {}", b.parked)?;
        writeln!(
            f,
            "in doubt         {} (oldest {:.3}s)",
            b.in_doubt, b.oldest_in_doubt_age_seconds
        )?;
        writeln!(
            f,
            "stalled          {} (after {:?})",
            self.stalled,
            Duration::from_secs_f64(self.stall_after_seconds)
        )?;
        if let Some(u) = self.why_unread("owners") {
            writeln!(f, "owners           unknown: {}", u.error)?;
        } else if self.owners.is_empty() {
            writeln!(f, "owners           none: no relay holds a partition")?;
        }
        for o in &self.owners {
            writeln!(
                f,
                "partition {:<5}  pid {} {} {}",
                o.partition,
                o.pid,
                o.application_name.as_deref().unwrap_or("-"),
                o.client_addr.as_deref().unwrap_or("local")
            )?;
        }
        self.fmt_operations(f)?;
        if let Some(s) = &self.slot {
            s.fmt(f)?;
        }
        Ok(())
    }
}

impl Status {
    /// The relays, partitions, vacuum and snapshot figures.
    fn fmt_operations(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.why_unread("relays") {
            Some(u) => writeln!(f, "relays           unknown: {}", u.error)?,
            None => writeln!(f, "relays           {}", self.relays.len())?,
        }
        for r in &self.relays {
            writeln!(
                f,
                "  relay          pid {}  partitions {}  joined #{}  since {}",
                r.pid,
                r.partitions,
                r.joined,
                r.backend_start
                    .map_or_else(|| "(not visible to this role)".into(), |t| t.to_rfc3339())
            )?;
        }
        if let Some(n) = self.partition_count {
            writeln!(f, "partitions       {n}")?;
            for p in &self.partitions {
                writeln!(
                    f,
                    "  partition {:<4} unpublished {:<8} oldest {:>9.3}s  parked {:<4} owner {}",
                    p.backlog.partition,
                    p.backlog.unpublished,
                    p.backlog.oldest_age_seconds,
                    p.backlog.parked,
                    p.owner_pid
                        .map_or_else(|| "none".to_owned(), |pid| format!("pid {pid}"))
                )?;
            }
        }
        match &self.table_stats {
            Some(t) => {
                writeln!(
                    f,
                    "table rows       {} live, {} dead (not vacuumed yet), {} bytes",
                    t.live_rows, t.dead_rows, t.total_bytes
                )?;
                writeln!(
                    f,
                    "last autovacuum  {} ({} so far)",
                    t.last_autovacuum
                        .map_or_else(|| "never".to_owned(), |t| t.to_rfc3339()),
                    t.autovacuum_count
                )?;
            }
            None => match self.why_unread("table_stats") {
                Some(u) => writeln!(f, "table rows       unknown: {}", u.error)?,
                None => writeln!(f, "table rows       no statistics yet")?,
            },
        }
        match &self.oldest_transaction {
            Some(x) => writeln!(
                f,
                "oldest snapshot  {:.3}s, {} transactions behind: pid {} {} ({}){}",
                x.age_seconds,
                x.xmin_age,
                x.pid,
                x.application_name.as_deref().unwrap_or("-"),
                x.state.as_deref().unwrap_or("-"),
                if x.state.as_deref() == Some("idle in transaction") {
                    "; it keeps every dead row alive: end it"
                } else {
                    ""
                }
            ),
            None => match self.why_unread("oldest_transaction") {
                Some(u) => writeln!(f, "oldest snapshot  unknown: {}", u.error),
                None => writeln!(f, "oldest snapshot  none open"),
            },
        }
    }

    /// Why `figure` could not be read, if it could not.
    fn why_unread(&self, figure: &str) -> Option<&Unread> {
        self.unread.iter().find(|u| u.figure == figure)
    }
}

impl fmt::Display for SlotStatus {
    /// The slot's lines in the text form of `outbox-relay status`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = &self.lag;
        writeln!(f, "slot             {}", l.slot)?;
        writeln!(
            f,
            "slot confirmed   {}",
            l.confirmed_flush_lsn.as_deref().unwrap_or("-")
        )?;
        writeln!(f, "slot lag         {} bytes", l.lag_bytes)?;
        match self.lag_seconds {
            Some(secs) => writeln!(f, "slot lag age     {secs:.3}s")?,
            None => writeln!(
                f,
                "slot lag age     unknown (a reader streams the slot: see its outbox_slot_lag_seconds; or no REPLICATION right)"
            )?,
        }
        writeln!(f, "slot retains     {} bytes of WAL", l.retained_bytes)?;
        writeln!(
            f,
            "slot wal status  {} (safe for {} more bytes)",
            l.wal_status.as_deref().unwrap_or("-"),
            l.safe_wal_size
                .map_or_else(|| "unlimited".to_owned(), |b| b.to_string())
        )?;
        match l.reader_pid {
            Some(pid) => writeln!(f, "slot reader      pid {pid}")?,
            None => writeln!(f, "slot reader      none: no relay reads the slot")?,
        }
        if self.lagging {
            writeln!(
                f,
                "WARNING          the slot lags: PostgreSQL keeps its WAL until a relay confirms it; see max_slot_wal_keep_size"
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LogTailing, Ordered, RelayConfig, Unordered};

    #[test]
    fn status_options_for_a_relay_carry_its_mode_settings() {
        let table: OutboxTable = "billing.events".parse().expect("a name");
        let config = |mode: crate::Mode| {
            let mut c = RelayConfig::new("postgres://localhost/app").mode(mode);
            c.table = table.clone();
            c
        };
        let ordered = StatusOptions::for_relay(&config(Ordered::default().partitions(4).into()));
        assert_eq!(
            (ordered.mode, ordered.partitions, ordered.slot),
            (ModeKind::Ordered, Some(4), None)
        );
        let unordered = StatusOptions::for_relay(&config(Unordered::default().into()));
        assert_eq!(
            (unordered.mode, unordered.partitions),
            (ModeKind::Unordered, None)
        );
        let tailing = LogTailing {
            publication: Some("pub".into()),
            slot_lag_warn_bytes: 5,
            ..LogTailing::default()
        };
        let tailing = StatusOptions::for_relay(&config(tailing.into()));
        assert_eq!(tailing.table, table);
        assert_eq!(tailing.mode, ModeKind::LogTailing);
        assert_eq!(tailing.slot.as_deref(), Some("billing_events_slot"));
        assert_eq!(tailing.publication.as_deref(), Some("pub"));
        assert_eq!(tailing.slot_lag_warn_bytes, 5);
    }
}
