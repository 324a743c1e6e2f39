//! The consuming side: [`Consumer`] runs a durable JetStream pull consumer and applies each
//! outbox event **once in effect**, whatever the number of deliveries.
//!
//! For every message it
//!
//! 1. decodes the payload into your event type `E` (see [Decoding](#decoding));
//! 2. opens a transaction on its PostgreSQL connection, records the message id in the
//!    [inbox](outbox_diesel::inbox) (`processed_messages`, keyed by consumer and message id)
//!    and, when the id is new, runs your handler in that same transaction;
//! 3. acks the message only after the commit.
//!
//! So a handler's change and the inbox entry commit or roll back together. A message that
//! comes again (the relay published it twice, or the consumer died between its commit and its
//! ack) finds its id in the inbox: the handler is skipped and the message acked.
//!
//! ```no_run
//! use diesel::prelude::*;
//! use diesel_async::RunQueryDsl;
//! use outbox_diesel::OutboxEvent;
//! use outbox_nats::consumer::{Consumer, ConsumerConfig, Delivery};
//! use serde::{Deserialize, Serialize};
//! use tokio_util::sync::CancellationToken;
//!
//! // the producer's event type, shared through a crate (or mirrored with the same serde shape)
//! #[derive(Serialize, Deserialize, OutboxEvent)]
//! #[outbox(aggregate_type = "order")]
//! enum OrderEvent {
//!     Placed { #[outbox(aggregate_id)] id: i64, total_cents: i64 },
//!     Cancelled(#[outbox(aggregate_id)] i64),
//! }
//!
//! diesel::table! {
//!     invoices (order_id) { order_id -> BigInt, total_cents -> BigInt }
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let nats = async_nats::connect("127.0.0.1:4222").await?;
//! let config = ConsumerConfig::new("billing", "postgres://127.0.0.1/billing")
//!     .filter_subject("outbox.order.>");
//! let shutdown = CancellationToken::new(); // cancel it on SIGTERM
//! Consumer::new(config, nats)
//!     .run(shutdown, async |conn, msg: Delivery<OrderEvent>| {
//!         if let OrderEvent::Placed { id, total_cents } = msg.event {
//!             diesel::insert_into(invoices::table)
//!                 .values((invoices::order_id.eq(id), invoices::total_cents.eq(total_cents)))
//!                 .execute(conn)
//!                 .await?;
//!         }
//!         Ok::<_, diesel::result::Error>(())
//!     })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # What happens to each message
//!
//! | the message | the consumer |
//! |---|---|
//! | new, handler returns `Ok` | commits handler's change + inbox entry, then acks |
//! | already in the inbox | skips the handler, acks |
//! | handler returns `Err` (or the database fails) | rolls back both, naks with a delay of [`ConsumerConfig::retry_delay`] doubled per delivery, up to [`ConsumerConfig::max_retry_delay`] |
//! | cannot be decoded | naks with the same delays; at the [`ConsumerConfig::undecodable_after`]-th delivery, terminates it (`+TERM`) |
//! | handler runs longer than `ack_wait` | sends "in progress" every half `ack_wait`, so JetStream does not redeliver it meanwhile |
//!
//! **Undecodable messages are terminated, not parked**: JetStream stops delivering them to this
//! consumer and moves on to the messages behind them. The message itself stays in the stream
//! (until its limits remove it) and the server announces it on
//! `$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.<stream>.<consumer>`; the consumer logs an error
//! with its stream sequence and counts it (`outcome="terminated"`). Repair by fetching it by
//! sequence once the decoder is fixed. Retrying for a few deliveries first lets a rolling
//! deploy of a newer decoder pick it up.
//!
//! A handler error is retried without end (set [`ConsumerConfig::max_deliver`] to bound it).
//! One consumer instance handles one message at a time; run several instances with the same
//! durable name to share the work. Order per aggregate holds only while nothing is retried:
//! set [`ConsumerConfig::max_ack_pending`] to 1 for a strict order (a failing message then
//! holds back everything behind it).
//!
//! # Decoding
//!
//! The relay publishes the outbox row's payload, which is `serde_json::to_value(&event)` of the
//! recorded event, as the message body, and the event's [`OutboxEvent::event_type`] in the
//! `Outbox-Event-Type` header. The consumer deserialises the body with `serde_json` into `E`,
//! so `E` must read what the producer's type writes: the same type with `Deserialize`, or one
//! with the same serde shape (field names, enum tagging and renames).
//!
//! When `E` lists its event types ([`OutboxEvent::event_types`]: the derive does for enums,
//! one per variant), a message whose `Outbox-Event-Type` is not among them is undecodable, or,
//! with [`ConsumerConfig::skip_unknown_event_types`], acked without running the handler (for
//! a consumer that wants only some events of an aggregate). A message without a `Nats-Msg-Id`
//! header cannot be deduplicated, and is undecodable too.
//!
//! # Shutdown
//!
//! Cancelling the token passed to [`Consumer::run`] stops fetching; the message in hand is
//! finished (committed and acked, or rolled back and nakked), the messages fetched but not
//! started are nakked without delay so that another instance takes them at once, and `run`
//! returns. Dropping the future instead (a second signal) is safe too: what was not acked
//! comes again after `ack_wait`, and the inbox drops what had committed.
//!
//! # Metrics
//!
//! Through the `metrics` facade, labelled with `consumer` (the durable name):
//! [`MESSAGES`] (also by `outcome`), [`HANDLE_SECONDS`], [`ACK_ERRORS`].

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use diesel_async::{AsyncConnection, AsyncPgConnection, TransactionManager};
use futures_util::{FutureExt, StreamExt};
use outbox_diesel::{Inbox, OutboxEvent};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::backoff::Backoff;
use crate::publish::{AGGREGATE_ID_HEADER, AGGREGATE_TYPE_HEADER, EVENT_TYPE_HEADER};

