//! The run loop: fetch, decode, run the handler in a transaction with the inbox entry, ack.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use diesel_async::{AsyncConnection, AsyncPgConnection, TransactionManager};
use futures_util::{FutureExt, StreamExt};
use outbox_diesel::OutboxEvent;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::backoff::Backoff;

use super::*;

/// Why [`Consumer::run`] stopped with an error (it retries everything else).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// A configuration value is out of its rules.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
    /// PostgreSQL could not be reached within the start-up timeout.
    #[error(
        "cannot connect to PostgreSQL within {timeout:?}: {source}; is it running, and is the consumer's database URL right?"
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
    #[error("cannot connect to PostgreSQL: {}; {}", .0, .0.fix().unwrap_or("check the consumer's database URL"))]
    DatabaseRefused(#[source] outbox_diesel::ConnectError),
    /// A query failed at start-up.
    #[error("PostgreSQL refused the consumer's start-up query")]
    Query(#[source] diesel::result::Error),
    /// The inbox table is missing.
    #[error(
        "the inbox table {0} does not exist (or is not visible to this role); apply outbox-diesel's migrations (outbox_diesel::MIGRATIONS) or create it with Inbox::create_table"
    )]
    InboxMissing(String),
    /// The durable consumer could not be created or updated within the start-up timeout.
    #[error(
        "cannot create or update the JetStream consumer {durable} on stream {stream} within {timeout:?}; is nats-server running with -js, and does the stream exist (the relay creates it)?"
    )]
    JetStream {
        /// The stream.
        stream: String,
        /// The durable name.
        durable: String,
        /// How long it tried.
        timeout: Duration,
        /// The last error.
        #[source]
        source: async_nats::Error,
    },
}

/// What [`Consumer::process`] did with a message.
#[derive(Debug)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its transaction committed.
    Handled,
    /// The inbox already had the message id: the handler did not run.
    Duplicate,
    /// The event type is not one of `E`'s and [`ConsumerConfig::skip_unknown_event_types`] is
    /// on: the handler did not run.
    Skipped,
    /// The handler returned this error; its transaction rolled back.
    HandlerFailed(String),
    /// The database failed; the transaction rolled back (or never began).
    DatabaseFailed(diesel::result::Error),
    /// The message cannot be decoded.
    Undecodable(DecodeError),
}

impl Outcome {
    /// Its `outcome` label in [`MESSAGES`].
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Handled => "handled",
            Outcome::Duplicate => "duplicate",
            Outcome::Skipped => "skipped",
            Outcome::HandlerFailed(_) => "handler_error",
            Outcome::DatabaseFailed(_) => "database_error",
            Outcome::Undecodable(_) => "undecodable",
        }
    }
}

/// A processed message: what happened, and the answer [`Consumer::settle`] sends JetStream.
#[derive(Debug)]
pub struct Processed {
    outcome: Outcome,
    ack: AckKind,
    delivered: u64,
}

impl Processed {
    /// What happened.
    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    /// The answer for JetStream: `Ack`, `Nak(Some(delay))` or `Term`.
    pub fn ack_kind(&self) -> AckKind {
        self.ack
    }

    /// Which delivery of the message this was.
    pub fn delivered(&self) -> u64 {
        self.delivered
    }
}

/// A handler: an async closure `async |conn: &mut AsyncPgConnection, msg: Delivery<E>| -> Result<(), Er>`
/// whose future is `Send`.
///
/// Implemented for every such closure; you never implement it. The consumer clones the
/// closure for each message (it is called once per message, inside a transaction), so capture
/// what is cheap to clone: references, `Arc`s, channel senders.
pub trait HandlerFn<C, D, R>:
    AsyncFnOnce(C, D) -> R + FnOnce(C, D) -> <Self as HandlerFn<C, D, R>>::Fut
{
    /// The closure's future.
    type Fut: Future<Output = R>;
}

