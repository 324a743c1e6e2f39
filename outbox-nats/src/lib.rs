//! The relay of the Diesel transactional outbox: it publishes the committed rows of the
//! outbox table (recorded with `outbox-diesel`) to NATS JetStream.
//!
//! - [`Relay`] runs in-process; the `outbox-relay` binary runs the same engine;
//! - [`publish`] is the publishing contract (subject, headers, body, stream);
//! - [`subject`] the subject template and the token encoding;
//! - [`reconcile`] how a row that may be in the stream already is looked up before it is sent
//!   again;
//! - [`fence`] how the ordered modes have JetStream refuse an event that would land after a
//!   newer one of its subject.
//!
//! ```no_run
//! use outbox_nats::{NatsOptions, Relay, RelayConfig};
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let nats = NatsOptions::new("nats://127.0.0.1:4222").connect().await?;
//! let config = RelayConfig::new("postgres://127.0.0.1/app");
//! let shutdown = CancellationToken::new();
//! Relay::new(config, nats).run(shutdown).await?;
//! # Ok(()) }
//! ```

#[cfg(feature = "admin")]
pub mod admin;
pub mod backoff;
pub mod cleanup;
#[cfg(feature = "cli")]
pub mod cli;
mod config;
mod connect;
pub mod consumer;
pub mod fence;
mod lease;
pub mod metrics;
pub mod operations;
mod ordered;
mod pipeline;
pub mod publish;
pub mod reconcile;
mod redact;
mod relay;
pub mod subject;
mod tailing;
mod unordered;

pub use config::{Mode, RelayConfig};
pub use connect::{ConnectError, NatsOptions};
pub use consumer::{Consumer, ConsumerConfig, Delivery};
pub use redact::redact_url;
pub use relay::{Health, Relay, RelayError};
