//! Command-line arguments shared by the `outbox-relay` binary and services built on this crate
//! (feature `cli`): the NATS connection flags and the database flags, defined once, with the
//! environment variables every NATS tool and libpq user knows, and the relay's flags
//! ([`RelayArgs`]), so that a service embedding the relay takes the flags `outbox-relay run`
//! takes.
//!
//! ```
//! use clap::Parser;
//! use outbox_nats::cli::NatsArgs;
//!
//! #[derive(Parser)]
//! struct Args {
//!     #[command(flatten)]
//!     nats: NatsArgs,
//! }
//!
//! let args = Args::parse_from(["svc", "--nats-url", "nats://a:4222,nats://b:4222"]);
//! let options = args.nats.options();
//! assert_eq!(options.url, "nats://a:4222,nats://b:4222");
//! ```

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use outbox_diesel::OutboxTable;

use crate::publish::subject::SubjectTemplate;
use crate::{
    Cleanup, LogTailing, Mode, ModeKind, NatsOptions, Ordered, RelayConfig, Unordered, redact_url,
};

/// The NATS connection: `--nats-url` (a seed list too) and the credentials and TLS flags,
/// each with its `NATS_*` environment variable. Its `Debug` shows no secret.
#[derive(Clone, Args)]
#[non_exhaustive]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated.
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    pub nats_url: String,
    /// NATS credentials file (.creds).
    #[arg(long, env = "NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// NATS nkey seed.
    #[arg(long, env = "NATS_NKEY", hide_env_values = true)]
    pub nats_nkey: Option<String>,
    /// NATS user (with --nats-password).
    #[arg(long, env = "NATS_USER")]
    pub nats_user: Option<String>,
    /// NATS password.
    #[arg(long, env = "NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,
    /// NATS token.
    #[arg(long, env = "NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,
    /// Require TLS to NATS.
    #[arg(long, env = "NATS_TLS_REQUIRED")]
    pub nats_tls_required: bool,
    /// CA certificate (PEM) for NATS TLS.
    #[arg(long, env = "NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for NATS TLS.
    #[arg(long, env = "NATS_TLS_CERT", requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,
    /// Client key (PEM) for NATS TLS.
    #[arg(long, env = "NATS_TLS_KEY", requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,
}

impl NatsArgs {
    /// The connection options these flags describe.
    pub fn options(&self) -> NatsOptions {
        let mut nats = NatsOptions::new(self.nats_url.clone());
        nats.credentials_file = self.nats_creds.clone();
        nats.nkey_seed = self.nats_nkey.clone();
        nats.user = self.nats_user.clone();
        nats.password = self.nats_password.clone();
        nats.token = self.nats_token.clone();
        nats.tls_required = self.nats_tls_required;
        nats.tls_ca = self.nats_tls_ca.clone();
        nats.tls_cert = self.nats_tls_cert.clone();
        nats.tls_key = self.nats_tls_key.clone();
        nats
    }
}

/// The database holding the outbox: `--database-url` (`DATABASE_URL`, libpq's URL or
/// `key=value` form) and `--table` (`OUTBOX_TABLE`). Its `Debug` shows no password.
#[derive(Clone, Args)]
#[non_exhaustive]
pub struct DbArgs {
    /// PostgreSQL URL of the database holding the outbox.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// The outbox table, `table` or `schema.table`.
    #[arg(long, env = "OUTBOX_TABLE", default_value = "outbox")]
    pub table: OutboxTable,
}

impl std::fmt::Debug for NatsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // the options' own form, which hides the password, the token and the nkey seed
        self.options().fmt(f)
    }
}

impl std::fmt::Debug for DbArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DbArgs")
            .field("database_url", &redact_url(&self.database_url))
            .field("table", &self.table)
            .finish()
    }
}

