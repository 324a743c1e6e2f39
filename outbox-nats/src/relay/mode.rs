//! [`Mode`]: how the relay reads the outbox, each mode carrying the settings that only it has
//! ([`Ordered`], [`Unordered`], [`LogTailing`]), and what the polling modes do with the rows
//! JetStream acked ([`Cleanup`]). A setting of another mode cannot be set, so none is ignored.

use std::time::Duration;

use outbox_diesel::OutboxTable;

/// Which mode, without its settings: `--mode ordered|unordered|log-tailing` with the `cli`
/// feature, and what `status` needs to know of the relays it reports on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[non_exhaustive]
pub enum ModeKind {
    /// [`Mode::Ordered`].
    #[default]
    Ordered,
    /// [`Mode::Unordered`].
    Unordered,
    /// [`Mode::LogTailing`].
    LogTailing,
}

impl std::fmt::Display for ModeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModeKind::Ordered => f.write_str("ordered"),
            ModeKind::Unordered => f.write_str("unordered"),
            ModeKind::LogTailing => f.write_str("log-tailing"),
        }
    }
}

/// How the relay reads the outbox, with that mode's own settings.
///
/// ```
/// use std::time::Duration;
/// use outbox_nats::{Cleanup, LogTailing, Mode, ModeKind, Ordered, RelayConfig};
///
/// // the default: one partition, rows marked published and deleted after 5 minutes
/// assert_eq!(RelayConfig::new("postgres://relay@db/app").mode.kind(), ModeKind::Ordered);
///
/// let ordered = RelayConfig::new("postgres://relay@db/app").mode(
///     Ordered::default()
///         .partitions(8)
///         .cleanup(Cleanup::default().retention(Duration::from_secs(3600))),
/// );
/// assert!(matches!(&ordered.mode, Mode::Ordered(o) if o.partitions == 8));
///
/// let tailing = RelayConfig::new("postgres://relay@db/app")
///     .mode(LogTailing::default().slot("orders_slot").recover_slot(true));
/// assert_eq!(tailing.mode.kind(), ModeKind::LogTailing);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Mode {
    /// Each of `partitions` partitions (by a stable hash of the aggregate id) is published by
    /// one relay at a time, in `seq` order: events of one aggregate keep their order.
    Ordered(Ordered),
    /// `workers` competing workers claim rows with `FOR UPDATE SKIP LOCKED`: any number of
    /// relays, no leases, no order per aggregate.
    Unordered(Unordered),
    /// One reader per replication slot reads the table's committed inserts from the WAL
    /// (logical decoding, `pgoutput`) in commit order and confirms the slot only after
    /// JetStream acked; other relays stand by and take over when it dies.
    LogTailing(LogTailing),
}

impl Default for Mode {
    fn default() -> Self {
        Mode::Ordered(Ordered::default())
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.kind().fmt(f)
    }
}

impl Mode {
    /// Which mode this is.
    pub fn kind(&self) -> ModeKind {
        match self {
            Mode::Ordered(_) => ModeKind::Ordered,
            Mode::Unordered(_) => ModeKind::Unordered,
            Mode::LogTailing(_) => ModeKind::LogTailing,
        }
    }

    /// What becomes of published rows: the polling modes' [`Cleanup`]; `None` in log-tailing
    /// mode, which never marks rows.
    pub fn cleanup(&self) -> Option<&Cleanup> {
        match self {
            Mode::Ordered(o) => Some(&o.cleanup),
            Mode::Unordered(u) => Some(&u.cleanup),
            Mode::LogTailing(_) => None,
        }
    }

    /// Whether publishes carry `Nats-Expected-Last-Subject-Sequence` ([`Ordered::fence`],
    /// [`LogTailing::fence`]); unordered mode has no order to fence.
    pub fn fence(&self) -> bool {
        match self {
            Mode::Ordered(o) => o.fence,
            Mode::Unordered(_) => false,
            Mode::LogTailing(t) => t.fence,
        }
    }

    /// Whether acked rows are deleted rather than marked ([`Cleanup::delete_published`]).
    pub(crate) fn deletes_published(&self) -> bool {
        self.cleanup().is_some_and(|c| c.delete_published)
    }

    /// The partitions of the table: ordered mode's count, 1 in the other modes.
    pub(crate) fn partitions(&self) -> u32 {
        match self {
            Mode::Ordered(o) => o.partitions,
            Mode::Unordered(_) | Mode::LogTailing(_) => 1,
        }
    }
}

impl From<Ordered> for Mode {
    fn from(o: Ordered) -> Self {
        Mode::Ordered(o)
    }
}

impl From<Unordered> for Mode {
    fn from(u: Unordered) -> Self {
        Mode::Unordered(u)
    }
}

impl From<LogTailing> for Mode {
    fn from(t: LogTailing) -> Self {
        Mode::LogTailing(t)
    }
}

