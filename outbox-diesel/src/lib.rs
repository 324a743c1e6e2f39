//! A transactional outbox for Diesel services.
//!
//! A service changes its state and records the events of that change in **one** database
//! transaction; a relay (`outbox-nats`) copies exactly the committed events to NATS JetStream.
//!
//! - [`OutboxEvent`] (and `#[derive(OutboxEvent)]`) says what an event's aggregate and type are;
//! - [`OutboxExt::record_event`] (sync) and `AsyncOutboxExt::record_event` (feature `async`)
//!   insert it inside the caller's `conn.transaction`;
//! - [`MIGRATIONS`] / [`create_table`] create the table, [`schema::outbox`] is its Diesel
//!   definition;
//! - [`relay`] (feature `async`) is the relay's database side: claim, mark, leases;
//! - [`wal`] (feature `async`) is log tailing's: the slot, the publication, reading the WAL;
//! - [`connect`] (feature `async`) opens an async connection with libpq's settings, TLS
//!   included ([`PgConnectOptions`]), whose failure says whether it can heal; [`establish`] is
//!   the same for an application's own pools.
//!
//! ```
//! use diesel::prelude::*;
//! use outbox_diesel::{OutboxEvent, OutboxExt};
//! use serde::Serialize;
//!
//! #[derive(Serialize, OutboxEvent)]
//! #[outbox(aggregate_type = "order", event_type = "order.placed")]
//! struct OrderPlaced {
//!     #[outbox(aggregate_id)]
//!     order_id: i64,
//!     total_cents: i64,
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! # let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into());
//! # let mut conn = PgConnection::establish(&url)?;
//! # let conn = &mut conn;
//! # conn.begin_test_transaction()?;
//! # outbox_diesel::create_table(conn, &outbox_diesel::OutboxTable::DEFAULT)?;
//! conn.transaction(|conn| {
//!     // diesel::insert_into(orders::table).values(&order).execute(conn)?;
//!     conn.record_event(&OrderPlaced { order_id: 7, total_cents: 1250 })?; // same transaction
//!     Ok::<_, diesel::result::Error>(())
//! })?;
//!
//! // outside a transaction, nothing is written
//! let refused = conn.record_event(&OrderPlaced { order_id: 8, total_cents: 1 });
//! # let _ = refused;
//! # Ok(()) }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "connect")]
mod connect;
mod event;
pub mod headers;
pub mod inbox;
mod json;
#[cfg(feature = "connect")]
mod options;
pub mod partition_index;
mod record;
#[cfg(feature = "async")]
mod record_async;
#[cfg(feature = "relay")]
pub mod relay;
pub mod rotation;
pub mod schema;
mod table;
#[cfg(feature = "relay")]
pub mod wal;
mod wire;

#[cfg(feature = "connect")]
pub use connect::{ConnectError, connect, establish};
pub use event::{
    MAX_SUBJECT_NAMES_LEN, OutboxEvent, TokenError, check_event_type, check_subject_token,
    encoded_token_len, subject_names_len,
};
pub use headers::EventHeaders;
#[cfg(feature = "async")]
pub use inbox::AsyncInboxExt;
pub use inbox::{Inbox, InboxExt};
pub use json::RawJson;
#[cfg(feature = "connect")]
pub use options::{InvalidUrl, PgConnectOptions, SslMode, ensure_crypto_provider};
pub use partition_index::{create_partition_index, partition_index_name, partition_index_sql};
pub use record::{DEFAULT_MAX_PAYLOAD, InvalidEvent, Notify, Outbox, OutboxExt};
#[cfg(feature = "async")]
pub use record_async::AsyncOutboxExt;
pub use rotation::{Rotation, partition_table};
#[cfg(feature = "migrations")]
pub use schema::{MIGRATIONS, run_migrations};
pub use schema::{SCHEMA_LOCK_KEY, create_table, create_table_sql};
pub use table::{InvalidTableName, OutboxTable};
pub use wire::{jsonb_text, message_size};

/// `#[derive(OutboxEvent)]`: see the [`outbox_derive`] crate for its attributes.
#[cfg(feature = "derive")]
pub use outbox_derive::OutboxEvent;

#[doc(hidden)]
pub mod __private {
    pub use serde;
}