/// The relay's flags, as `outbox-relay run` takes them, each with its environment variable;
/// [`RelayArgs::config`] makes the [`RelayConfig`].
#[derive(Debug, Args)]
#[non_exhaustive]
pub struct RelayArgs {
    /// The database and the outbox table.
    #[command(flatten)]
    pub db: DbArgs,
    /// The NATS connection.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// JetStream stream; created (subjects `{prefix}.>`) when missing.
    #[arg(long, env = "OUTBOX_STREAM", default_value = "OUTBOX")]
    pub stream: String,
    /// First subject token; the stream captures `{prefix}.>`.
    #[arg(long, env = "OUTBOX_SUBJECT_PREFIX", default_value = "outbox")]
    pub subject_prefix: String,
    /// Subject of each event, from `{prefix}`, `{aggregate_type}`, `{aggregate_id}`, `{event_type}`.
    #[arg(
        long,
        env = "OUTBOX_SUBJECT_TEMPLATE",
        default_value = "{prefix}.{aggregate_type}.{aggregate_id}"
    )]
    pub subject_template: SubjectTemplate,
    /// How rows are read. The flags of the other modes are not used.
    #[arg(long, env = "OUTBOX_MODE", value_enum, default_value_t = ModeKind::Ordered)]
    pub mode: ModeKind,
    /// Partitions of the table (ordered mode), each published by one relay at a time.
    /// Every relay of a table must run with the same count.
    #[arg(long, env = "OUTBOX_PARTITIONS", default_value_t = 1)]
    pub partitions: u32,
    /// Competing workers in this process (unordered mode).
    #[arg(long, env = "OUTBOX_WORKERS", default_value_t = 4)]
    pub workers: u32,
    /// How long a paused or cut-off relay keeps its partitions before another takes them.
    #[arg(long, env = "OUTBOX_LEASE", default_value = "15s", value_parser = humantime::parse_duration)]
    pub lease: Duration,
    /// Rows read per query.
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = 500)]
    pub batch_size: usize,
    /// Unacked publishes in flight at most.
    #[arg(long, env = "OUTBOX_MAX_IN_FLIGHT", default_value_t = 512)]
    pub max_in_flight: usize,
    /// Payload bytes a batch holds at most. Polling modes: a query stops taking rows once
    /// their payloads reach it (one row is always taken); the relay holds about three batches
    /// (two per unordered worker). Log tailing: the events read and not acked stay within it,
    /// a larger transaction published in parts. Bounds the relay's memory for any payload and
    /// transaction size.
    #[arg(long, env = "OUTBOX_MAX_BATCH_BYTES", default_value_t = 8 << 20)]
    pub max_batch_bytes: usize,
    /// How often an idle relay polls (`250ms`, `5s`).
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "100ms", value_parser = humantime::parse_duration)]
    pub poll_interval: Duration,
    /// After a read that found rows, keep reading every tenth of this long instead of
    /// waiting for a NOTIFY (`0` turns it off): commits that the writers' debounced NOTIFY
    /// did not announce are published within milliseconds. Set it to the writers' debounce
    /// interval (`Notify::Debounced`, 10 ms by default).
    #[arg(long, env = "OUTBOX_LINGER", default_value = "10ms", value_parser = humantime::parse_duration)]
    pub linger: Duration,
    /// Do not LISTEN for the recording side's NOTIFY; poll only.
    #[arg(long, env = "OUTBOX_NO_LISTEN")]
    pub no_listen: bool,
    /// Publish with `Nats-Expected-Last-Subject-Sequence` (ordered and log-tailing modes), so
    /// that JetStream refuses an event that a relay resumed after a pause longer than the
    /// duplicate window would store again after newer ones of its aggregate. Costs throughput
    /// (a look-up per subject new to the relay); see BENCHMARKS.md, section 7.
    #[arg(long, env = "OUTBOX_FENCE")]
    pub fence: bool,
    /// Duplicate window of a stream the relay creates (`2m`).
    #[arg(long, env = "OUTBOX_DUPLICATE_WINDOW", default_value = "2m", value_parser = humantime::parse_duration)]
    pub duplicate_window: Duration,
    /// Replicas of a stream the relay creates (1 to 5; 3 on a three-node JetStream cluster).
    #[arg(long, env = "OUTBOX_STREAM_REPLICAS", default_value_t = 1)]
    pub stream_replicas: usize,
    /// Failed attempts after which a row JetStream keeps rejecting is parked.
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value_t = 5)]
    pub max_attempts: u32,
    /// How long to retry the first connections before exiting.
    #[arg(long, env = "OUTBOX_STARTUP_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub startup_timeout: Duration,
    /// Warn (and set the `outbox_stalled` gauge) when the oldest unpublished row is older
    /// than this.
    #[arg(long, env = "OUTBOX_STALL_AFTER", default_value = "30s", value_parser = humantime::parse_duration)]
    pub stall_after: Duration,
    /// How often the backlog gauges are refreshed from the database: one relay of the table
    /// reads every unpublished row and sends the figures to the others; the first time at a
    /// random point of the first interval, and never more than a tenth of the time.
    #[arg(long, env = "OUTBOX_STATS_INTERVAL", default_value = "5s", value_parser = humantime::parse_duration)]
    pub stats_interval: Duration,
    /// The log-tailing mode's flags.
    #[command(flatten)]
    pub log_tailing: LogTailingArgs,
    /// The cleanup of published rows.
    #[command(flatten)]
    pub cleanup: CleanupArgs,
}

