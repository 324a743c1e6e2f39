//! The relay engine: [`Relay::run`] publishes committed outbox rows to JetStream until told to
//! stop.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use diesel_async::AsyncPgConnection;
use outbox_diesel::relay as db;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

pub mod cleanup;
pub(crate) mod config;
pub(crate) mod mode;
mod ordered;
mod peers;
mod stats;
mod tailing;
mod unordered;
mod wake;
mod window;

pub(crate) use crate::backoff::Backoff;
pub use crate::health::Health;
use crate::metrics as m;
use crate::publish::pipeline::BatchEnd;
use crate::publish::reconcile::Reconciler;
use crate::publish::{StreamInfo, ensure_stream};
use crate::{Mode, ModeKind, RelayConfig};
use cleanup::Cleaner;
use ordered::OrderedRelay;
pub(crate) use peers::Peers;
use stats::stats;
use tailing::TailingRelay;
use unordered::UnorderedWorker;
use wake::{idle, sleep_or_notified};

/// Why the relay stopped with an error (it retries everything else).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// A configuration value is out of its rules.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// PostgreSQL could not be reached within the start-up timeout.
    #[error(
        "cannot connect to PostgreSQL within {timeout:?}: {source}; is it running, and is --database-url (DATABASE_URL) right?"
    )]
    Database {
        /// How long it tried.
        timeout: Duration,
        /// The last error.
        #[source]
        source: outbox_diesel::ConnectError,
    },
    /// PostgreSQL refused the connection for a reason retrying cannot fix: the URL does not
    /// parse, the database or the role does not exist, the credentials are refused.
    #[error("cannot connect to PostgreSQL: {}; {}", .0, .0.fix().unwrap_or("check --database-url (DATABASE_URL)"))]
    DatabaseRefused(#[source] outbox_diesel::ConnectError),
    /// A query failed at start-up.
    #[error(
        "PostgreSQL refused the relay's query: {0}; does the relay's role have SELECT, UPDATE and DELETE on the outbox table?"
    )]
    Query(#[source] diesel::result::Error),
    /// The outbox table is missing.
    #[error(
        "the outbox table {0} does not exist (or is not visible to this role); apply outbox-diesel's migrations (outbox_diesel::MIGRATIONS) or create it with outbox_diesel::create_table, or pass --table"
    )]
    TableMissing(String),
    /// The outbox table predates snapshot batches, which the ordered relay reads it by, or the
    /// columns that record their late passes.
    #[error(
        "the outbox table {0} predates snapshot batches or their late passes (it has no `txid` column, no progress table, or no `late_after_seq` column in it); apply outbox-diesel's migrations (outbox_diesel::MIGRATIONS) or run outbox_diesel::create_table, which upgrade it"
    )]
    TableOutdated(String),
    /// The stream could not be found or made, or does not capture the subjects.
    #[error(transparent)]
    Stream(#[from] crate::publish::StreamError),
    /// Log tailing cannot read the table's changes: `wal_level`, rights, the publication or
    /// the slot (the message says what to change).
    #[error(transparent)]
    LogTailing(#[from] outbox_diesel::wal::WalError),
    /// JetStream did not answer within the start-up timeout.
    #[error(
        "NATS JetStream did not answer within {0:?}; is nats-server running with -js, and is --nats-url (NATS_URL) right?"
    )]
    NatsUnavailable(Duration),
}

/// The relay: publishes committed outbox rows to JetStream.
///
/// ```no_run
/// use outbox_nats::{Relay, RelayConfig};
/// use tokio_util::sync::CancellationToken;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let nats = async_nats::connect("127.0.0.1:4222").await?;
/// let relay = Relay::new(RelayConfig::new("postgres://127.0.0.1/app"), nats);
/// let shutdown = CancellationToken::new();
/// let task = tokio::spawn(relay.run(shutdown.clone()));
/// // ... on SIGTERM:
/// shutdown.cancel();
/// task.await??;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Relay {
    config: Arc<RelayConfig>,
    nats: async_nats::Client,
    health: Arc<Health>,
}

impl Relay {
    /// A relay with `config`, publishing through `nats`.
    pub fn new(config: RelayConfig, nats: async_nats::Client) -> Self {
        let health = Health::default();
        let _ = health.nats.set(nats.clone());
        Relay {
            config: Arc::new(config),
            nats,
            health: Arc::new(health),
        }
    }

    /// Its health, shared with the admin listener.
    pub fn health(&self) -> Arc<Health> {
        self.health.clone()
    }

