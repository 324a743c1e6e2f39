//! [`RelayConfig`]: what the relay publishes, where, and how fast; the mode and its own
//! settings are a [`Mode`].

use std::time::Duration;

use outbox_diesel::OutboxTable;

use crate::publish::subject::SubjectTemplate;
use crate::relay::mode::Mode;

/// Everything the relay needs besides its NATS client.
///
/// ```
/// use std::time::Duration;
/// use outbox_nats::{Ordered, RelayConfig};
///
/// let config = RelayConfig::new("postgres://relay@db/app")
///     .stream("ORDERS")
///     .subject_prefix("shop")
///     .mode(Ordered::default().partitions(4))
///     .poll_interval(Duration::from_millis(50));
/// assert_eq!(config.stream, "ORDERS");
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct RelayConfig {
    /// PostgreSQL connection URL.
    pub database_url: String,
    /// The outbox table (default `outbox`).
    pub table: OutboxTable,
    /// The JetStream stream (default `OUTBOX`).
    pub stream: String,
    /// The first subject token (default `outbox`); the stream captures `{prefix}.>`.
    pub subject_prefix: String,
    /// The subject of each event (default `{prefix}.{aggregate_type}.{aggregate_id}`).
    pub subject_template: SubjectTemplate,
    /// How rows are read, with the mode's own settings (default: [`Mode::Ordered`], one
    /// partition).
    pub mode: Mode,
    /// How long a silent database session keeps its partitions or claimed rows (default
    /// 15 s): PostgreSQL ends it after that (`idle_session_timeout`), and the relay stops
    /// publishing after half of it without an answer. A paused relay's work passes to another
    /// within about this time.
    pub lease: Duration,
    /// Rows read per query (default 500).
    pub batch_size: usize,
    /// Unacked publishes in flight at most (default 512), per worker in unordered mode. Their
    /// acks arrive on one subscription of the relay's NATS client, which must hold that many
    /// (`async_nats::ConnectOptions::subscription_capacity`, 65,536 by default): acks beyond
    /// it are dropped, and their publishes time out and are sent again.
    pub max_in_flight: usize,
    /// Payload bytes a batch holds at most (default 8 MiB), in every mode. Polling: a query
    /// stops taking rows once their payloads (as their JSON text) reach it, and always takes
    /// one, and so do the late rows of a transaction that commits more of them than a batch
    /// holds, read in parts; the relay holds about three batches (two per worker in unordered
    /// mode), and the publishes in flight stay within it too (one is always sent). Log
    /// tailing: the reader holds no more than this of events read and not acked; a read stops
    /// at what is left of it, inside a transaction too, so a larger transaction is published
    /// in parts while the rest of it is read (the replication client receives up to 64
    /// messages ahead besides). This bounds the relay's memory for any payload mix and any
    /// transaction size, as `batch_size` alone does not.
    pub max_batch_bytes: usize,
    /// How often an idle relay polls (default 100 ms); `NOTIFY` wakes it sooner.
    pub poll_interval: Duration,
    /// How long a polling relay keeps reading after a read that found rows, every tenth of
    /// it (1 ms at least), instead of waiting for the next `NOTIFY` (default 10 ms, the
    /// recording side's default [`Notify::Debounced`](outbox_diesel::Notify::Debounced)
    /// interval; zero turns it off). A debounced writer notifies the first commit of each
    /// interval only; the commits after it are found by these reads within a millisecond
    /// instead of by the next notified commit or poll. Set it to the writers' debounce
    /// interval. The first of these reads runs at once (an ordered relay's batch statement,
    /// an unordered worker's claim); the next ones ask PostgreSQL first whether a
    /// transaction ended, as a poll does. At 100 commits a second, an ordered relay's
    /// sessions spend about 12-13% of a core with the default and 9-10% with none
    /// (BENCHMARKS.md section 32).
    pub linger: Duration,
    /// Whether to `LISTEN` for the recording side's `NOTIFY` (default on).
    pub listen: bool,
    /// The duplicate window of a stream the relay creates (default 2 minutes).
    pub duplicate_window: Duration,
    /// The replicas of a stream the relay creates (default 1; 3 on a three-node JetStream
    /// cluster, so the stream survives the loss of a node). An existing stream keeps its own.
    pub stream_replicas: usize,
    /// How often a relay balances partitions with its peers, and a standby tries to take one
    /// (default 1 s).
    pub standby_interval: Duration,
    /// The longest wait between retries after an error (default 5 s; at most a third of the
    /// lease).
    pub max_backoff: Duration,
    /// Failed attempts after which a row JetStream keeps rejecting is parked (default 5).
    pub max_attempts: u32,
    /// How long the relay retries its first connections before giving up (default 30 s).
    pub startup_timeout: Duration,
    /// Warn (and set `outbox_stalled`) when the oldest unpublished row is older (default 30 s).
    pub stall_after: Duration,
    /// How often the backlog figures are refreshed (default 5 s): one relay of the table reads
    /// them for all, a reading at most a tenth of the time (see the README's Metrics).
    pub stats_interval: Duration,
}

