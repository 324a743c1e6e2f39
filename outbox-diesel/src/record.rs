//! Recording events inside the caller's transaction: [`Outbox`], [`OutboxExt`] and, with the
//! `async` feature, [`AsyncOutboxExt`](crate::AsyncOutboxExt).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::result::Error as DieselError;
use diesel::sql_types::{Array, Text, Uuid as SqlUuid};
use diesel::connection::TransactionManager;
use diesel::{Connection, QueryResult, RunQueryDsl};
use uuid::Uuid;

use crate::{OutboxEvent, OutboxTable, check_event_type, check_subject_token};

/// NATS's default `max_payload`: the default limit on a recorded payload.
pub const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;

/// How the recording side wakes the relay with `NOTIFY` (delivered at commit).
///
/// Every commit that sent a `NOTIFY` takes a cluster-wide lock while it commits, which halves
/// the commit rate of a busy database if every transaction notifies. The default debounces:
/// at most one `NOTIFY` per interval per [`Outbox`] (per process for the default outbox); the
/// relay's cheap fallback poll picks up what a skipped notification would have announced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Notify {
    /// Never notify: the relay finds events by polling alone.
    Off,
    /// Notify at most once per interval (the default: every 10 ms).
    Debounced(Duration),
    /// Notify in every transaction that records: the lowest latency, at a cost in commit rate.
    EveryTransaction,
}

impl Default for Notify {
    fn default() -> Self {
        Notify::Debounced(Duration::from_millis(10))
    }
}

/// How events are recorded: which table, the payload limit, the wake-up policy.
///
/// [`OutboxExt::record_event`] uses [`Outbox::global`] (table `outbox`, 1 MiB limit,
/// debounced `NOTIFY`); build your own for another table and call [`Outbox::record`] or pass
/// it to [`OutboxExt::record_event_with`].
///
/// ```
/// use std::time::Duration;
/// use outbox_diesel::{Notify, Outbox};
///
/// let billing = Outbox::new("billing.outbox".parse()?)
///     .max_payload(64 * 1024)
///     .notify(Notify::Debounced(Duration::from_millis(5)));
/// assert_eq!(billing.table().to_string(), "billing.outbox");
/// # Ok::<(), outbox_diesel::InvalidTableName>(())
/// ```
#[derive(Debug)]
pub struct Outbox {
    table: OutboxTable,
    max_payload: usize,
    notify: Notify,
    channel: String,
    /// Milliseconds since [`epoch`] of the last notification, plus one (0 = never).
    last_notify: AtomicU64,
}