    /// Runs until `shutdown` is cancelled: checks the table and the stream, then publishes.
    ///
    /// On cancellation it stops reading rows, waits for the acks in flight, marks them, and
    /// returns. Errors it can retry (a lost connection, NATS down) it retries with capped
    /// backoff; it returns an error only for what retrying cannot fix.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), RelayError> {
        m::describe();
        let cfg = self.config.clone();
        cfg.validate().map_err(RelayError::Config)?;
        // publishing takes its acks on a subscription of its own (see `publish::pipeline`):
        // the context's ack permits bound nothing the relay sends
        let js = jetstream::new(self.nats.clone());
        let stream = self.startup(&js, &shutdown).await?;
        let Some(stream) = stream else { return Ok(()) };
        if let Mode::LogTailing(tailing) = &cfg.mode {
            self.check_log_tailing(tailing).await?;
        }
        if !stream.created && stream.replicas != cfg.stream_replicas {
            warn!(
                stream = %stream.name,
                replicas = stream.replicas,
                wanted = cfg.stream_replicas,
                "the stream exists with another replica count; --stream-replicas applies to a stream the relay creates"
            );
        }
        // the settings in force for the mode, and no other mode's
        match &cfg.mode {
            Mode::Ordered(o) => info!(
                stream = %stream.name,
                created = stream.created,
                duplicate_window = ?stream.duplicate_window,
                replicas = stream.replicas,
                table = %cfg.table,
                mode = %cfg.mode,
                partitions = o.partitions,
                "outbox relay started"
            ),
            Mode::Unordered(u) => info!(
                stream = %stream.name,
                created = stream.created,
                duplicate_window = ?stream.duplicate_window,
                replicas = stream.replicas,
                table = %cfg.table,
                mode = %cfg.mode,
                workers = u.workers,
                "outbox relay started"
            ),
            Mode::LogTailing(t) => info!(
                stream = %stream.name,
                created = stream.created,
                duplicate_window = ?stream.duplicate_window,
                replicas = stream.replicas,
                table = %cfg.table,
                mode = %cfg.mode,
                slot = %t.slot_name(&cfg.table),
                publication = %t.publication_name(&cfg.table),
                "outbox relay started"
            ),
        }
        let reconciler = Arc::new(Reconciler::new(
            js.clone(),
            &stream.name,
            cfg.subject_template.clone(),
            &cfg.subject_prefix,
            stream.duplicate_window,
        ));
        debug!(check_after = ?reconciler.check_after(), "rows older than this are looked up in the stream before they are sent");
        self.health
            .stuck_after_ms
            .store(cfg.stall_after.as_millis() as u64, Ordering::Relaxed);
        self.health.progressed();
        self.health.started.store(true, Ordering::Relaxed);