/// Counter: messages the consumer finished with, by `consumer` and `outcome` (`handled`,
/// `duplicate`, `skipped`, `handler_error`, `database_error`, `undecodable`, `terminated`).
pub const MESSAGES: &str = "outbox_consumer_messages_total";
/// Histogram: seconds from the start of a message's transaction to its end, by `consumer`.
pub const HANDLE_SECONDS: &str = "outbox_consumer_handle_seconds";
/// Counter: acks, naks and terms that could not be sent, by `consumer`.
pub const ACK_ERRORS: &str = "outbox_consumer_ack_errors_total";

fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(
        MESSAGES,
        Unit::Count,
        "Messages the consumer finished with, by outcome"
    );
    describe_histogram!(
        HANDLE_SECONDS,
        Unit::Seconds,
        "Time spent in a message's transaction"
    );
    describe_counter!(
        ACK_ERRORS,
        Unit::Count,
        "Acks, naks and terms that could not be sent"
    );
}

/// Everything a [`Consumer`] needs besides its NATS client.
///
/// ```
/// use std::time::Duration;
/// use outbox_nats::consumer::ConsumerConfig;
///
/// let config = ConsumerConfig::new("billing", "postgres://billing@db/billing")
///     .filter_subject("outbox.order.>")
///     .ack_wait(Duration::from_secs(10))
///     .max_ack_pending(100);
/// assert_eq!(config.stream, "OUTBOX");
/// assert_eq!(config.durable_name, "billing");
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct ConsumerConfig {
    /// The durable consumer's name; also the consumer's name in the inbox.
    pub durable_name: String,
    /// PostgreSQL connection URL of the consumer's own database (which holds the inbox).
    pub database_url: String,
    /// The stream (default `OUTBOX`).
    pub stream: String,
    /// Only messages whose subject matches (default: every message of the stream).
    pub filter_subject: Option<String>,
    /// Messages delivered and not yet acked, across every instance (default 1000).
    pub max_ack_pending: i64,
    /// How long JetStream waits for an ack before delivering again (default 30 s).
    pub ack_wait: Duration,
    /// Deliveries after which JetStream gives up on a message; `-1` for no limit (the default).
    pub max_deliver: i64,
    /// Messages asked for per pull request (default 10).
    pub batch_size: usize,
    /// How long a pull request waits for messages before a new one is sent (default 5 s).
    pub fetch_wait: Duration,
    /// The first nak delay after a failure (default 1 s); doubled per delivery.
    pub retry_delay: Duration,
    /// The longest nak delay, and the longest wait between reconnections (default 1 min).
    pub max_retry_delay: Duration,
    /// The delivery at which an undecodable message is terminated (default 5).
    pub undecodable_after: u32,
    /// Ack messages whose event type `E` does not list instead of treating them as
    /// undecodable (default off).
    pub skip_unknown_event_types: bool,
    /// The inbox table (default `processed_messages`).
    pub inbox: Inbox,
    /// How long the first connections are retried before [`Consumer::run`] gives up
    /// (default 30 s).
    pub startup_timeout: Duration,
}

