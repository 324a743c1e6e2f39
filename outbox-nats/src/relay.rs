//! The relay engine: [`Relay::run`] publishes committed outbox rows to JetStream until told to
//! stop.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use outbox_diesel::relay::{self as db, OutboxRow, Partition};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::RelayConfig;
use crate::metrics as m;
use crate::publish::{StreamInfo, ensure_stream, to_message};

/// Why the relay stopped with an error (it retries everything else).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// A configuration value is out of its rules.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// PostgreSQL could not be reached within the start-up timeout.
    #[error("cannot connect to PostgreSQL within {timeout:?}: {source}; is it running, and is --database-url (DATABASE_URL) right?")]
    Database {
        /// How long it tried.
        timeout: Duration,
        /// The last error.
        #[source]
        source: diesel::ConnectionError,
    },
    /// A query failed at start-up.
    #[error("PostgreSQL refused the relay's query: {0}; does the relay's role have SELECT, UPDATE and DELETE on the outbox table?")]
    Query(#[source] diesel::result::Error),
    /// The outbox table is missing.
    #[error("the outbox table {0} does not exist (or is not visible to this role); apply outbox-diesel's migrations (outbox_diesel::MIGRATIONS) or create it with outbox_diesel::create_table, or pass --table")]
    TableMissing(String),
    /// The stream could not be found or made, or does not capture the subjects.
    #[error(transparent)]
    Stream(#[from] crate::publish::StreamError),
    /// JetStream did not answer within the start-up timeout.
    #[error("NATS JetStream did not answer within {0:?}; is nats-server running with -js, and is --nats-url (NATS_URL) right?")]
    NatsUnavailable(Duration),
}

/// What the relay is doing, for `/healthz` and `/readyz`.
#[derive(Debug, Default)]
pub struct Health {
    started: AtomicBool,
    database_ok: AtomicBool,
    owned: AtomicUsize,
    standby: AtomicUsize,
}

impl Health {
    /// Ready: started, PostgreSQL reachable, and owning a partition or standing by for one.
    pub fn ready(&self) -> bool {
        self.started.load(Ordering::Relaxed)
            && self.database_ok.load(Ordering::Relaxed)
            && (self.owned.load(Ordering::Relaxed) + self.standby.load(Ordering::Relaxed)) > 0
    }

    /// Partitions this relay owns now.
    pub fn owned_partitions(&self) -> usize {
        self.owned.load(Ordering::Relaxed)
    }
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
        Relay { config: Arc::new(config), nats, health: Arc::default() }
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
        let js = jetstream::new(self.nats.clone());
        let stream = self.startup(&js, &shutdown).await?;
        let Some(stream) = stream else { return Ok(()) };
        info!(
            stream = %stream.name,
            created = stream.created,
            duplicate_window = ?stream.duplicate_window,
            table = %cfg.table,
            mode = %cfg.mode,
            partitions = cfg.partitions,
            "outbox relay started"
        );
        self.health.started.store(true, Ordering::Relaxed);

        let mut tasks = JoinSet::new();
        for index in 0..cfg.partitions {
            let worker = Worker {
                cfg: cfg.clone(),
                js: js.clone(),
                health: self.health.clone(),
                partition: Partition { index, count: cfg.partitions },
                shutdown: shutdown.clone(),
            };
            tasks.spawn(
                worker.run().instrument(info_span!("outbox.partition", outbox.partition = index)),
            );
        }
        tasks.spawn(stats(cfg.clone(), self.health.clone(), stream.duplicate_window, shutdown.clone()));
        while let Some(done) = tasks.join_next().await {
            if let Err(e) = done {
                error!(error = %e, "relay task failed");
            }
        }
        info!("outbox relay stopped");
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
            match AsyncPgConnection::establish(&cfg.database_url).await {
                Ok(c) => break c,
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(RelayError::Database { timeout: cfg.startup_timeout, source: e });
                }
                Err(e) => {
                    warn!(error = %e, "PostgreSQL not reachable yet; retrying");
                    if !backoff.sleep(shutdown).await {
                        return Ok(None);
                    }
                }
            }
        };
        if !db::table_exists(&mut conn, &cfg.table).await.map_err(RelayError::Query)? {
            return Err(RelayError::TableMissing(cfg.table.to_string()));
        }
        db::backlog(&mut conn, &cfg.table).await.map_err(RelayError::Query)?;
        drop(conn);
        let mut backoff = Backoff::new(cfg.max_backoff);
        loop {
            let attempt = ensure_stream(
                js,
                &cfg.stream,
                &cfg.subject_prefix,
                &cfg.subject_template,
                cfg.duplicate_window,
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

/// Capped exponential backoff: 50 ms, 100 ms, … up to the cap.
#[derive(Debug)]
struct Backoff {
    next: Duration,
    cap: Duration,
}

impl Backoff {
    fn new(cap: Duration) -> Self {
        Backoff { next: Duration::from_millis(50), cap }
    }

    fn reset(&mut self) {
        self.next = Duration::from_millis(50);
    }

    /// Sleeps for the next delay; `false` when shut down meanwhile.
    async fn sleep(&mut self, shutdown: &CancellationToken) -> bool {
        let d = self.next;
        self.next = (self.next * 2).min(self.cap);
        tokio::select! {
            _ = tokio::time::sleep(d) => true,
            _ = shutdown.cancelled() => false,
        }
    }
}

/// One partition: takes its lease, then publishes its rows while it holds it.
struct Worker {
    cfg: Arc<RelayConfig>,
    js: jetstream::Context,
    health: Arc<Health>,
    partition: Partition,
    shutdown: CancellationToken,
}

/// How a batch ended.
enum BatchEnd {
    /// Every row sent was acked (or shutdown stopped it).
    Done,
    /// NATS failed in a way a retry may fix: back off.
    Transient,
    /// A row failed in a way that is about the row: count it, maybe park it, back off.
    RowFailed { seq: i64, attempts: i32, error: String, park_now: bool },
}

impl Worker {
    async fn run(self) {
        let mut backoff = Backoff::new(self.cfg.max_backoff);
        let mut standby = false;
        while !self.shutdown.is_cancelled() {
            let mut conn = match AsyncPgConnection::establish(&self.cfg.database_url).await {
                Ok(c) => c,
                Err(e) => {
                    self.health.database_ok.store(false, Ordering::Relaxed);
                    warn!(error = %e, "cannot connect to PostgreSQL; retrying");
                    if !backoff.sleep(&self.shutdown).await {
                        break;
                    }
                    continue;
                }
            };
            self.health.database_ok.store(true, Ordering::Relaxed);
            match self.own(&mut conn, &mut standby, &mut backoff).await {
                Ok(()) => {}
                Err(e) => {
                    warn!(error = %e, "database error; reconnecting");
                    if !backoff.sleep(&self.shutdown).await {
                        break;
                    }
                }
            }
        }
        if standby {
            self.health.standby.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Waits for the lease on `conn`, then publishes until shutdown or a database error.
    async fn own(
        &self,
        conn: &mut AsyncPgConnection,
        standby: &mut bool,
        backoff: &mut Backoff,
    ) -> diesel::QueryResult<()> {
        let (table, partition) = (&self.cfg.table, self.partition);
        loop {
            if db::try_lock_partition(conn, table, partition).await? {
                break;
            }
            if !*standby {
                *standby = true;
                self.health.standby.fetch_add(1, Ordering::Relaxed);
                info!("partition owned by another relay; standing by");
            }
            tokio::select! {
                _ = tokio::time::sleep(self.cfg.standby_interval) => {}
                _ = self.shutdown.cancelled() => return Ok(()),
            }
        }
        if *standby {
            *standby = false;
            self.health.standby.fetch_sub(1, Ordering::Relaxed);
        }
        self.health.owned.fetch_add(1, Ordering::Relaxed);
        metrics::gauge!(m::PARTITIONS_OWNED).increment(1.0);
        info!("partition acquired; publishing");
        let result = self.publish_loop(conn, backoff).await;
        self.health.owned.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!(m::PARTITIONS_OWNED).decrement(1.0);
        if result.is_ok() {
            // a clean stop: hand the partition over at once
            let _ = db::unlock_partition(conn, table, partition).await;
            info!("partition released");
        }
        result
    }

    async fn publish_loop(
        &self,
        conn: &mut AsyncPgConnection,
        backoff: &mut Backoff,
    ) -> diesel::QueryResult<()> {
        let table = &self.cfg.table;
        if self.cfg.listen {
            conn.batch_execute(&format!("LISTEN {}", quote_ident(&table.channel()))).await?;
        }
        while !self.shutdown.is_cancelled() {
            let rows =
                db::fetch_unpublished(conn, table, self.partition, self.cfg.batch_size as i64)
                    .await?;
            if rows.is_empty() {
                self.idle(conn).await;
                continue;
            }
            let span = info_span!("outbox.batch", batch.len = rows.len());
            let (acked, end) = self.publish_batch(&rows).instrument(span.clone()).await;
            let marked = db::mark_published(conn, table, &acked).instrument(span).await?;
            debug!(acked = acked.len(), marked, "batch marked");
            match end {
                BatchEnd::Done => backoff.reset(),
                BatchEnd::Transient => {
                    if !backoff.sleep(&self.shutdown).await {
                        break;
                    }
                }
                BatchEnd::RowFailed { seq, attempts, error, park_now } => {
                    let park = park_now || attempts + 1 >= self.cfg.max_attempts as i32;
                    db::record_failure(conn, table, seq, &error, park).await?;
                    if park {
                        metrics::counter!(m::ROWS_PARKED).increment(1);
                        error!(outbox.seq = seq, error = %error, "row parked: it holds back its aggregate until retried; see `outbox-relay parked`");
                    } else {
                        warn!(outbox.seq = seq, attempts = attempts + 1, error = %error, "publish rejected; retrying");
                        if !backoff.sleep(&self.shutdown).await {
                            break;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Waits for a `NOTIFY`, the poll interval, or shutdown.
    async fn idle(&self, conn: &mut AsyncPgConnection) {
        let sleep = tokio::time::sleep(self.cfg.poll_interval);
        if self.cfg.listen {
            let mut notes = std::pin::pin!(conn.notifications_stream());
            tokio::select! {
                _ = sleep => {}
                _ = notes.next() => {}
                _ = self.shutdown.cancelled() => {}
            }
        } else {
            tokio::select! {
                _ = sleep => {}
                _ = self.shutdown.cancelled() => {}
            }
        }
    }

    /// Publishes `rows` in order, pipelined, never two unacked messages of one aggregate at
    /// once; stops sending at the first failure. Returns the acked rows' `seq`.
    async fn publish_batch(&self, rows: &[OutboxRow]) -> (Vec<i64>, BatchEnd) {
        metrics::histogram!(m::BATCH_ROWS).record(rows.len() as f64);
        let cfg = &self.cfg;
        let mut acked = Vec::with_capacity(rows.len());
        let mut in_flight = FuturesOrdered::new();
        let mut in_flight_aggregates: HashSet<(&str, &str)> = HashSet::new();
        let mut end = BatchEnd::Done;
        'rows: for (i, row) in rows.iter().enumerate() {
            if self.shutdown.is_cancelled() {
                break;
            }
            let key = (row.aggregate_type.as_str(), row.aggregate_id.as_str());
            // wait for the previous message of this aggregate, and for room in the window
            while in_flight_aggregates.contains(&key) || in_flight.len() >= cfg.max_in_flight {
                let Some((j, result)) = in_flight.next().await else { break };
                let done: &OutboxRow = &rows[j];
                in_flight_aggregates.remove(&(done.aggregate_type.as_str(), done.aggregate_id.as_str()));
                if let Some(failure) = self.on_ack(done, result, &mut acked) {
                    end = failure;
                    break 'rows;
                }
            }
            let msg = match to_message(row, &cfg.subject_template, &cfg.subject_prefix) {
                Ok(m) => m,
                Err(e) => {
                    metrics::counter!(m::PUBLISH_ERRORS, "kind" => "invalid_row").increment(1);
                    end = BatchEnd::RowFailed { seq: row.seq, attempts: row.attempts, error: e.to_string(), park_now: true };
                    break;
                }
            };
            let publish = jetstream::message::PublishMessage::build()
                .payload(msg.payload)
                .headers(msg.headers);
            match self.js.send_publish(msg.subject, publish).await {
                Ok(ack) => {
                    in_flight_aggregates.insert(key);
                    in_flight.push_back(async move { (i, ack.await) });
                }
                Err(e) => {
                    end = self.classify(row, &e);
                    break;
                }
            }
        }
        while let Some((j, result)) = in_flight.next().await {
            if let Some(failure) = self.on_ack(&rows[j], result, &mut acked)
                && matches!(end, BatchEnd::Done)
            {
                end = failure;
            }
        }
        (acked, end)
    }

    fn on_ack(
        &self,
        row: &OutboxRow,
        result: Result<jetstream::publish::PublishAck, jetstream::context::PublishError>,
        acked: &mut Vec<i64>,
    ) -> Option<BatchEnd> {
        match result {
            Ok(ack) => {
                acked.push(row.seq);
                metrics::counter!(m::EVENTS_PUBLISHED).increment(1);
                if ack.duplicate {
                    metrics::counter!(m::DUPLICATES).increment(1);
                }
                let latency = (chrono::Utc::now() - row.created_at).to_std().unwrap_or_default();
                metrics::histogram!(m::COMMIT_TO_ACK).record(latency.as_secs_f64());
                None
            }
            Err(e) => Some(self.classify(row, &e)),
        }
    }

    fn classify(&self, row: &OutboxRow, e: &jetstream::context::PublishError) -> BatchEnd {
        let api_error = std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<jetstream::Error>())
            .is_some();
        let (kind, permanent) = match e.kind() {
            PublishErrorKind::MaxPayloadExceeded => ("max_payload", true),
            PublishErrorKind::Other if api_error => ("rejected", true),
            PublishErrorKind::TimedOut => ("timeout", false),
            PublishErrorKind::StreamNotFound => ("no_stream", false),
            PublishErrorKind::BrokenPipe => ("broken_pipe", false),
            _ => ("other", false),
        };
        metrics::counter!(m::PUBLISH_ERRORS, "kind" => kind).increment(1);
        if permanent {
            BatchEnd::RowFailed {
                seq: row.seq,
                attempts: row.attempts,
                error: e.to_string(),
                park_now: matches!(e.kind(), PublishErrorKind::MaxPayloadExceeded),
            }
        } else {
            warn!(outbox.seq = row.seq, error = %e, kind, "publish failed; the batch stops here and is retried");
            BatchEnd::Transient
        }
    }
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Refreshes the backlog gauges and warns on a stall or a backlog older than the stream's
/// duplicate window.
async fn stats(
    cfg: Arc<RelayConfig>,
    health: Arc<Health>,
    duplicate_window: Duration,
    shutdown: CancellationToken,
) {
    let mut conn: Option<AsyncPgConnection> = None;
    let mut tick = tokio::time::interval(cfg.stats_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        if conn.is_none() {
            conn = AsyncPgConnection::establish(&cfg.database_url).await.ok();
        }
        let Some(c) = conn.as_mut() else { continue };
        match db::backlog(c, &cfg.table).await {
            Ok(b) => {
                metrics::gauge!(m::BACKLOG_ROWS).set(b.unpublished as f64);
                metrics::gauge!(m::OLDEST_AGE).set(b.oldest_age_seconds);
                metrics::gauge!(m::PARKED_ROWS).set(b.parked as f64);
                let stalled = b.oldest_age_seconds > cfg.stall_after.as_secs_f64();
                metrics::gauge!(m::STALLED).set(if stalled { 1.0 } else { 0.0 });
                if stalled && health.owned_partitions() > 0 {
                    warn!(oldest_age_seconds = b.oldest_age_seconds, backlog = b.unpublished, "outbox backlog is stalled: its oldest row waits longer than --stall-after");
                }
                let beyond = b.oldest_age_seconds > duplicate_window.as_secs_f64();
                metrics::gauge!(m::BEYOND_DUPLICATE_WINDOW).set(if beyond { 1.0 } else { 0.0 });
                if beyond {
                    warn!(oldest_age_seconds = b.oldest_age_seconds, duplicate_window = ?duplicate_window, "the oldest unpublished row is older than the stream's duplicate window: a re-publish of it would not be deduplicated by JetStream, only by consumers");
                }
            }
            Err(e) => {
                debug!(error = %e, "backlog query failed");
                conn = None;
            }
        }
    }
}