impl RelayArgs {
    /// The relay's configuration from these flags, the chosen mode's own flags in its
    /// [`Mode`]. An error names a flag the mode cannot honour (`--delete-published` with
    /// log tailing); the values themselves are checked by [`RelayConfig::validate`] and
    /// [`Relay::run`](crate::Relay::run).
    pub fn config(&self) -> Result<RelayConfig, String> {
        let mode = match self.mode {
            ModeKind::Ordered => Mode::Ordered(
                Ordered::default()
                    .partitions(self.partitions)
                    .fence(self.fence)
                    .cleanup(self.cleanup.cleanup()),
            ),
            ModeKind::Unordered => Mode::Unordered(
                Unordered::default()
                    .workers(self.workers)
                    .cleanup(self.cleanup.cleanup()),
            ),
            ModeKind::LogTailing => {
                if self.cleanup.delete_published {
                    return Err(
                        "--delete-published is for the polling modes; log tailing never marks rows (record with Outbox::delete_after_insert to keep its table empty)".into(),
                    );
                }
                let t = &self.log_tailing;
                let mut tailing = LogTailing::default()
                    .recover_slot(t.recover_slot)
                    .slot_lag_warn_bytes(t.slot_lag_warn_bytes)
                    .captured_retention(t.captured_retention)
                    .captured_cleanup_interval(t.captured_cleanup_interval)
                    .fence(self.fence);
                tailing.slot = t.slot.clone();
                tailing.publication = t.publication.clone();
                Mode::LogTailing(tailing)
            }
        };
        let mut config = RelayConfig::new(self.db.database_url.clone())
            .table(self.db.table.clone())
            .stream(self.stream.clone())
            .subject_prefix(self.subject_prefix.clone())
            .subject_template(self.subject_template.clone())
            .mode(mode)
            .batch_size(self.batch_size)
            .poll_interval(self.poll_interval)
            .linger(self.linger)
            .duplicate_window(self.duplicate_window)
            .stream_replicas(self.stream_replicas)
            .listen(!self.no_listen)
            .startup_timeout(self.startup_timeout)
            .lease(self.lease);
        config.max_in_flight = self.max_in_flight;
        config.max_batch_bytes = self.max_batch_bytes;
        config.max_attempts = self.max_attempts;
        config.stall_after = self.stall_after;
        config.stats_interval = self.stats_interval;
        Ok(config)
    }
}

/// The log-tailing mode's flags.
#[derive(Debug, Args)]
#[non_exhaustive]
pub struct LogTailingArgs {
    /// Replication slot read in log-tailing mode (default `{table}_slot`); created when missing.
    #[arg(long, env = "OUTBOX_SLOT")]
    pub slot: Option<String>,
    /// Publication read in log-tailing mode (default `{table}_pub`); created when missing.
    #[arg(long, env = "OUTBOX_PUBLICATION")]
    pub publication: Option<String>,
    /// Warn when the slot's unconfirmed WAL exceeds this many bytes (log-tailing mode).
    #[arg(long, env = "OUTBOX_SLOT_LAG_WARN_BYTES", default_value_t = 1 << 30)]
    pub slot_lag_warn_bytes: u64,
    /// When the slot is missing although the relay read it before (dropped, or lost in a
    /// failover), make a new one and publish again every row still in the table and not
    /// parked, instead of stopping (log-tailing mode). Pass it once, after the error said so.
    #[arg(long, env = "OUTBOX_RECOVER_SLOT")]
    pub recover_slot: bool,
    /// How long captured rows stay in the table before deletion (log-tailing mode).
    #[arg(long, env = "OUTBOX_CAPTURED_RETENTION", default_value = "1h", value_parser = humantime::parse_duration)]
    pub captured_retention: Duration,
    /// How often captured rows are deleted (log-tailing mode).
    #[arg(long, env = "OUTBOX_CAPTURED_CLEANUP_INTERVAL", default_value = "1m", value_parser = humantime::parse_duration)]
    pub captured_cleanup_interval: Duration,
}