impl Clone for Outbox {
    fn clone(&self) -> Self {
        Outbox {
            table: self.table.clone(),
            max_payload: self.max_payload,
            notify: self.notify,
            channel: self.channel.clone(),
            last_notify: AtomicU64::new(self.last_notify.load(Ordering::Relaxed)),
        }
    }
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox::new(OutboxTable::DEFAULT)
    }
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl Outbox {
    /// An outbox in `table`, with the default limit and wake-up policy.
    pub fn new(table: OutboxTable) -> Self {
        let channel = table.channel();
        Outbox {
            table,
            max_payload: DEFAULT_MAX_PAYLOAD,
            notify: Notify::default(),
            channel,
            last_notify: AtomicU64::new(0),
        }
    }

    /// The outbox that [`OutboxExt::record_event`] and [`AsyncOutboxExt`](crate::AsyncOutboxExt)
    /// use: table `outbox`, 1 MiB payloads, debounced `NOTIFY`.
    pub fn global() -> &'static Outbox {
        static GLOBAL: OnceLock<Outbox> = OnceLock::new();
        GLOBAL.get_or_init(Outbox::default)
    }

    /// Refuses payloads whose JSON is longer than `bytes` (default 1 MiB, NATS's default
    /// `max_payload`; keep it at or below your server's).
    pub fn max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// Sets the wake-up policy (default [`Notify::Debounced`] 10 ms).
    pub fn notify(mut self, notify: Notify) -> Self {
        self.notify = notify;
        self
    }

    /// The table this outbox records into.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// Records `event` inside the transaction open on `conn`; returns its message id.
    ///
    /// Refuses with [`DieselError::NotInTransaction`] outside a transaction and with
    /// [`DieselError::SerializationError`] (holding an [`InvalidEvent`]) when the event
    /// cannot be serialised, its payload is over the limit, or its names are not subject
    /// tokens. Nothing is written when it refuses.
    pub fn record<C, E>(&self, conn: &mut C, event: &E) -> QueryResult<Uuid>
    where
        C: Connection<Backend = Pg>,
        E: OutboxEvent + ?Sized,
    {
        let batch = self.prepare(std::iter::once(event))?;
        ensure_in_transaction(C::TransactionManager::transaction_manager_status_mut(conn))?;
        let ids = batch.ids.clone();
        self.execute_sync(conn, batch)?;
        Ok(ids[0])
    }

    /// Records every event of `events` with one multi-row `INSERT`, in order; returns their
    /// message ids. Refuses as [`Outbox::record`] does, for the whole batch.
    pub fn record_all<C, E>(&self, conn: &mut C, events: &[E]) -> QueryResult<Vec<Uuid>>
    where
        C: Connection<Backend = Pg>,
        E: OutboxEvent,
    {
        let batch = self.prepare(events.iter())?;
        ensure_in_transaction(C::TransactionManager::transaction_manager_status_mut(conn))?;
        let ids = batch.ids.clone();
        if !ids.is_empty() {
            self.execute_sync(conn, batch)?;
        }
        Ok(ids)
    }

    fn execute_sync<C: Connection<Backend = Pg>>(
        &self,
        conn: &mut C,
        batch: InsertEvents,
    ) -> QueryResult<()> {
        let _span = tracing::debug_span!("outbox.record", outbox.table = %self.table, batch.len = batch.ids.len()).entered();
        batch.execute(conn)?;
        if self.notify_due() {
            NotifyQuery { channel: self.channel() }.execute(conn)?;
        }
        Ok(())
    }

    /// Turns events into the rows to insert, checking each one.
    pub(crate) fn prepare<'e, E, I>(&self, events: I) -> QueryResult<InsertEvents>
    where
        E: OutboxEvent + ?Sized + 'e,
        I: Iterator<Item = &'e E>,
    {
        let (lower, _) = events.size_hint();
        let mut batch = InsertEvents::with_capacity(self.table.clone(), lower);
        for event in events {
            let invalid = |reason| {
                DieselError::SerializationError(Box::new(InvalidEvent {
                    event_type: event.event_type().to_owned(),
                    reason,
                }))
            };
            let aggregate_type = event.aggregate_type();
            if let Err(e) = check_subject_token(aggregate_type) {
                return Err(invalid(Reason::AggregateType(aggregate_type.to_owned(), e)));
            }
            if let Err(e) = check_event_type(event.event_type()) {
                return Err(invalid(Reason::EventType(e)));
            }
            let aggregate_id = event.aggregate_id();
            if aggregate_id.is_empty() {
                return Err(invalid(Reason::EmptyAggregateId));
            }
            if aggregate_id.contains(['\r', '\n']) {
                return Err(invalid(Reason::LineBreakInAggregateId));
            }
            let payload = serde_json::to_string(event).map_err(|e| invalid(Reason::Json(e)))?;
            if payload.len() > self.max_payload {
                return Err(invalid(Reason::TooLarge { size: payload.len(), limit: self.max_payload }));
            }
            batch.ids.push(Uuid::now_v7());
            batch.aggregate_types.push(aggregate_type.to_owned());
            batch.aggregate_ids.push(aggregate_id);
            batch.event_types.push(event.event_type().to_owned());
            batch.payloads.push(payload);
            batch.headers.push(String::from("{}"));
        }
        Ok(batch)
    }

    /// Whether this recording should send a `NOTIFY`; claims the slot when it should.
    pub(crate) fn notify_due(&self) -> bool {
        match self.notify {
            Notify::Off => false,
            Notify::EveryTransaction => true,
            Notify::Debounced(interval) => {
                let now = epoch().elapsed().as_millis() as u64 + 1;
                let last = self.last_notify.load(Ordering::Relaxed);
                if last != 0 && now.saturating_sub(last) < interval.as_millis() as u64 {
                    return false;
                }
                self.last_notify
                    .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            }
        }
    }

    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }
}

pub(crate) fn ensure_in_transaction(
    status: &mut diesel::connection::TransactionManagerStatus,
) -> QueryResult<()> {
    match status.transaction_depth()? {
        Some(_) => Ok(()),
        None => Err(DieselError::NotInTransaction),
    }
}

/// Why an event was refused at record time. Found inside
/// [`diesel::result::Error::SerializationError`]; downcast to read it.
///
/// ```
/// # use outbox_diesel::InvalidEvent;
/// fn explain(e: &diesel::result::Error) -> Option<&InvalidEvent> {
///     match e {
///         diesel::result::Error::SerializationError(inner) => inner.downcast_ref(),
///         _ => None,
///     }
/// }
/// ```
#[derive(Debug, thiserror::Error)]
#[error("outbox event `{event_type}` refused: {reason}")]
pub struct InvalidEvent {
    event_type: String,
    #[source]
    reason: Reason,
}

