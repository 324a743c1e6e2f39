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
//! recorded event, as the message body, and the event's [`OutboxEvent::event_type`](outbox_diesel::OutboxEvent::event_type) in the
//! `Outbox-Event-Type` header. The consumer deserialises the body with `serde_json` into `E`,
//! so `E` must read what the producer's type writes: the same type with `Deserialize`, or one
//! with the same serde shape (field names, enum tagging and renames).
//!
//! When `E` lists its event types ([`OutboxEvent::event_types`](outbox_diesel::OutboxEvent::event_types): the derive does for enums,
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

mod config;
mod delivery;
mod run;
mod telemetry;

pub use config::*;
pub use delivery::*;
pub use run::*;
pub use telemetry::*;