        // the relay's own stop: shutdown, or an error that retrying cannot fix
        let shutdown = shutdown.child_token();
        let fatal: Arc<Mutex<Option<outbox_diesel::wal::WalError>>> = Arc::default();
        let mut tasks = JoinSet::new();
        match &cfg.mode {
            Mode::Ordered(mode) => {
                let ordered = OrderedRelay {
                    cfg: cfg.clone(),
                    mode: mode.clone(),
                    js: js.clone(),
                    reconciler: reconciler.clone(),
                    health: self.health.clone(),
                    shutdown: shutdown.clone(),
                };
                tasks.spawn(ordered.run().instrument(info_span!("outbox.ordered")));
            }
            Mode::Unordered(mode) => {
                let question = Arc::new(unordered::Question::default());
                for worker in 0..mode.workers {
                    let unordered = UnorderedWorker {
                        cfg: cfg.clone(),
                        js: js.clone(),
                        reconciler: reconciler.clone(),
                        health: self.health.clone(),
                        shutdown: shutdown.clone(),
                        question: question.clone(),
                    };
                    tasks.spawn(
                        unordered
                            .run()
                            .instrument(info_span!("outbox.worker", outbox.worker = worker)),
                    );
                }
            }
            Mode::LogTailing(mode) => {
                let tailing = TailingRelay {
                    cfg: cfg.clone(),
                    mode: mode.clone(),
                    js: js.clone(),
                    reconciler: reconciler.clone(),
                    health: self.health.clone(),
                    shutdown: shutdown.clone(),
                    fatal: fatal.clone(),
                };
                tasks.spawn(tailing.run().instrument(
                    info_span!("outbox.tailing", outbox.slot = %mode.slot_name(&cfg.table)),
                ));
            }
        }
        // log tailing never marks rows (it deletes captured rows itself)
        if let Some(cleanup) = cfg.mode.cleanup().filter(|c| c.enabled) {
            let cleanup = Cleaner {
                cfg: cfg.clone(),
                cleanup: cleanup.clone(),
                shutdown: shutdown.clone(),
            };
            tasks.spawn(cleanup.run().instrument(info_span!("outbox.cleanup")));
        }
        // log tailing never marks rows: its lag is the slot's, which it reports itself
        if cfg.mode.kind() != ModeKind::LogTailing {
            tasks.spawn(stats(
                cfg.clone(),
                self.health.clone(),
                stream.duplicate_window,
                shutdown.clone(),
            ));
        }
        while let Some(done) = tasks.join_next().await {
            if let Err(e) = done {
                error!(error = %e, "relay task failed");
            }
        }
        if let Some(e) = fatal.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return Err(e.into());
        }
        info!("outbox relay stopped");
        Ok(())
    }

    /// Log tailing's start-up check: `wal_level`, the publication, the relay's record of its
    /// slots (created when missing) and the slot (a missing one that was read before is an
    /// error; the reader makes a new one under its lock), so that what retrying cannot fix stops the relay with a clear error.
    async fn check_log_tailing(&self, tailing: &crate::LogTailing) -> Result<(), RelayError> {
        let cfg = &self.config;
        let mut conn = outbox_diesel::connect(&cfg.database_url)
            .await
            .map_err(|e| match e.can_heal() {
                true => RelayError::Database {
                    timeout: cfg.startup_timeout,
                    source: e,
                },
                false => RelayError::DatabaseRefused(e),
            })?;
        let mut reader = outbox_diesel::wal::WalReader::new(
            cfg.table.clone(),
            tailing.slot_name(&cfg.table),
            tailing.publication_name(&cfg.table),
        )
        .streaming(&cfg.database_url, cfg.poll_interval)?
        .recover(tailing.recover_slot);
        // the replication right first: without it nothing else helps
        reader.check_replication().await?;
        reader.setup(&mut conn).await?;
        Ok(())
    }

    /// Checks the table and the stream, retrying connection failures until the start-up
    /// timeout. `None` when shut down meanwhile.
    async fn startup(
        &self,
        js: &jetstream::Context,
        shutdown: &CancellationToken,
    ) -> Result<Option<StreamInfo>, RelayError> {
        let cfg = &self.config;
        let deadline = tokio::time::Instant::now() + cfg.startup_timeout;
        let mut backoff = Backoff::new(cfg.max_backoff);
        let mut conn = loop {
            match outbox_diesel::connect(&cfg.database_url).await {
                Ok(c) => break c,
                Err(e) if !e.can_heal() => return Err(RelayError::DatabaseRefused(e)),
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(RelayError::Database {
                        timeout: cfg.startup_timeout,
                        source: e,
                    });
                }
                Err(e) => {
                    warn!(error = %e, "PostgreSQL not reachable yet; retrying");
                    if !backoff.sleep(shutdown).await {
                        return Ok(None);
                    }
                }
            }
        };
        // JIT off, as on every session of the relay: the backlog's statement is estimated far
        // above `jit_above_cost`, and compiling it held the start back by most of a second
        db::prepare_side_session(&mut conn)
            .await
            .map_err(RelayError::Query)?;
        if !db::table_exists(&mut conn, &cfg.table)
            .await
            .map_err(RelayError::Query)?
        {
            return Err(RelayError::TableMissing(cfg.table.to_string()));
        }
        // the backlog's statement, planned but not run: it fails where the table or its
        // progress cannot be read, without reading every unpublished row at every start
        db::check_backlog(&mut conn, &cfg.table)
            .await
            .map_err(RelayError::Query)?;
        if cfg.mode.kind() == ModeKind::Ordered {
            if !db::has_progress(&mut conn, &cfg.table)
                .await
                .map_err(RelayError::Query)?
            {
                return Err(RelayError::TableOutdated(cfg.table.to_string()));
            }
        } else {
            // the rows an ordered relay published are marked, so that this mode does not
            // publish them again
            let marked = db::settle_progress(&mut conn, &cfg.table)
                .await
                .map_err(RelayError::Query)?;
            if marked > 0 {
                info!(
                    marked,
                    "rows the ordered relay published are marked published_at"
                );
            }
        }
        drop(conn);
        let mut backoff = Backoff::new(cfg.max_backoff);
        loop {
            let attempt = ensure_stream(
                js,
                &cfg.stream,
                &cfg.subject_prefix,
                &cfg.subject_template,
                cfg.duplicate_window,
                cfg.stream_replicas,
            );
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(remaining.max(Duration::from_millis(1)), attempt).await {
                Ok(Ok(info)) => return Ok(Some(info)),
                Ok(Err(e @ crate::publish::StreamError::SubjectsNotCaptured { .. })) => {
                    return Err(e.into());
                }
                Ok(Err(e)) if tokio::time::Instant::now() < deadline => {
                    warn!(error = %e, "JetStream not available yet; retrying");
                    if !backoff.sleep(shutdown).await {
                        return Ok(None);
                    }
                }
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => return Err(RelayError::NatsUnavailable(cfg.startup_timeout)),
            }
        }
    }
}