/// Ordered mode's settings (the default mode).
///
/// ```
/// use outbox_nats::{Ordered, RelayConfig};
///
/// let config = RelayConfig::new("postgres://relay@db/app").mode(Ordered::default().partitions(4));
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Ordered {
    /// Partitions of the table (default 1, at most
    /// [`MAX_PARTITIONS`](outbox_diesel::relay::MAX_PARTITIONS), 1,024), each published by
    /// one relay at a time. Every relay of a table must run with the same count.
    pub partitions: u32,
    /// Whether publishes carry `Nats-Expected-Last-Subject-Sequence` (default off), so that
    /// JetStream refuses an event that would land after a newer one of its subject: a relay
    /// resumed after a pause longer than the duplicate window can neither duplicate nor
    /// reorder (see [`fence`](crate::fence)). It costs throughput (7–12 % with a thousand
    /// aggregates, about half with a new subject per row: BENCHMARKS.md, section 7), hence
    /// off by default.
    pub fence: bool,
    /// What becomes of published rows.
    pub cleanup: Cleanup,
}

impl Default for Ordered {
    fn default() -> Self {
        Ordered {
            partitions: 1,
            fence: false,
            cleanup: Cleanup::default(),
        }
    }
}

impl Ordered {
    /// Sets [`Ordered::partitions`].
    pub fn partitions(mut self, n: u32) -> Self {
        self.partitions = n;
        self
    }

    /// Sets [`Ordered::fence`].
    pub fn fence(mut self, on: bool) -> Self {
        self.fence = on;
        self
    }

    /// Sets [`Ordered::cleanup`].
    pub fn cleanup(mut self, cleanup: Cleanup) -> Self {
        self.cleanup = cleanup;
        self
    }
}

/// Unordered mode's settings.
///
/// ```
/// use outbox_nats::{RelayConfig, Unordered};
///
/// let config = RelayConfig::new("postgres://relay@db/app").mode(Unordered::default().workers(8));
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Unordered {
    /// Competing workers of this process (default 4, at most 256).
    pub workers: u32,
    /// What becomes of published rows.
    pub cleanup: Cleanup,
}

impl Default for Unordered {
    fn default() -> Self {
        Unordered {
            workers: 4,
            cleanup: Cleanup::default(),
        }
    }
}

impl Unordered {
    /// Sets [`Unordered::workers`].
    pub fn workers(mut self, n: u32) -> Self {
        self.workers = n;
        self
    }

    /// Sets [`Unordered::cleanup`].
    pub fn cleanup(mut self, cleanup: Cleanup) -> Self {
        self.cleanup = cleanup;
        self
    }
}

/// Log-tailing mode's settings.
///
/// ```
/// use outbox_diesel::OutboxTable;
/// use outbox_nats::{LogTailing, RelayConfig};
///
/// let tailing = LogTailing::default().publication("orders_pub");
/// assert_eq!(tailing.slot_name(&OutboxTable::DEFAULT), "outbox_slot");
/// assert_eq!(tailing.publication_name(&OutboxTable::DEFAULT), "orders_pub");
/// let config = RelayConfig::new("postgres://relay@db/app").mode(tailing);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct LogTailing {
    /// The logical replication slot; `None` derives it from the table: `outbox_slot` for
    /// `outbox` (see [`LogTailing::slot_name`]). Created when missing.
    pub slot: Option<String>,
    /// The publication; `None` derives it from the table: `outbox_pub`. Created when missing.
    pub publication: Option<String>,
    /// When the slot is missing although the relay read it before (dropped, or lost in a
    /// failover), make a new one and publish again every row still in the table and not
    /// parked, instead of stopping with an error (default off).
    pub recover_slot: bool,
    /// Warn (and set `outbox_slot_lagging`) when the slot's unconfirmed WAL exceeds this many
    /// bytes (default 1 GiB).
    pub slot_lag_warn_bytes: u64,
    /// How long captured rows stay in the table before the relay deletes them (default 1 h).
    /// Rows recorded with `Outbox::delete_after_insert` are gone at once.
    pub captured_retention: Duration,
    /// How often the relay deletes captured rows (default 1 min).
    pub captured_cleanup_interval: Duration,
    /// Whether publishes carry `Nats-Expected-Last-Subject-Sequence` (default off): see
    /// [`Ordered::fence`].
    pub fence: bool,
}

impl Default for LogTailing {
    fn default() -> Self {
        LogTailing {
            slot: None,
            publication: None,
            recover_slot: false,
            slot_lag_warn_bytes: 1 << 30,
            captured_retention: Duration::from_secs(3600),
            captured_cleanup_interval: Duration::from_secs(60),
            fence: false,
        }
    }
}

impl LogTailing {
    /// Sets [`LogTailing::slot`].
    pub fn slot(mut self, name: impl Into<String>) -> Self {
        self.slot = Some(name.into());
        self
    }

