//! The relay's database side (feature `async`): read the unpublished rows of a partition in
//! `seq` order, mark the acked ones, record failures, and hold a partition's lease.
//!
//! `outbox-nats`'s relay drives these; they are public so that other transports can reuse
//! them. Every function takes the [`OutboxTable`](crate::OutboxTable) it works on. One room
//! per job:
//!
//! - `rows`: [`OutboxRow`], what the relay publishes, and [`Partition`];
//! - `session`: what the relay sets on its sessions ([`prepare_session`], [`set_lease_timeouts`]),
//!   its keep-alive, `LISTEN` and pid;
//! - `poll`: the fetches in `seq` order (unordered mode, and what other transports reuse);
//! - `progress`: the ordered relay's snapshot batches: [`fetch_batches`], its [`Cursor`]s and
//!   their record, and what cleanup and `retry` need of them;
//! - `marks`: the outcome of a publish ([`mark_published`], [`delete_acked`],
//!   [`record_failure`]);
//! - `parking`: parked rows, the rows held back behind them, [`retry_parked`];
//! - `locks`: partition leases and the membership of the relays balancing a table, with the
//!   channel on which they tell each other that the shares moved ([`notify_members`]);
//! - `stats`: [`backlog`], [`table_stats`], [`oldest_transaction`], and the channel on which
//!   one relay sends the backlog figures to the others ([`statistics_channel`]);
//! - `cleanup`: [`delete_published`], [`archive_published`].

use diesel::QueryableByName;
use diesel::sql_types::{Bool, Nullable};

mod cleanup;
mod locks;
mod marks;
mod parking;
mod poll;
mod prepared;
mod progress;
mod rows;
mod session;
mod stats;

pub use cleanup::*;
pub use locks::*;
pub use marks::*;
pub use parking::*;
pub use poll::*;
pub use progress::*;
pub use rows::*;
pub use session::*;
pub use stats::*;

/// The one-column answer of the queries that return a yes or no.
#[derive(QueryableByName)]
struct Flag {
    #[diesel(sql_type = Nullable<Bool>)]
    flag: Option<bool>,
}