/// The database URL is shown without its password.
impl fmt::Debug for ConsumerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerConfig")
            .field("durable_name", &self.durable_name)
            .field("database_url", &crate::redact_url(&self.database_url))
            .field("stream", &self.stream)
            .field("filter_subject", &self.filter_subject)
            .field("max_ack_pending", &self.max_ack_pending)
            .field("ack_wait", &self.ack_wait)
            .field("max_deliver", &self.max_deliver)
            .field("batch_size", &self.batch_size)
            .field("fetch_wait", &self.fetch_wait)
            .field("retry_delay", &self.retry_delay)
            .field("max_retry_delay", &self.max_retry_delay)
            .field("undecodable_after", &self.undecodable_after)
            .field("skip_unknown_event_types", &self.skip_unknown_event_types)
            .field("inbox", &self.inbox)
            .field("startup_timeout", &self.startup_timeout)
            .finish_non_exhaustive()
    }
}

impl ConsumerConfig {
    /// The defaults for the durable consumer `durable_name`, with its database at
    /// `database_url`.
    pub fn new(durable_name: impl Into<String>, database_url: impl Into<String>) -> Self {
        ConsumerConfig {
            durable_name: durable_name.into(),
            database_url: database_url.into(),
            stream: "OUTBOX".into(),
            filter_subject: None,
            max_ack_pending: 1000,
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            batch_size: 10,
            fetch_wait: Duration::from_secs(5),
            retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(60),
            undecodable_after: 5,
            skip_unknown_event_types: false,
            inbox: Inbox::default(),
            startup_timeout: Duration::from_secs(30),
        }
    }

    /// Sets [`ConsumerConfig::stream`].
    pub fn stream(mut self, stream: impl Into<String>) -> Self {
        self.stream = stream.into();
        self
    }

    /// Sets [`ConsumerConfig::filter_subject`].
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = Some(subject.into());
        self
    }

    /// Sets [`ConsumerConfig::max_ack_pending`].
    pub fn max_ack_pending(mut self, n: i64) -> Self {
        self.max_ack_pending = n;
        self
    }

    /// Sets [`ConsumerConfig::ack_wait`].
    pub fn ack_wait(mut self, d: Duration) -> Self {
        self.ack_wait = d;
        self
    }

    /// Sets [`ConsumerConfig::max_deliver`].
    pub fn max_deliver(mut self, n: i64) -> Self {
        self.max_deliver = n;
        self
    }

    /// Sets [`ConsumerConfig::batch_size`].
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Sets [`ConsumerConfig::fetch_wait`].
    pub fn fetch_wait(mut self, d: Duration) -> Self {
        self.fetch_wait = d;
        self
    }

    /// Sets [`ConsumerConfig::retry_delay`] and [`ConsumerConfig::max_retry_delay`].
    pub fn retry_delay(mut self, first: Duration, max: Duration) -> Self {
        self.retry_delay = first;
        self.max_retry_delay = max;
        self
    }

    /// Sets [`ConsumerConfig::undecodable_after`].
    pub fn undecodable_after(mut self, deliveries: u32) -> Self {
        self.undecodable_after = deliveries;
        self
    }

    /// Sets [`ConsumerConfig::skip_unknown_event_types`].
    pub fn skip_unknown_event_types(mut self, on: bool) -> Self {
        self.skip_unknown_event_types = on;
        self
    }

    /// Sets [`ConsumerConfig::inbox`].
    pub fn inbox(mut self, inbox: Inbox) -> Self {
        self.inbox = inbox;
        self
    }

    /// Sets [`ConsumerConfig::startup_timeout`].
    pub fn startup_timeout(mut self, d: Duration) -> Self {
        self.startup_timeout = d;
        self
    }

    /// Checks the values against each other and JetStream's rules.
    pub fn validate(&self) -> Result<(), String> {
        let name = &self.durable_name;
        if name.is_empty()
            || name
                .chars()
                .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
        {
            return Err(format!(
                "durable name {name:?} must be non-empty, without white space, `.`, `*`, `>`, `/` or `\\`"
            ));
        }
        if self.stream.is_empty() {
            return Err("the stream name is empty".into());
        }
        if self.max_ack_pending == 0 || self.max_ack_pending < -1 {
            return Err("max_ack_pending must be at least 1 (or -1 for no limit)".into());
        }
        if self.max_deliver == 0 || self.max_deliver < -1 {
            return Err("max_deliver must be at least 1 (or -1 for no limit)".into());
        }
        if self.ack_wait < Duration::from_millis(100) {
            return Err("ack_wait must be at least 100ms".into());
        }
        if self.batch_size == 0 {
            return Err("batch_size must be at least 1".into());
        }
        if self.fetch_wait < Duration::from_millis(10) {
            return Err("fetch_wait must be at least 10ms".into());
        }
        if self.undecodable_after == 0 {
            return Err("undecodable_after must be at least 1".into());
        }
        if self.retry_delay > self.max_retry_delay {
            return Err("retry_delay must not exceed max_retry_delay".into());
        }
        Ok(())
    }

    /// The JetStream configuration of the durable consumer.
    fn pull_config(&self) -> jetstream::consumer::pull::Config {
        jetstream::consumer::pull::Config {
            durable_name: Some(self.durable_name.clone()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            max_ack_pending: self.max_ack_pending,
            max_deliver: self.max_deliver,
            filter_subject: self.filter_subject.clone().unwrap_or_default(),
            ..Default::default()
        }
    }

    /// The nak delay of a message's `delivered`-th delivery.
    fn retry_delay_for(&self, delivered: u64) -> Duration {
        let doublings = delivered.saturating_sub(1).min(20) as u32;
        self.retry_delay
            .saturating_mul(1 << doublings)
            .min(self.max_retry_delay)
    }
}

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