/// The database URL is shown without its password.
impl std::fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayConfig")
            .field("database_url", &crate::redact_url(&self.database_url))
            .field("table", &self.table)
            .field("stream", &self.stream)
            .field("subject_prefix", &self.subject_prefix)
            .field("subject_template", &self.subject_template)
            .field("mode", &self.mode)
            .field("lease", &self.lease)
            .field("batch_size", &self.batch_size)
            .field("max_in_flight", &self.max_in_flight)
            .field("poll_interval", &self.poll_interval)
            .field("linger", &self.linger)
            .field("listen", &self.listen)
            .field("duplicate_window", &self.duplicate_window)
            .field("standby_interval", &self.standby_interval)
            .field("max_backoff", &self.max_backoff)
            .field("max_attempts", &self.max_attempts)
            .field("startup_timeout", &self.startup_timeout)
            .field("stall_after", &self.stall_after)
            .field("stats_interval", &self.stats_interval)
            .finish_non_exhaustive()
    }
}

impl RelayConfig {
    /// The defaults, reading the database at `database_url`.
    pub fn new(database_url: impl Into<String>) -> Self {
        RelayConfig {
            database_url: database_url.into(),
            table: OutboxTable::DEFAULT,
            stream: "OUTBOX".into(),
            subject_prefix: "outbox".into(),
            subject_template: SubjectTemplate::default(),
            mode: Mode::default(),
            lease: Duration::from_secs(15),
            batch_size: 500,
            max_in_flight: 512,
            max_batch_bytes: 8 << 20,
            poll_interval: Duration::from_millis(100),
            linger: Duration::from_millis(10),
            listen: true,
            duplicate_window: Duration::from_secs(120),
            stream_replicas: 1,
            standby_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(5),
            max_attempts: 5,
            startup_timeout: Duration::from_secs(30),
            stall_after: Duration::from_secs(30),
            stats_interval: Duration::from_secs(5),
        }
    }

    /// Sets [`RelayConfig::stall_after`].
    pub fn stall_after(mut self, d: Duration) -> Self {
        self.stall_after = d;
        self
    }

    /// Sets [`RelayConfig::stats_interval`].
    pub fn stats_interval(mut self, d: Duration) -> Self {
        self.stats_interval = d;
        self
    }

    /// Sets [`RelayConfig::table`].
    pub fn table(mut self, table: OutboxTable) -> Self {
        self.table = table;
        self
    }

    /// Sets [`RelayConfig::stream`].
    pub fn stream(mut self, stream: impl Into<String>) -> Self {
        self.stream = stream.into();
        self
    }

