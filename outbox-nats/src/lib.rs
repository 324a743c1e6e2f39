//! The relay of the Diesel transactional outbox: it publishes the committed rows of the
//! outbox table (recorded with `outbox-diesel`) to NATS JetStream.
//!
//! The crate's rooms:
//!
//! - the relay engine and its modes ([`Relay`], [`RelayConfig`], [`Mode`] with each mode's
//!   settings, [`Health`], [`cleanup`]); the `outbox-relay` binary runs the same engine;
//! - [`publish`], the publishing contract: what message a row becomes ([`subject`]: the
//!   subject template and the token encoding), the stream, the pipeline that keeps each
//!   aggregate's order, and [`reconcile`]: how a row that may be in the stream already is
//!   looked up before it is sent again, and [`fence`]: how the ordered modes have JetStream
//!   refuse an event that would land after a newer one of its subject;
//! - [`consumer`], the consuming side;
//! - [`operations`], what an operator asks of a running deployment (`status`, `parked`,
//!   `retry`, the admin server);
//! - shared by them: [`NatsOptions`] (connecting), [`backoff`], [`metrics`].
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

pub mod backoff;
#[cfg(feature = "cli")]
pub mod cli;
mod connect;
pub mod consumer;
mod health;
mod lease;
pub mod metrics;
pub mod operations;
pub mod publish;
mod redact;
mod relay;

pub use connect::{ConnectError, NatsOptions};
pub use consumer::{Consumer, ConsumerConfig, Delivery};
#[cfg(feature = "admin")]
pub use operations::admin;
pub use publish::{fence, reconcile, subject};
pub use redact::redact_url;
pub use relay::cleanup;
pub use relay::config::RelayConfig;
pub use relay::mode::{Cleanup, LogTailing, Mode, ModeKind, Ordered, Unordered};
pub use relay::{Health, Relay, RelayError};