/// One decoded message, as the handler receives it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Delivery<E> {
    /// The event, deserialised from the message body.
    pub event: E,
    /// The message id (`Nats-Msg-Id`: the outbox row's UUID).
    pub message_id: String,
    /// The `Outbox-Event-Type` header (empty when absent).
    pub event_type: String,
    /// The `Outbox-Aggregate-Type` header (empty when absent).
    pub aggregate_type: String,
    /// The `Outbox-Aggregate-Id` header, unencoded (empty when absent).
    pub aggregate_id: String,
    /// The subject it was published on.
    pub subject: String,
    /// Its sequence number in the stream.
    pub stream_sequence: u64,
    /// Which delivery this is: 1 the first time, more after a nak or a missed ack.
    pub delivered: u64,
    /// Every header of the message.
    pub headers: HeaderMap,
}

impl<E> Delivery<E> {
    /// A first delivery of `event` with the message id `message_id` and no headers, for
    /// testing a handler without a server.
    pub fn new(message_id: impl Into<String>, event: E) -> Self {
        Delivery {
            event,
            message_id: message_id.into(),
            event_type: String::new(),
            aggregate_type: String::new(),
            aggregate_id: String::new(),
            subject: String::new(),
            stream_sequence: 0,
            delivered: 1,
            headers: HeaderMap::new(),
        }
    }
}

impl<E: DeserializeOwned + OutboxEvent> Delivery<E> {
    /// Decodes a JetStream message (see the [module documentation](self#decoding)).
    pub fn decode(message: &jetstream::Message) -> Result<Self, DecodeError> {
        let info = message.info().map_err(|_| DecodeError::NotJetStream)?;
        let headers = message.headers.clone().unwrap_or_default();
        Self::decode_parts(
            message.subject.as_str(),
            headers,
            &message.payload,
            info.stream_sequence,
            info.delivered.max(1) as u64,
        )
    }

    fn decode_parts(
        subject: &str,
        headers: HeaderMap,
        payload: &[u8],
        stream_sequence: u64,
        delivered: u64,
    ) -> Result<Self, DecodeError> {
        let get = |name: &str| {
            headers
                .get(name)
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default()
        };
        let message_id = get("Nats-Msg-Id");
        if message_id.is_empty() {
            return Err(DecodeError::NoMessageId);
        }
        let event_type = get(EVENT_TYPE_HEADER);
        let known = E::event_types();
        if !known.is_empty() && !known.contains(&event_type.as_str()) {
            return Err(DecodeError::UnknownEventType { event_type, known });
        }
        let event = serde_json::from_slice(payload).map_err(|source| DecodeError::Json {
            type_name: std::any::type_name::<E>(),
            event_type: event_type.clone(),
            source,
        })?;
        Ok(Delivery {
            event,
            message_id,
            aggregate_type: get(AGGREGATE_TYPE_HEADER),
            aggregate_id: get(AGGREGATE_ID_HEADER),
            event_type,
            subject: subject.to_owned(),
            stream_sequence,
            delivered,
            headers,
        })
    }
}