    /// Sets [`RelayConfig::subject_prefix`].
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.subject_prefix = prefix.into();
        self
    }

    /// Sets [`RelayConfig::subject_template`].
    pub fn subject_template(mut self, template: SubjectTemplate) -> Self {
        self.subject_template = template;
        self
    }

    /// Sets [`RelayConfig::mode`]: an [`Ordered`](crate::Ordered),
    /// [`Unordered`](crate::Unordered) or [`LogTailing`](crate::LogTailing) with its settings.
    pub fn mode(mut self, mode: impl Into<Mode>) -> Self {
        self.mode = mode.into();
        self
    }

    /// Sets [`RelayConfig::lease`], and lowers [`RelayConfig::max_backoff`] to a third of it
    /// when it is longer: a relay backing off sends nothing, and must not outlive its lease.
    pub fn lease(mut self, d: Duration) -> Self {
        self.lease = d;
        self.max_backoff = self.max_backoff.min(d / 3);
        self
    }

    /// Sets [`RelayConfig::max_attempts`].
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Sets [`RelayConfig::batch_size`].
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Sets [`RelayConfig::max_batch_bytes`].
    pub fn max_batch_bytes(mut self, bytes: usize) -> Self {
        self.max_batch_bytes = bytes;
        self
    }

    /// The rows to ask for next: `batch_size`, or fewer when the last rows were large, so
    /// that a query reads about twice the byte budget rather than `batch_size` large payloads
    /// (the budget itself is enforced by the query).
    pub(crate) fn rows_for(&self, average_payload: usize) -> i64 {
        let fit = 2 * self.max_batch_bytes / average_payload.max(1);
        fit.clamp(1, self.batch_size) as i64
    }

    /// Sets [`RelayConfig::poll_interval`].
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// Sets [`RelayConfig::linger`].
    pub fn linger(mut self, d: Duration) -> Self {
        self.linger = d;
        self
    }

    /// Sets [`RelayConfig::stream_replicas`].
    pub fn stream_replicas(mut self, n: usize) -> Self {
        self.stream_replicas = n;
        self
    }

    /// Sets [`RelayConfig::duplicate_window`].
    pub fn duplicate_window(mut self, d: Duration) -> Self {
        self.duplicate_window = d;
        self
    }

    /// Sets [`RelayConfig::listen`].
    pub fn listen(mut self, on: bool) -> Self {
        self.listen = on;
        self
    }

    /// Sets [`RelayConfig::startup_timeout`].
    pub fn startup_timeout(mut self, d: Duration) -> Self {
        self.startup_timeout = d;
        self
    }

    /// Checks the values that have rules; the relay calls it before it starts.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=5).contains(&self.stream_replicas) {
            return Err(format!(
                "--stream-replicas {} is not 1 to 5 (JetStream's range); 3 on a three-node cluster",
                self.stream_replicas
            ));
        }
        match &self.mode {
            Mode::Ordered(o) => {
                let max = outbox_diesel::relay::MAX_PARTITIONS;
                if o.partitions == 0 || o.partitions > max {
                    return Err(format!(
                        "--partitions {} is out of range 1..={max}: each partition is an advisory lock in PostgreSQL's shared lock table",
                        o.partitions
                    ));
                }
                o.cleanup.validate()?;
            }
            Mode::Unordered(u) => {
                if u.workers == 0 || u.workers > 256 {
                    return Err(format!("--workers {} is out of range 1..=256", u.workers));
                }
                u.cleanup.validate()?;
            }
            Mode::LogTailing(t) => {
                outbox_diesel::wal::check_slot_name(&t.slot_name(&self.table))
                    .map_err(|e| format!("--slot: {e}"))?;
                if t.publication_name(&self.table).is_empty() {
                    return Err("--publication must not be empty".into());
                }
                if t.captured_cleanup_interval.is_zero() {
                    return Err("--captured-cleanup-interval must be above 0".into());
                }
            }
        }
        if let Err(e) = outbox_diesel::check_subject_token(&self.subject_prefix) {
            return Err(format!(
                "subject prefix {:?} {e}; use a single token such as `outbox`",
                self.subject_prefix
            ));
        }
        let fixed = self.subject_template.fixed_len(&self.subject_prefix);
        if fixed > crate::publish::subject::MAX_SUBJECT_FIXED_LEN {
            return Err(format!(
                "the subject prefix and the template's literal tokens take {fixed} bytes, over the limit of {}: subjects must stay within the NATS server's control line; use a shorter --subject-prefix",
                crate::publish::subject::MAX_SUBJECT_FIXED_LEN
            ));
        }
        if self.stream.is_empty() || self.stream.contains(['.', '*', '>', ' ', '/', '\\']) {
            return Err(format!(
                "stream name {:?} is not a JetStream stream name (no `.`, `*`, `>`, spaces or slashes)",
                self.stream
            ));
        }
        if self.max_batch_bytes == 0 || self.max_batch_bytes > i64::MAX as usize {
            return Err("--max-batch-bytes must be above 0".into());
        }
        if self.batch_size == 0 || self.max_in_flight == 0 {
            return Err("--batch-size and the in-flight window must be at least 1".into());
        }
        if self.poll_interval.is_zero() {
            return Err("--poll-interval must be above 0".into());
        }
        if self.stats_interval.is_zero() {
            return Err("--stats-interval must be above 0".into());
        }
        let slowest = self
            .poll_interval
            .max(self.max_backoff)
            .max(self.standby_interval);
        if self.lease < slowest * 3 {
            return Err(format!(
                "--lease {:?} must be at least three times the poll interval, the balance interval and the longest backoff ({:?}), or an idle relay would lose its session",
                self.lease, slowest
            ));
        }
        Ok(())
    }
}