/// The run flags of cleanup (ordered and unordered modes).
#[derive(Debug, Args)]
#[non_exhaustive]
pub struct CleanupArgs {
    /// Keep published rows this long before deleting them (`0` = at the first cleanup after
    /// their publish).
    #[arg(long, env = "OUTBOX_RETENTION", default_value = "5m", value_parser = humantime::parse_duration)]
    pub retention: Duration,
    /// How often published rows are deleted.
    #[arg(long, env = "OUTBOX_CLEANUP_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub cleanup_interval: Duration,
    /// Rows deleted per statement (one short transaction each).
    #[arg(long, env = "OUTBOX_CLEANUP_BATCH", default_value_t = 5000)]
    pub cleanup_batch: usize,
    /// Do not delete published rows (another relay or a cron job does).
    #[arg(long, env = "OUTBOX_NO_CLEANUP")]
    pub no_cleanup: bool,
    /// Delete each row as soon as JetStream acked it instead of marking it published: no
    /// published history, the least database work per event.
    #[arg(
        long,
        env = "OUTBOX_DELETE_PUBLISHED",
        conflicts_with = "archive_table"
    )]
    pub delete_published: bool,
    /// Move published rows into this table instead of deleting them.
    #[arg(long, env = "OUTBOX_ARCHIVE_TABLE")]
    pub archive_table: Option<OutboxTable>,
}

impl CleanupArgs {
    /// The [`Cleanup`] these flags describe.
    pub fn cleanup(&self) -> Cleanup {
        let mut cleanup = Cleanup::default()
            .enabled(!self.no_cleanup)
            .retention(self.retention)
            .interval(self.cleanup_interval)
            .batch(self.cleanup_batch)
            .delete_published(self.delete_published);
        cleanup.archive_table = self.archive_table.clone();
        cleanup
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        db: DbArgs,
    }

    #[test]
    fn debug_shows_no_secret() {
        let args = Args::parse_from([
            "svc",
            "--nats-url",
            "nats://u:natssecret@a:4222",
            "--nats-token",
            "tokensecret",
            "--nats-password",
            "pwsecret",
            "--database-url",
            "postgres://relay:dbsecret@db/app",
        ]);
        let shown = format!("{:?} {:?}", args.nats, args.db);
        for secret in ["natssecret", "tokensecret", "pwsecret", "dbsecret"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("relay"), "{shown}");
    }

    #[derive(Parser)]
    struct Run {
        #[command(flatten)]
        relay: RelayArgs,
    }

    /// The config of `outbox-relay run --database-url postgres://relay@db/app` and `flags`.
    fn config_of(flags: &[&str]) -> Result<RelayConfig, String> {
        let mut args = vec!["outbox-relay", "--database-url", "postgres://relay@db/app"];
        args.extend_from_slice(flags);
        Run::parse_from(args).relay.config()
    }

    #[test]
    fn relay_flags_make_the_config_they_name() {
        let config = config_of(&[
            "--mode",
            "log-tailing",
            "--partitions",
            "4",
            "--slot",
            "s1",
            "--retention",
            "1h",
            "--no-cleanup",
            "--fence",
            "--max-batch-bytes",
            "1024",
        ])
        .expect("a log-tailing config");
        let Mode::LogTailing(tailing) = &config.mode else {
            panic!("{:?}", config.mode)
        };
        assert_eq!(tailing.slot.as_deref(), Some("s1"));
        assert!(tailing.fence);
        assert_eq!(config.mode.cleanup(), None, "log tailing marks no rows");
        assert_eq!(config.max_batch_bytes, 1024);
        assert_eq!(config.database_url, "postgres://relay@db/app");
        assert_eq!(config.stream, "OUTBOX");

        // the same flags in ordered mode: its own, and the cleanup's
        let config = config_of(&[
            "--partitions",
            "4",
            "--retention",
            "1h",
            "--no-cleanup",
            "--fence",
            "--workers",
            "9",
        ])
        .expect("an ordered config");
        let Mode::Ordered(ordered) = &config.mode else {
            panic!("{:?}", config.mode)
        };
        assert_eq!(ordered.partitions, 4);
        assert!(ordered.fence);
        assert_eq!(
            ordered.cleanup.retention,
            std::time::Duration::from_secs(3600)
        );
        assert!(!ordered.cleanup.enabled);

        let config = config_of(&[
            "--mode",
            "unordered",
            "--workers",
            "9",
            "--delete-published",
            "--fence",
        ])
        .expect("an unordered config");
        let Mode::Unordered(unordered) = &config.mode else {
            panic!("{:?}", config.mode)
        };
        assert_eq!(unordered.workers, 9);
        assert!(unordered.cleanup.delete_published);
        assert!(!config.mode.fence(), "unordered mode has no order to fence");
    }

    #[test]
    fn a_flag_the_mode_cannot_honour_is_refused() {
        let e = config_of(&["--mode", "log-tailing", "--delete-published"]).expect_err("refused");
        assert!(
            e.contains("--delete-published is for the polling modes"),
            "{e}"
        );
    }
}
