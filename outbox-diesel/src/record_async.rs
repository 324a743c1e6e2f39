//! Recording on `diesel_async` connections.

use std::future::Future;

use diesel::QueryResult;
use diesel::pg::Pg;
use diesel_async::{AsyncConnection, RunQueryDsl, TransactionManager};
use uuid::Uuid;

use crate::record::{InsertEvents, ensure_in_transaction};
use crate::{EventHeaders, Outbox, OutboxEvent};

impl Outbox {
    /// [`Outbox::record`] on an async connection.
    pub fn record_async<'c, C, E>(
        &'c self,
        conn: &'c mut C,
        event: &E,
    ) -> impl Future<Output = QueryResult<Uuid>> + Send + 'c + use<'c, C, E>
    where
        C: AsyncConnection<Backend = Pg>,
        E: OutboxEvent + ?Sized,
    {
        self.record_with_headers_async(conn, event, &EventHeaders::new())
    }

    /// [`Outbox::record_with_headers`] on an async connection.
    pub fn record_with_headers_async<'c, C, E>(
        &'c self,
        conn: &'c mut C,
        event: &E,
        headers: &EventHeaders,
    ) -> impl Future<Output = QueryResult<Uuid>> + Send + 'c + use<'c, C, E>
    where
        C: AsyncConnection<Backend = Pg>,
        E: OutboxEvent + ?Sized,
    {
        let batch = self.prepare(std::iter::once(event), headers);
        async move { Ok(self.execute_async(conn, batch?).await?[0]) }
    }

    /// [`Outbox::record_all`] on an async connection.
    pub fn record_all_async<'c, C, E>(
        &'c self,
        conn: &'c mut C,
        events: &[E],
    ) -> impl Future<Output = QueryResult<Vec<Uuid>>> + Send + 'c + use<'c, C, E>
    where
        C: AsyncConnection<Backend = Pg>,
        E: OutboxEvent,
    {
        self.record_all_with_headers_async(conn, events, &EventHeaders::new())
    }

    /// [`Outbox::record_all_with_headers`] on an async connection.
    pub fn record_all_with_headers_async<'c, C, E>(
        &'c self,
        conn: &'c mut C,
        events: &[E],
        headers: &EventHeaders,
    ) -> impl Future<Output = QueryResult<Vec<Uuid>>> + Send + 'c + use<'c, C, E>
    where
        C: AsyncConnection<Backend = Pg>,
        E: OutboxEvent,
    {
        let batch = self.prepare(events.iter(), headers);
        async move { self.execute_async(conn, batch?).await }
    }

    /// Runs the statements of a prepared batch on an async connection: the twin of the sync
    /// `execute`, running what [`Outbox::statements`] decides.
    async fn execute_async<C>(&self, conn: &mut C, batch: InsertEvents) -> QueryResult<Vec<Uuid>>
    where
        C: AsyncConnection<Backend = Pg>,
    {
        ensure_in_transaction(C::TransactionManager::transaction_manager_status_mut(conn))?;
        let ids = batch.ids.clone();
        for statement in self.statements(batch) {
            statement.execute(conn).await?;
        }
        Ok(ids)
    }
}

/// Recording on an async Diesel connection: `diesel_async::AsyncPgConnection` and pooled
/// (deadpool, bb8) ones. Feature `async`.
///
/// ```no_run
/// use diesel_async::{AsyncConnection, AsyncPgConnection};
/// use outbox_diesel::{AsyncOutboxExt, OutboxEvent};
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
/// # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let mut conn = AsyncPgConnection::establish("postgres://localhost/app").await?;
/// conn.transaction(async |conn| {
///     // diesel::insert_into(orders::table).values(&order).execute(conn).await?;
///     conn.record_event(&OrderPlaced { order_id: 7, total_cents: 1250 }).await?;
///     Ok::<_, diesel::result::Error>(())
/// })
/// .await?;
/// # Ok(()) }
/// ```
pub trait AsyncOutboxExt {
    /// Records `event` in the default outbox; see [`Outbox::record`].
    fn record_event<E: OutboxEvent + ?Sized>(
        &mut self,
        event: &E,
    ) -> impl Future<Output = QueryResult<Uuid>> + Send;

