//! [`OutboxExt`]: recording on a synchronous Diesel connection, through the default outbox or
//! a chosen one.

use diesel::pg::Pg;
use diesel::{Connection, QueryResult};
use uuid::Uuid;

use super::Outbox;
use crate::{EventHeaders, OutboxEvent};

/// Recording on a synchronous Diesel connection: `PgConnection` and pooled (`r2d2`) ones.
///
/// Call it inside `conn.transaction`, as the business write's last step: the event then
/// commits or rolls back with the change it describes.
///
/// ```
/// use diesel::prelude::*;
/// use outbox_diesel::{OutboxEvent, OutboxExt};
/// use serde::Serialize;
///
/// #[derive(Serialize, OutboxEvent)]
/// #[outbox(aggregate_type = "order", event_type = "order.placed")]
/// struct OrderPlaced {
///     #[outbox(aggregate_id)]
///     order_id: i64,
///     total_cents: i64,
/// }
///
/// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// # let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into());
/// # let mut conn = PgConnection::establish(&url)?;
/// # let conn = &mut conn;
/// # conn.begin_test_transaction()?;
/// # outbox_diesel::create_table(conn, &outbox_diesel::OutboxTable::DEFAULT)?;
/// let id = conn.transaction(|conn| {
///     // diesel::insert_into(orders::table).values(&order).execute(conn)?;
///     conn.record_event(&OrderPlaced { order_id: 7, total_cents: 1250 })
/// })?;
/// # assert_eq!(id.get_version_num(), 7);
/// # Ok(()) }
/// ```
pub trait OutboxExt {
    /// Records `event` in the default outbox ([`Outbox::global`]); see [`Outbox::record`].
    fn record_event<E: OutboxEvent + ?Sized>(&mut self, event: &E) -> QueryResult<Uuid>;

    /// Records `events` with one multi-row `INSERT`; see [`Outbox::record_all`].
    fn record_events<E: OutboxEvent>(&mut self, events: &[E]) -> QueryResult<Vec<Uuid>>;

    /// Records `event` in the default outbox with `headers` (e.g. a `traceparent`); see
    /// [`Outbox::record_with_headers`].
    fn record_event_with_headers<E: OutboxEvent + ?Sized>(
        &mut self,
        event: &E,
        headers: &EventHeaders,
    ) -> QueryResult<Uuid>;

    /// Records `event` in `outbox` (another table, limit or wake-up policy); see
    /// [`Outbox::record`].
    fn record_event_in<E: OutboxEvent + ?Sized>(
        &mut self,
        outbox: &Outbox,
        event: &E,
    ) -> QueryResult<Uuid>;

    /// Records `events` in `outbox` with one multi-row `INSERT`; see [`Outbox::record_all`].
    fn record_events_in<E: OutboxEvent>(
        &mut self,
        outbox: &Outbox,
        events: &[E],
    ) -> QueryResult<Vec<Uuid>>;

    /// The former name of [`OutboxExt::record_event_in`].
    #[deprecated(
        since = "0.1.0",
        note = "renamed to `record_event_in`: `_with` now always means headers"
    )]
    fn record_event_with<E: OutboxEvent + ?Sized>(
        &mut self,
        outbox: &Outbox,
        event: &E,
    ) -> QueryResult<Uuid> {
        self.record_event_in(outbox, event)
    }

    /// The former name of [`OutboxExt::record_events_in`].
    #[deprecated(
        since = "0.1.0",
        note = "renamed to `record_events_in`: `_with` now always means headers"
    )]
    fn record_events_with<E: OutboxEvent>(
        &mut self,
        outbox: &Outbox,
        events: &[E],
    ) -> QueryResult<Vec<Uuid>> {
        self.record_events_in(outbox, events)
    }
}

impl<C> OutboxExt for C
where
    C: Connection<Backend = Pg>,
{
    fn record_event<E: OutboxEvent + ?Sized>(&mut self, event: &E) -> QueryResult<Uuid> {
        Outbox::global().record(self, event)
    }

    fn record_events<E: OutboxEvent>(&mut self, events: &[E]) -> QueryResult<Vec<Uuid>> {
        Outbox::global().record_all(self, events)
    }

    fn record_event_with_headers<E: OutboxEvent + ?Sized>(
        &mut self,
        event: &E,
        headers: &EventHeaders,
    ) -> QueryResult<Uuid> {
        Outbox::global().record_with_headers(self, event, headers)
    }

    fn record_event_in<E: OutboxEvent + ?Sized>(
        &mut self,
        outbox: &Outbox,
        event: &E,
    ) -> QueryResult<Uuid> {
        outbox.record(self, event)
    }

    fn record_events_in<E: OutboxEvent>(
        &mut self,
        outbox: &Outbox,
        events: &[E],
    ) -> QueryResult<Vec<Uuid>> {
        outbox.record_all(self, events)
    }
}