/// Why a message cannot become a [`Delivery`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The message has no `Nats-Msg-Id` header, so the inbox cannot tell it from another.
    #[error(
        "the message has no `Nats-Msg-Id` header, so the inbox cannot deduplicate it; publish through the outbox relay, or set the header"
    )]
    NoMessageId,
    /// The message's `Outbox-Event-Type` is not one of the consumer's event types.
    #[error("event type {event_type:?} is not one of the consumer's event types {known:?}")]
    UnknownEventType {
        /// The message's event type (empty when the header is absent).
        event_type: String,
        /// The event types the consumer's type lists.
        known: &'static [&'static str],
    },
    /// The body is not the JSON of the consumer's type.
    #[error("the body of a {event_type:?} message is not the JSON of `{type_name}`")]
    Json {
        /// The consumer's event type.
        type_name: &'static str,
        /// The message's event type.
        event_type: String,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
    /// The message did not come from a JetStream consumer (it has no ack subject).
    #[error("not a JetStream message: it has no ack subject")]
    NotJetStream,
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
/// [module documentation](self).
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
    /// [module documentation](self)).
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
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::{Deserialize, Serialize};

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum Ev {
        Placed { id: i64 },
        Cancelled(i64),
    }

    impl OutboxEvent for Ev {
        fn aggregate_type(&self) -> &str {
            "order"
        }
        fn event_type(&self) -> &str {
            match self {
                Ev::Placed { .. } => "placed",
                Ev::Cancelled(_) => "cancelled",
            }
        }
        fn aggregate_id(&self) -> String {
            match self {
                Ev::Placed { id } | Ev::Cancelled(id) => id.to_string(),
            }
        }
        fn event_types() -> &'static [&'static str] {
            &["placed", "cancelled"]
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, *v);
        }
        h
    }

    #[test]
    fn decodes_the_recorded_json_and_the_headers() {
        let event = Ev::Placed { id: 7 };
        let body = serde_json::to_vec(&serde_json::to_value(&event).expect("json")).expect("json");
        let h = headers(&[
            ("Nats-Msg-Id", "m-1"),
            (EVENT_TYPE_HEADER, "placed"),
            (AGGREGATE_TYPE_HEADER, "order"),
            (AGGREGATE_ID_HEADER, "7"),
        ]);
        let d = Delivery::<Ev>::decode_parts("outbox.order.7", h, &body, 3, 2).expect("decodes");
        assert_eq!(d.event, event);
        assert_eq!(
            (d.message_id.as_str(), d.event_type.as_str()),
            ("m-1", "placed")
        );
        assert_eq!(
            (d.aggregate_type.as_str(), d.aggregate_id.as_str()),
            ("order", "7")
        );
        assert_eq!((d.stream_sequence, d.delivered), (3, 2));
    }

    #[test]
    fn refuses_what_it_cannot_deduplicate_or_read() {
        let body = br#"{"Cancelled":7}"#;
        let no_id = headers(&[(EVENT_TYPE_HEADER, "cancelled")]);
        assert!(matches!(
            Delivery::<Ev>::decode_parts("s", no_id, body, 1, 1),
            Err(DecodeError::NoMessageId)
        ));
        let unknown = headers(&[("Nats-Msg-Id", "m"), (EVENT_TYPE_HEADER, "shipped")]);
        assert!(matches!(
            Delivery::<Ev>::decode_parts("s", unknown, body, 1, 1),
            Err(DecodeError::UnknownEventType { .. })
        ));
        let ok = headers(&[("Nats-Msg-Id", "m"), (EVENT_TYPE_HEADER, "cancelled")]);
        let err = Delivery::<Ev>::decode_parts("s", ok, b"{not json", 1, 1).expect_err("bad json");
        assert!(matches!(err, DecodeError::Json { .. }));
        assert!(
            chain(&err).contains("key must be a string"),
            "{}",
            chain(&err)
        );
    }

    #[test]
    fn retry_delays_double_up_to_the_cap() {
        let cfg = ConsumerConfig::new("c", "postgres://x/y")
            .retry_delay(Duration::from_millis(100), Duration::from_millis(500));
        let delays: Vec<_> = (1..=5)
            .map(|d| cfg.retry_delay_for(d).as_millis())
            .collect();
        assert_eq!(delays, [100, 200, 400, 500, 500]);
    }

    #[test]
    fn validates_names_and_limits() {
        assert!(ConsumerConfig::new("billing", "u").validate().is_ok());
        assert!(ConsumerConfig::new("bill.ing", "u").validate().is_err());
        assert!(ConsumerConfig::new("", "u").validate().is_err());
        assert!(
            ConsumerConfig::new("b", "u")
                .max_ack_pending(0)
                .validate()
                .is_err()
        );
        assert!(
            ConsumerConfig::new("b", "u")
                .undecodable_after(0)
                .validate()
                .is_err()
        );
    }
}