/// How a mode's database session ended, for [`reconnecting`].
pub(crate) enum SessionEnd {
    /// It returned (e.g. it stepped down): connect again at once.
    Ended,
    /// It failed (logged by the mode): back off, then connect again.
    Failed,
    /// The relay cannot go on: stop the loop.
    Stop,
}

/// A mode's work on one database connection, run by [`reconnecting`].
pub(crate) trait Session {
    /// Works on `conn` until it fails, steps down or shutdown; logs its own failure.
    fn run_on(
        &self,
        conn: &mut AsyncPgConnection,
        backoff: &mut Backoff,
    ) -> impl std::future::Future<Output = SessionEnd> + Send;
}

/// The one reconnect loop of every mode: connects to PostgreSQL, runs the mode's
/// [`Session`] on the connection, and after a failure backs off and connects again, until
/// shutdown (or the session says stop). A connection that cannot be made, or a session that
/// failed, marks the database down in `health` until the next connection is made.
pub(crate) async fn reconnecting(
    cfg: &RelayConfig,
    health: &Health,
    shutdown: &CancellationToken,
    session: &impl Session,
) {
    let mut backoff = Backoff::new(cfg.max_backoff);
    while !shutdown.is_cancelled() {
        let mut conn = match outbox_diesel::connect(&cfg.database_url).await {
            Ok(c) => c,
            Err(e) => {
                health.database_ok.store(false, Ordering::Relaxed);
                warn!(error = %e, "cannot connect to PostgreSQL; retrying");
                if !backoff.sleep(shutdown).await {
                    break;
                }
                continue;
            }
        };
        health.database_ok.store(true, Ordering::Relaxed);
        match session.run_on(&mut conn, &mut backoff).await {
            SessionEnd::Ended => {}
            SessionEnd::Failed => {
                health.database_ok.store(false, Ordering::Relaxed);
                if !backoff.sleep(shutdown).await {
                    break;
                }
            }
            SessionEnd::Stop => break,
        }
    }
}

/// Records that JetStream acked `seqs`: marks them published, or deletes them with
/// [`Cleanup::delete_published`](crate::Cleanup::delete_published).
pub(crate) async fn retire(
    conn: &mut AsyncPgConnection,
    cfg: &RelayConfig,
    seqs: &[i64],
) -> diesel::QueryResult<usize> {
    if cfg.mode.deletes_published() {
        db::delete_acked(conn, &cfg.table, seqs).await
    } else {
        db::mark_published(conn, &cfg.table, seqs).await
    }
}

/// Acts on how a batch ended: counts and parks a failing row, backs off after a failure.
/// `false` when shut down meanwhile.
pub(crate) async fn settle(
    conn: &mut AsyncPgConnection,
    cfg: &RelayConfig,
    end: BatchEnd,
    backoff: &mut Backoff,
    shutdown: &CancellationToken,
) -> diesel::QueryResult<bool> {
    match end {
        BatchEnd::Done => {
            backoff.reset();
            Ok(true)
        }
        BatchEnd::LeaseUnconfirmed => Ok(true),
        BatchEnd::Fenced => {
            // a newer message on the subject: no fault of the row. The session answers, or
            // this relay lost its work to another; the rows are read again (and looked up in
            // the stream when old enough)
            db::keep_alive(conn).await?;
            Ok(true)
        }
        BatchEnd::Transient => Ok(backoff.sleep(shutdown).await),
        BatchEnd::RowFailed {
            seq,
            attempts,
            error,
            park_now,
        } => {
            let park = park_now || attempts + 1 >= cfg.max_attempts as i32;
            db::record_failure(conn, &cfg.table, seq, &error, park).await?;
            if park {
                metrics::counter!(m::ROWS_PARKED).increment(1);
                error!(outbox.seq = seq, error = %error, "row parked: it holds back the later events of its aggregate (ordered mode) until `outbox-relay retry`");
                Ok(true)
            } else {
                warn!(outbox.seq = seq, attempts = attempts + 1, error = %error, "publish rejected; retrying");
                Ok(backoff.sleep(shutdown).await)
            }
        }
    }
}