    /// Sets [`LogTailing::publication`].
    pub fn publication(mut self, name: impl Into<String>) -> Self {
        self.publication = Some(name.into());
        self
    }

    /// Sets [`LogTailing::recover_slot`].
    pub fn recover_slot(mut self, on: bool) -> Self {
        self.recover_slot = on;
        self
    }

    /// Sets [`LogTailing::slot_lag_warn_bytes`].
    pub fn slot_lag_warn_bytes(mut self, bytes: u64) -> Self {
        self.slot_lag_warn_bytes = bytes;
        self
    }

    /// Sets [`LogTailing::captured_retention`].
    pub fn captured_retention(mut self, d: Duration) -> Self {
        self.captured_retention = d;
        self
    }

    /// Sets [`LogTailing::captured_cleanup_interval`].
    pub fn captured_cleanup_interval(mut self, d: Duration) -> Self {
        self.captured_cleanup_interval = d;
        self
    }

    /// Sets [`LogTailing::fence`].
    pub fn fence(mut self, on: bool) -> Self {
        self.fence = on;
        self
    }

    /// The replication slot read for `table`: the configured slot or `{table}_slot`.
    pub fn slot_name(&self, table: &OutboxTable) -> String {
        self.slot
            .clone()
            .unwrap_or_else(|| outbox_diesel::wal::default_slot(table))
    }

    /// The publication read for `table`: the configured one or `{table}_pub`.
    pub fn publication_name(&self, table: &OutboxTable) -> String {
        self.publication
            .clone()
            .unwrap_or_else(|| outbox_diesel::wal::default_publication(table))
    }
}

/// What the polling modes do with the rows JetStream acked: mark them published and delete
/// (or archive) them after `retention`, or delete each at once.
///
/// Every relay may clean: concurrent cleaners skip each other's rows.
///
/// ```
/// use std::time::Duration;
/// use outbox_nats::Cleanup;
///
/// // keep a day of published rows for audit, in batches of 10,000
/// let kept = Cleanup::default().retention(Duration::from_secs(86_400)).batch(10_000);
/// // no published history: the least database work per event
/// let deleted = Cleanup::default().delete_published(true);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Cleanup {
    /// Whether the relay deletes published rows older than `retention` (default on; off when
    /// another relay or a cron job does).
    pub enabled: bool,
    /// How long published rows stay before cleanup deletes them (default 5 min; zero deletes
    /// them at the first cleanup after their publish).
    pub retention: Duration,
    /// How often cleanup runs (default 10 s).
    pub interval: Duration,
    /// Rows deleted per statement (default 5,000): each batch is one short transaction.
    pub batch: usize,
    /// Move published rows into this table instead of deleting them (default `None`: delete).
    /// It needs the outbox's columns: `CREATE TABLE outbox_archive (LIKE outbox)`.
    pub archive_table: Option<OutboxTable>,
    /// Delete each row as soon as JetStream acked it instead of setting `published_at`
    /// (default off). The table then holds only unpublished rows: no published history for
    /// `status` or an archive, and the least database work per event (a delete instead of an
    /// update and a later cleanup delete). It cannot go with `archive_table`.
    pub delete_published: bool,
}

impl Default for Cleanup {
    fn default() -> Self {
        Cleanup {
            enabled: true,
            retention: Duration::from_secs(300),
            interval: Duration::from_secs(10),
            batch: 5000,
            archive_table: None,
            delete_published: false,
        }
    }
}

impl Cleanup {
    /// Sets [`Cleanup::enabled`].
    pub fn enabled(mut self, on: bool) -> Self {
        self.enabled = on;
        self
    }

    /// Sets [`Cleanup::retention`].
    pub fn retention(mut self, d: Duration) -> Self {
        self.retention = d;
        self
    }

    /// Sets [`Cleanup::interval`].
    pub fn interval(mut self, d: Duration) -> Self {
        self.interval = d;
        self
    }

    /// Sets [`Cleanup::batch`].
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n;
        self
    }

    /// Sets [`Cleanup::archive_table`].
    pub fn archive_table(mut self, table: OutboxTable) -> Self {
        self.archive_table = Some(table);
        self
    }

    /// Sets [`Cleanup::delete_published`].
    pub fn delete_published(mut self, on: bool) -> Self {
        self.delete_published = on;
        self
    }

    /// Checks its values; part of [`RelayConfig::validate`](crate::RelayConfig::validate).
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.enabled && (self.interval.is_zero() || self.batch == 0) {
            return Err("--cleanup-interval and --cleanup-batch must be above 0".into());
        }
        if self.delete_published && self.archive_table.is_some() {
            return Err(
                "--delete-published deletes rows as they are acked, so nothing is left to move to --archive-table; pick one".into(),
            );
        }
        Ok(())
    }
}