impl<F, C, D, R, Fut> HandlerFn<C, D, R> for F
where
    F: AsyncFnOnce(C, D) -> R + FnOnce(C, D) -> Fut,
    Fut: Future<Output = R>,
{
    type Fut = Fut;
}

/// A transaction's error: the handler's, or the database's.
enum TxError<Er> {
    Handler(Er),
    Database(diesel::result::Error),
}

impl<Er> From<diesel::result::Error> for TxError<Er> {
    fn from(e: diesel::result::Error) -> Self {
        TxError::Database(e)
    }
}

/// A durable JetStream pull consumer that applies each outbox event once; see the
/// [module documentation](super).
#[derive(Debug, Clone)]
pub struct Consumer {
    config: Arc<ConsumerConfig>,
    js: jetstream::Context,
}

impl Consumer {
    /// A consumer with `config`, reading through `nats`.
    pub fn new(config: ConsumerConfig, nats: async_nats::Client) -> Self {
        Consumer {
            config: Arc::new(config),
            js: jetstream::new(nats),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &ConsumerConfig {
        &self.config
    }

    /// Creates the durable consumer, or updates it to this configuration, and returns it.
    ///
    /// [`Consumer::run`] calls it; call it yourself to drive [`Consumer::process`] and
    /// [`Consumer::settle`] from a loop of your own.
    pub async fn pull_consumer(&self) -> Result<PullConsumer, async_nats::Error> {
        let stream = self.js.get_stream(&self.config.stream).await?;
        Ok(stream.create_consumer(self.config.pull_config()).await?)
    }

    /// Runs until `shutdown` is cancelled: connects, creates or updates the durable consumer,
    /// then handles messages one at a time with `handler` (see the
    /// [module documentation](super)).
    ///
    /// `handler` is an async closure taking the connection (inside the message's transaction)
    /// and the [`Delivery`]; it is cloned for each message, so capture references or `Arc`s.
    /// Its error type only needs `Display`: the error is logged and the message retried.
    ///
    /// It retries what retrying can fix (PostgreSQL or NATS down, a handler error), and
    /// returns an error only for a bad configuration, a missing inbox table, or servers it
    /// cannot reach within [`ConsumerConfig::startup_timeout`].
    pub async fn run<E, F, Er>(
        self,
        shutdown: CancellationToken,
        handler: F,
    ) -> Result<(), ConsumerError>
    where
        E: DeserializeOwned + OutboxEvent + Send,
        F: Clone + Send + Sync,
        for<'c> F: AsyncFnOnce(&'c mut AsyncPgConnection, Delivery<E>) -> Result<(), Er>
            + HandlerFn<&'c mut AsyncPgConnection, Delivery<E>, Result<(), Er>, Fut: Send>,
        Er: fmt::Display + Send,
    {
        describe_metrics();
        let cfg = self.config.clone();
        cfg.validate().map_err(ConsumerError::Config)?;
        let Some((conn, mut pull)) = self.startup(&shutdown).await? else {
            return Ok(());
        };
        info!(
            consumer = %cfg.durable_name,
            stream = %cfg.stream,
            filter_subject = cfg.filter_subject.as_deref().unwrap_or(""),
            inbox = %cfg.inbox.table(),
            "outbox consumer started"
        );
        let mut conn = Some(conn);
        let mut backoff = Backoff::starting(cfg.retry_delay, cfg.max_retry_delay);
        'fetch: while !shutdown.is_cancelled() {
            if conn.is_none() {
                match outbox_diesel::connect(&cfg.database_url).await {
                    Ok(c) => {
                        info!(consumer = %cfg.durable_name, "reconnected to PostgreSQL");
                        conn = Some(c);
                    }
                    Err(e) => {
                        warn!(consumer = %cfg.durable_name, error = %e, "cannot connect to PostgreSQL; retrying");
                        if !backoff.sleep(&shutdown).await {
                            break;
                        }
                        continue;
                    }
                }
            }
            let request = pull
                .batch()
                .max_messages(cfg.batch_size)
                .expires(cfg.fetch_wait)
                .messages();
            let mut batch = tokio::select! {
                batch = request => match batch {
                    Ok(b) => b,
                    Err(e) => {
                        warn!(consumer = %cfg.durable_name, error = %e, "pull request failed; retrying");
                        if !backoff.sleep(&shutdown).await {
                            break;
                        }
                        // the durable may have been deleted: make it again
                        if let Ok(p) = self.pull_consumer().await {
                            pull = p;
                        }
                        continue;
                    }
                },
                _ = shutdown.cancelled() => break,
            };
            loop {
                let next = tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => {
                        release(&mut batch).await;
                        break 'fetch;
                    }
                    next = batch.next() => next,
                };
                let msg = match next {
                    None => break,
                    Some(Ok(msg)) => msg,
                    Some(Err(e)) => {
                        warn!(consumer = %cfg.durable_name, error = %e, "pull request ended with an error");
                        if !backoff.sleep(&shutdown).await {
                            break 'fetch;
                        }
                        break;
                    }
                };
                let Some(c) = conn.as_mut() else { break };
                let processed = self.process(c, &msg, &handler).await;
                let lost_connection = matches!(processed.outcome, Outcome::DatabaseFailed(_))
                    || <AsyncPgConnection as AsyncConnection>::TransactionManager::is_broken_transaction_manager(c);
                // settle even when shutdown came meanwhile: the message in hand is finished
                let _ = self.settle(&msg, &processed).await;
                match processed.outcome {
                    Outcome::DatabaseFailed(_) | Outcome::HandlerFailed(_) => {}
                    _ => backoff.reset(),
                }
                if lost_connection {
                    conn = None;
                    release(&mut batch).await;
                    if !backoff.sleep(&shutdown).await {
                        break 'fetch;
                    }
                    break;
                }
            }
        }
        // the last answers must leave before the caller drops the client
        match tokio::time::timeout(Duration::from_secs(5), self.js.client().flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(consumer = %cfg.durable_name, error = %e, "cannot flush the last acks; their messages will come again");
            }
            Err(_) => {
                warn!(consumer = %cfg.durable_name, "flushing the last acks timed out; their messages may come again");
            }
        }
        info!(consumer = %cfg.durable_name, "outbox consumer stopped");
        Ok(())
    }

    /// Connects to PostgreSQL, checks the inbox, and creates the durable consumer, retrying
    /// until the start-up timeout. `None` when shut down meanwhile.
    async fn startup(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<Option<(AsyncPgConnection, PullConsumer)>, ConsumerError> {
        let cfg = &self.config;
        let deadline = Instant::now() + cfg.startup_timeout;
        let mut backoff = Backoff::starting(
            Duration::from_millis(50),
            cfg.max_retry_delay.min(Duration::from_secs(5)),
        );
        let mut conn = loop {
            match outbox_diesel::connect(&cfg.database_url).await {
                Ok(c) => break c,
                Err(e) if !e.can_heal() => return Err(ConsumerError::DatabaseRefused(e)),
                Err(e) if Instant::now() >= deadline => {
                    return Err(ConsumerError::Database {
                        timeout: cfg.startup_timeout,
                        source: e,
                    });
                }
                Err(e) => {
                    warn!(consumer = %cfg.durable_name, error = %e, "PostgreSQL not reachable yet; retrying");
                    if !backoff.sleep(shutdown).await {
                        return Ok(None);
                    }
                }
            }
        };
        let inbox = cfg.inbox.table();
        if !outbox_diesel::relay::table_exists(&mut conn, inbox)
            .await
            .map_err(ConsumerError::Query)?
        {
            return Err(ConsumerError::InboxMissing(inbox.to_string()));
        }
        backoff.reset();
        loop {
            let remaining = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(100));
            let attempt = match tokio::time::timeout(remaining, self.pull_consumer()).await {
                Ok(result) => result,
                Err(elapsed) => Err(elapsed.into()),
            };
            match attempt {
                Ok(pull) => return Ok(Some((conn, pull))),
                Err(e) if Instant::now() >= deadline => {
                    return Err(ConsumerError::JetStream {
                        stream: cfg.stream.clone(),
                        durable: cfg.durable_name.clone(),
                        timeout: cfg.startup_timeout,
                        source: e,
                    });
                }
                Err(e) => {
                    warn!(consumer = %cfg.durable_name, stream = %cfg.stream, error = %e, "JetStream consumer not available yet; retrying");
                    if !backoff.sleep(shutdown).await {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// Processes one message without answering JetStream: decodes it, then runs the inbox
    /// check and `handler` in one transaction on `conn`. Send the answer with
    /// [`Consumer::settle`] (after this returns, never before: the ack must follow the commit).
    ///
    /// While the transaction runs longer than half of `ack_wait`, it tells JetStream the
    /// message is in progress.
    pub async fn process<E, F, Er>(
        &self,
        conn: &mut AsyncPgConnection,
        message: &jetstream::Message,
        handler: &F,
    ) -> Processed
    where
        E: DeserializeOwned + OutboxEvent + Send,
        F: Clone + Send + Sync,
        for<'c> F: AsyncFnOnce(&'c mut AsyncPgConnection, Delivery<E>) -> Result<(), Er>
            + HandlerFn<&'c mut AsyncPgConnection, Delivery<E>, Result<(), Er>, Fut: Send>,
        Er: fmt::Display + Send,
    {
        let cfg = &*self.config;
        let delivered = message
            .info()
            .map(|i| i.delivered.max(1) as u64)
            .unwrap_or(1);
        let span = info_span!(
            "outbox.consume",
            consumer = %cfg.durable_name,
            message.id = tracing::field::Empty,
            stream.seq = tracing::field::Empty,
            event_type = tracing::field::Empty,
            delivered,
        );
        let outcome = async {
            let delivery = match Delivery::<E>::decode(message) {
                Ok(d) => d,
                Err(DecodeError::UnknownEventType { .. }) if cfg.skip_unknown_event_types => {
                    return Outcome::Skipped;
                }
                Err(e) => return Outcome::Undecodable(e),
            };
            let span = tracing::Span::current();
            span.record("message.id", delivery.message_id.as_str());
            span.record("stream.seq", delivery.stream_sequence);
            span.record("event_type", delivery.event_type.as_str());
            let started = Instant::now();
            let outcome = self
                .transaction(conn, message, delivery, handler.clone())
                .await;
            metrics::histogram!(HANDLE_SECONDS, "consumer" => cfg.durable_name.clone())
                .record(started.elapsed().as_secs_f64());
            outcome
        }
        .instrument(span.clone())
        .await;
        let ack = match &outcome {
            Outcome::Handled | Outcome::Duplicate | Outcome::Skipped => AckKind::Ack,
            Outcome::Undecodable(_) if delivered >= u64::from(cfg.undecodable_after) => {
                AckKind::Term
            }
            Outcome::HandlerFailed(_) | Outcome::DatabaseFailed(_) | Outcome::Undecodable(_) => {
                AckKind::Nak(Some(cfg.retry_delay_for(delivered)))
            }
        };
        let _entered = span.enter();
        let label = if matches!(ack, AckKind::Term) {
            "terminated"
        } else {
            outcome.label()
        };
        metrics::counter!(MESSAGES, "consumer" => cfg.durable_name.clone(), "outcome" => label)
            .increment(1);
        match &outcome {
            Outcome::Handled => debug!("handled"),
            Outcome::Duplicate => debug!("already processed; skipped"),
            Outcome::Skipped => debug!("event type not handled by this consumer; skipped"),
            Outcome::HandlerFailed(e) => {
                warn!(error = %e, retry_in = ?cfg.retry_delay_for(delivered), "handler failed; rolled back, will retry");
            }
            Outcome::DatabaseFailed(e) => {
                warn!(error = %e, retry_in = ?cfg.retry_delay_for(delivered), "database failed; rolled back, will retry");
            }
            Outcome::Undecodable(e) if matches!(ack, AckKind::Term) => {
                let seq = message
                    .info()
                    .map(|i| i.stream_sequence)
                    .unwrap_or_default();
                error!(
                    error = %chain(e),
                    stream = %cfg.stream,
                    stream.seq = seq,
                    subject = %message.subject,
                    "undecodable message terminated: JetStream will not deliver it again; it stays in the stream at this sequence"
                );
            }
            Outcome::Undecodable(e) => {
                warn!(error = %chain(e), "undecodable message; will retry before terminating it");
            }
        }
        Processed {
            outcome,
            ack,
            delivered,
        }
    }

    /// The inbox check and the handler, in one transaction; progress acks while it runs long.
    async fn transaction<E, F, Er>(
        &self,
        conn: &mut AsyncPgConnection,
        message: &jetstream::Message,
        delivery: Delivery<E>,
        handler: F,
    ) -> Outcome
    where
        E: Send,
        F: Send,
        for<'c> F: AsyncFnOnce(&'c mut AsyncPgConnection, Delivery<E>) -> Result<(), Er>
            + HandlerFn<&'c mut AsyncPgConnection, Delivery<E>, Result<(), Er>, Fut: Send>,
        Er: fmt::Display + Send,
    {
        let cfg = &*self.config;
        let (inbox, consumer) = (&cfg.inbox, cfg.durable_name.as_str());
        let message_id = delivery.message_id.clone();
        let work = conn.transaction(async move |conn| {
            if !inbox
                .mark_processed_async(conn, consumer, &message_id)
                .await?
            {
                return Ok(false);
            }
            handler(conn, delivery).await.map_err(TxError::Handler)?;
            Ok::<_, TxError<Er>>(true)
        });
        let mut work = std::pin::pin!(work);
        let mut progress = tokio::time::interval(cfg.ack_wait / 2);
        progress.tick().await;
        let result = loop {
            tokio::select! {
                result = &mut work => break result,
                _ = progress.tick() => {
                    if let Err(e) = message.ack_with(AckKind::Progress).await {
                        debug!(error = %e, "cannot send an in-progress ack");
                    }
                }
            }
        };
        match result {
            Ok(true) => Outcome::Handled,
            Ok(false) => Outcome::Duplicate,
            Err(TxError::Handler(e)) => Outcome::HandlerFailed(e.to_string()),
            Err(TxError::Database(e)) => Outcome::DatabaseFailed(e),
        }
    }

    /// Sends JetStream the answer [`Consumer::process`] decided: ack, nak with a delay, or
    /// term. A lost answer is harmless: JetStream delivers the message again after `ack_wait`
    /// and the inbox recognises it.
    pub async fn settle(
        &self,
        message: &jetstream::Message,
        processed: &Processed,
    ) -> Result<(), async_nats::Error> {
        let result = message.ack_with(processed.ack).await;
        if let Err(e) = &result {
            metrics::counter!(ACK_ERRORS, "consumer" => self.config.durable_name.clone())
                .increment(1);
            warn!(consumer = %self.config.durable_name, error = %e, ack = ?processed.ack, "cannot answer JetStream; the message will come again after ack_wait");
        }
        result
    }
}

/// Naks, without delay, the messages of `batch` that have arrived but were not started, so
/// that another instance takes them at once.
async fn release(batch: &mut jetstream::consumer::pull::Batch) {
    while let Some(Some(Ok(msg))) = batch.next().now_or_never() {
        let _ = msg.ack_with(AckKind::Nak(None)).await;
    }
}

/// `e: cause: cause`, for one log field.
pub(super) fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}