    /// Records `events` with one multi-row `INSERT`; see [`Outbox::record_all`].
    fn record_events<E: OutboxEvent>(
        &mut self,
        events: &[E],
    ) -> impl Future<Output = QueryResult<Vec<Uuid>>> + Send;

    /// Records `event` in the default outbox with `headers` (e.g. a `traceparent`); see
    /// [`Outbox::record_with_headers`].
    fn record_event_with_headers<'c, E: OutboxEvent + ?Sized>(
        &'c mut self,
        event: &E,
        headers: &EventHeaders,
    ) -> impl Future<Output = QueryResult<Uuid>> + Send + 'c;

    /// Records `event` in `outbox` (another table, limit or wake-up policy); see
    /// [`Outbox::record`].
    fn record_event_in<'c, E: OutboxEvent + ?Sized>(
        &'c mut self,
        outbox: &'c Outbox,
        event: &E,
    ) -> impl Future<Output = QueryResult<Uuid>> + Send + 'c;

    /// Records `events` in `outbox` with one multi-row `INSERT`; see [`Outbox::record_all`].
    fn record_events_in<'c, E: OutboxEvent>(
        &'c mut self,
        outbox: &'c Outbox,
        events: &[E],
    ) -> impl Future<Output = QueryResult<Vec<Uuid>>> + Send + 'c;

    /// The former name of [`AsyncOutboxExt::record_event_in`].
    #[deprecated(
        since = "0.1.0",
        note = "renamed to `record_event_in`: `_with` now always means headers"
    )]
    fn record_event_with<'c, E: OutboxEvent + ?Sized>(
        &'c mut self,
        outbox: &'c Outbox,
        event: &E,
    ) -> impl Future<Output = QueryResult<Uuid>> + Send + 'c {
        self.record_event_in(outbox, event)
    }

    /// The former name of [`AsyncOutboxExt::record_events_in`].
    #[deprecated(
        since = "0.1.0",
        note = "renamed to `record_events_in`: `_with` now always means headers"
    )]
    fn record_events_with<'c, E: OutboxEvent>(
        &'c mut self,
        outbox: &'c Outbox,
        events: &[E],
    ) -> impl Future<Output = QueryResult<Vec<Uuid>>> + Send + 'c {
        self.record_events_in(outbox, events)
    }
}

impl<C> AsyncOutboxExt for C
where
    C: AsyncConnection<Backend = Pg>,
{
    fn record_event<E: OutboxEvent + ?Sized>(
        &mut self,
        event: &E,
    ) -> impl Future<Output = QueryResult<Uuid>> + Send {
        Outbox::global().record_async(self, event)
    }

    fn record_events<E: OutboxEvent>(
        &mut self,
        events: &[E],
    ) -> impl Future<Output = QueryResult<Vec<Uuid>>> + Send {
        Outbox::global().record_all_async(self, events)
    }

    fn record_event_with_headers<'c, E: OutboxEvent + ?Sized>(
        &'c mut self,
        event: &E,
        headers: &EventHeaders,
    ) -> impl Future<Output = QueryResult<Uuid>> + Send + 'c {
        Outbox::global().record_with_headers_async(self, event, headers)
    }

    fn record_event_in<'c, E: OutboxEvent + ?Sized>(
        &'c mut self,
        outbox: &'c Outbox,
        event: &E,
    ) -> impl Future<Output = QueryResult<Uuid>> + Send + 'c {
        outbox.record_async(self, event)
    }

    fn record_events_in<'c, E: OutboxEvent>(
        &'c mut self,
        outbox: &'c Outbox,
        events: &[E],
    ) -> impl Future<Output = QueryResult<Vec<Uuid>>> + Send + 'c {
        outbox.record_all_async(self, events)
    }
}