impl InvalidEvent {
    /// The event type of the refused event.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// Whether it was refused for its size.
    pub fn is_too_large(&self) -> bool {
        matches!(self.reason, Reason::TooLarge { .. })
    }
}

#[derive(Debug, thiserror::Error)]
enum Reason {
    #[error("its payload is {size} bytes of JSON, over the outbox's limit of {limit}; store large data elsewhere and record a reference, or raise `Outbox::max_payload` (and the NATS server's max_payload)")]
    TooLarge { size: usize, limit: usize },
    #[error("its aggregate id is empty; every event needs the id of the aggregate it belongs to")]
    EmptyAggregateId,
    #[error("its aggregate id contains a line break, which cannot travel in the `Outbox-Aggregate-Id` header")]
    LineBreakInAggregateId,
    #[error("its aggregate type {0:?} cannot be a NATS subject token: it {1}")]
    AggregateType(String, crate::TokenError),
    #[error("its event type must be `.`-separated NATS subject tokens, but a part {0}")]
    EventType(crate::TokenError),
    #[error("its payload could not be serialised to JSON")]
    Json(#[source] serde_json::Error),
}

/// The multi-row insert: one statement with six array parameters, whatever the row count, so
/// that its prepared statement is cached.
#[derive(Debug)]
pub(crate) struct InsertEvents {
    table: OutboxTable,
    pub(crate) ids: Vec<Uuid>,
    aggregate_types: Vec<String>,
    aggregate_ids: Vec<String>,
    event_types: Vec<String>,
    payloads: Vec<String>,
    headers: Vec<String>,
}

impl InsertEvents {
    fn with_capacity(table: OutboxTable, n: usize) -> Self {
        InsertEvents {
            table,
            ids: Vec::with_capacity(n),
            aggregate_types: Vec::with_capacity(n),
            aggregate_ids: Vec::with_capacity(n),
            event_types: Vec::with_capacity(n),
            payloads: Vec::with_capacity(n),
            headers: Vec::with_capacity(n),
        }
    }
}

impl QueryId for InsertEvents {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for InsertEvents {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO ");
        self.table.walk_ast(&mut out)?;
        out.push_sql(
            " (id, aggregate_type, aggregate_id, event_type, payload, headers) \
             SELECT i, t, a, e, p::jsonb, h::jsonb FROM unnest(",
        );
        out.push_bind_param::<Array<SqlUuid>, _>(&self.ids)?;
        out.push_sql("::uuid[], ");
        out.push_bind_param::<Array<Text>, _>(&self.aggregate_types)?;
        out.push_sql("::text[], ");
        out.push_bind_param::<Array<Text>, _>(&self.aggregate_ids)?;
        out.push_sql("::text[], ");
        out.push_bind_param::<Array<Text>, _>(&self.event_types)?;
        out.push_sql("::text[], ");
        out.push_bind_param::<Array<Text>, _>(&self.payloads)?;
        out.push_sql("::text[], ");
        out.push_bind_param::<Array<Text>, _>(&self.headers)?;
        out.push_sql("::text[]) AS u(i, t, a, e, p, h)");
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for InsertEvents {}

/// `SELECT pg_notify($1, '')`.
#[derive(Debug)]
pub(crate) struct NotifyQuery<'a> {
    pub(crate) channel: &'a str,
}

impl QueryId for NotifyQuery<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for NotifyQuery<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("SELECT pg_notify(");
        out.push_bind_param::<Text, _>(self.channel)?;
        out.push_sql(", '')");
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for NotifyQuery<'_> {}

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

    /// Records `event` in `outbox` (another table, limit or wake-up policy).
    fn record_event_with<E: OutboxEvent + ?Sized>(
        &mut self,
        outbox: &Outbox,
        event: &E,
    ) -> QueryResult<Uuid>;

    /// Records `events` in `outbox` with one multi-row `INSERT`.
    fn record_events_with<E: OutboxEvent>(
        &mut self,
        outbox: &Outbox,
        events: &[E],
    ) -> QueryResult<Vec<Uuid>>;
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

    fn record_event_with<E: OutboxEvent + ?Sized>(
        &mut self,
        outbox: &Outbox,
        event: &E,
    ) -> QueryResult<Uuid> {
        outbox.record(self, event)
    }

    fn record_events_with<E: OutboxEvent>(
        &mut self,
        outbox: &Outbox,
        events: &[E],
    ) -> QueryResult<Vec<Uuid>> {
        outbox.record_all(self, events)
    }
}
