//! Recording events inside the caller's transaction: [`Outbox`], [`OutboxExt`] and, with the
//! `async` feature, [`AsyncOutboxExt`](crate::AsyncOutboxExt).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diesel::connection::TransactionManager;
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::result::Error as DieselError;
use diesel::sql_types::{Array, Text, Uuid as SqlUuid};
use diesel::{Connection, QueryResult, RunQueryDsl};
use uuid::Uuid;

use crate::event::{MAX_SUBJECT_NAMES_LEN, subject_names_len};
use crate::headers::HeadersHook;
use crate::wire::{jsonb_text, message_size};
use crate::{EventHeaders, OutboxEvent, OutboxTable, check_event_type, check_subject_token};

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
/// it to [`OutboxExt::record_event_in`].
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
    delete_after_insert: bool,
    headers_hook: Option<HeadersHook>,
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
            delete_after_insert: self.delete_after_insert,
            headers_hook: self.headers_hook.clone(),
            last_notify: AtomicU64::new(self.last_notify.load(Ordering::Relaxed)),
        }
    }
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox::new(OutboxTable::DEFAULT)
    }
}

/// The outbox of [`Outbox::global`].
static GLOBAL: OnceLock<Outbox> = OnceLock::new();

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
            delete_after_insert: false,
            headers_hook: None,
            last_notify: AtomicU64::new(0),
        }
    }

    /// The outbox that [`OutboxExt::record_event`] and [`AsyncOutboxExt`](crate::AsyncOutboxExt)
    /// use: table `outbox`, 1 MiB payloads, debounced `NOTIFY`, unless [`Outbox::set_global`]
    /// replaced it.
    pub fn global() -> &'static Outbox {
        GLOBAL.get_or_init(Outbox::default)
    }

    /// Makes `outbox` the one [`OutboxExt::record_event`] and
    /// [`AsyncOutboxExt`](crate::AsyncOutboxExt) use, e.g. with a [`Outbox::headers_from`]
    /// hook that records the current trace. Call it once at start-up, before the first
    /// recording; it gives `outbox` back when the default outbox is already set or in use.
    ///
    /// ```
    /// use outbox_diesel::{EventHeaders, Outbox};
    ///
    /// let outbox = Outbox::default().headers_from(|| EventHeaders::new().with("service", "shop"));
    /// if Outbox::set_global(outbox).is_err() {
    ///     eprintln!("the default outbox was already in use");
    /// }
    /// ```
    #[allow(clippy::result_large_err)] // gives the outbox back whole, as `OnceLock::set` does
    pub fn set_global(outbox: Outbox) -> Result<(), Outbox> {
        GLOBAL.set(outbox)
    }

    /// Asks `hook` for headers at every recording of this outbox and stores them with each
    /// event (headers passed to [`Outbox::record_with_headers`] win over the hook's). The
    /// relay sends them as NATS headers.
    ///
    /// Its use: the W3C `traceparent` of the current span, so that a consumer's span joins the
    /// producer's trace. The hook keeps this crate free of any tracing backend; with
    /// `tracing-opentelemetry` it reads the current span's context (see the README,
    /// "Tracing"). A hook that has nothing to add returns [`EventHeaders::new`].
    ///
    /// ```
    /// use outbox_diesel::{EventHeaders, Outbox};
    ///
    /// fn current_traceparent() -> Option<String> {
    ///     // e.g. from tracing-opentelemetry: Span::current().context().span().span_context()
    ///     None
    /// }
    ///
    /// let outbox = Outbox::default().headers_from(|| {
    ///     current_traceparent().map(EventHeaders::traceparent).unwrap_or_default()
    /// });
    /// # let _ = outbox;
    /// ```
    pub fn headers_from(mut self, hook: impl Fn() -> EventHeaders + Send + Sync + 'static) -> Self {
        self.headers_hook = Some(HeadersHook(std::sync::Arc::new(hook)));
        self
    }

    /// Refuses events whose message would be longer than `bytes` (default 1 MiB, NATS's
    /// default `max_payload`; keep it at or below your server's). What counts is what NATS
    /// counts: the payload as PostgreSQL renders it from `jsonb` ([`jsonb_text`](crate::jsonb_text):
    /// `", "` and `": "` separators, numbers in plain decimal) plus the NATS headers the relay
    /// sends ([`message_size`](crate::message_size)).
    pub fn max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// Sets the wake-up policy (default [`Notify::Debounced`] 10 ms).
    pub fn notify(mut self, notify: Notify) -> Self {
        self.notify = notify;
        self
    }

    /// For the `log-tailing` relay only: delete each recorded row again right after
    /// inserting it, in the same transaction (default off).
    ///
    /// The log-tailing relay reads the INSERT from the WAL, where it stays after the DELETE,
    /// and ignores deletes, so every event is still delivered while the table stays empty:
    /// no cleanup, no bloat beyond what vacuum reclaims. A polling relay (`ordered`,
    /// `unordered`) never sees such rows: use it with log tailing alone. The DELETE is a
    /// second statement (a data-modifying `WITH` cannot see the rows its sibling inserts).
    ///
    /// ```
    /// let outbox = outbox_diesel::Outbox::default().delete_after_insert(true);
    /// # let _ = outbox;
    /// ```
    pub fn delete_after_insert(mut self, on: bool) -> Self {
        self.delete_after_insert = on;
        self
    }

    /// Whether rows are deleted right after they are inserted (see
    /// [`Outbox::delete_after_insert`]).
    pub fn deletes_after_insert(&self) -> bool {
        self.delete_after_insert
    }

    /// The table this outbox records into.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// Records `event` inside the transaction open on `conn`; returns its message id.
    ///
    /// Refuses with [`DieselError::NotInTransaction`] outside a transaction and with
    /// [`DieselError::SerializationError`] (holding an [`InvalidEvent`]) when the event
    /// cannot be serialised, its payload is over the limit, its names are not subject tokens,
    /// or they take more than [`MAX_SUBJECT_NAMES_LEN`](crate::MAX_SUBJECT_NAMES_LEN) bytes
    /// in the subject. Nothing is written when it refuses.
    pub fn record<C, E>(&self, conn: &mut C, event: &E) -> QueryResult<Uuid>
    where
        C: Connection<Backend = Pg>,
        E: OutboxEvent + ?Sized,
    {
        self.record_with_headers(conn, event, &EventHeaders::new())
    }

    /// Records `event` with `headers` (and those of the [`Outbox::headers_from`] hook, which
    /// `headers` override) inside the transaction open on `conn`; returns its message id.
    /// The relay sends every header as a NATS header of the event's message. Refuses as
    /// [`Outbox::record`] does, and when a header is invalid (see [`EventHeaders`]).
    ///
    /// ```
    /// use diesel::prelude::*;
    /// use outbox_diesel::{EventHeaders, Outbox, OutboxEvent};
    /// # #[derive(serde::Serialize, OutboxEvent)]
    /// # #[outbox(aggregate_type = "order", event_type = "order.placed")]
    /// # struct OrderPlaced { #[outbox(aggregate_id)] order_id: i64 }
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// # let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into());
    /// # let mut conn = PgConnection::establish(&url)?;
    /// # let conn = &mut conn;
    /// # conn.begin_test_transaction()?;
    /// # outbox_diesel::create_table(conn, &outbox_diesel::OutboxTable::DEFAULT)?;
    /// let trace = EventHeaders::traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    /// conn.transaction(|conn| {
    ///     Outbox::global().record_with_headers(conn, &OrderPlaced { order_id: 7 }, &trace)
    /// })?;
    /// # Ok(()) }
    /// ```
    pub fn record_with_headers<C, E>(
        &self,
        conn: &mut C,
        event: &E,
        headers: &EventHeaders,
    ) -> QueryResult<Uuid>
    where
        C: Connection<Backend = Pg>,
        E: OutboxEvent + ?Sized,
    {
        let batch = self.prepare(std::iter::once(event), headers)?;
        Ok(self.execute(conn, batch)?[0])
    }

    /// Records every event of `events` with one multi-row `INSERT`, in order; returns their
    /// message ids. Refuses as [`Outbox::record`] does, for the whole batch.
    pub fn record_all<C, E>(&self, conn: &mut C, events: &[E]) -> QueryResult<Vec<Uuid>>
    where
        C: Connection<Backend = Pg>,
        E: OutboxEvent,
    {
        self.record_all_with_headers(conn, events, &EventHeaders::new())
    }

    /// [`Outbox::record_all`] with `headers` on every event (see
    /// [`Outbox::record_with_headers`]).
    pub fn record_all_with_headers<C, E>(
        &self,
        conn: &mut C,
        events: &[E],
        headers: &EventHeaders,
    ) -> QueryResult<Vec<Uuid>>
    where
        C: Connection<Backend = Pg>,
        E: OutboxEvent,
    {
        let batch = self.prepare(events.iter(), headers)?;
        self.execute(conn, batch)
    }

    /// Runs the statements of a prepared batch on a synchronous connection (the async twin is
    /// `execute_async`; both only run what [`Outbox::statements`] decides).
    fn execute<C: Connection<Backend = Pg>>(
        &self,
        conn: &mut C,
        batch: InsertEvents,
    ) -> QueryResult<Vec<Uuid>> {
        ensure_in_transaction(C::TransactionManager::transaction_manager_status_mut(conn))?;
        let ids = batch.ids.clone();
        for statement in self.statements(batch) {
            statement.execute(conn)?;
        }
        Ok(ids)
    }

    /// The statements that record a prepared batch, in order: the insert, the delete of
    /// [`Outbox::delete_after_insert`], the wake-up when one is due. Called once the caller's
    /// transaction is checked, so that a refused call claims no wake-up. The one place that
    /// decides what recording writes, for sync and async connections alike.
    pub(crate) fn statements(&self, batch: InsertEvents) -> Vec<Statement<'_>> {
        if batch.ids.is_empty() {
            return Vec::new();
        }
        tracing::debug!(outbox.table = %self.table, batch.len = batch.ids.len(), "outbox.record");
        let mut statements = Vec::with_capacity(3);
        let delete = self.delete_after_insert.then(|| batch.ids.clone());
        statements.push(Statement::Insert(batch));
        if let Some(ids) = delete {
            statements.push(Statement::Delete(DeleteEvents {
                table: &self.table,
                ids,
            }));
        }
        if self.notify_due() {
            statements.push(Statement::Notify(NotifyQuery {
                channel: &self.channel,
            }));
        }
        statements
    }

    /// Turns events into the rows to insert, checking each one; every row gets the hook's
    /// headers with `extra` over them.
    pub(crate) fn prepare<'e, E, I>(
        &self,
        events: I,
        extra: &EventHeaders,
    ) -> QueryResult<InsertEvents>
    where
        E: OutboxEvent + ?Sized + 'e,
        I: Iterator<Item = &'e E>,
    {
        let headers = match &self.headers_hook {
            Some(hook) => {
                let mut h = (hook.0)();
                h.merge(extra);
                std::borrow::Cow::Owned(h)
            }
            None => std::borrow::Cow::Borrowed(extra),
        };
        let headers_checked = headers.check();
        let headers_json = headers.to_json();
        let (lower, _) = events.size_hint();
        let mut batch = InsertEvents::with_capacity(self.table.clone(), lower);
        for event in events {
            let invalid = |reason| {
                DieselError::SerializationError(Box::new(InvalidEvent {
                    event_type: event.event_type().to_owned(),
                    reason,
                }))
            };
            if let Err((name, why)) = &headers_checked {
                return Err(invalid(Reason::Header(name.clone(), why)));
            }
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
            let names = subject_names_len(aggregate_type, &aggregate_id, event.event_type());
            if names > MAX_SUBJECT_NAMES_LEN {
                return Err(invalid(Reason::SubjectTooLong {
                    size: names,
                    limit: MAX_SUBJECT_NAMES_LEN,
                }));
            }
            let payload = jsonb_text(event).map_err(|e| invalid(Reason::Json(e)))?;
            let size = message_size(
                payload.len(),
                aggregate_type,
                &aggregate_id,
                event.event_type(),
                headers.as_ref(),
            );
            if size > self.max_payload {
                return Err(invalid(Reason::TooLarge {
                    size,
                    limit: self.max_payload,
                }));
            }
            batch.ids.push(Uuid::now_v7());
            batch.aggregate_types.push(aggregate_type.to_owned());
            batch.aggregate_ids.push(aggregate_id);
            batch.event_types.push(event.event_type().to_owned());
            batch.payloads.push(payload);
            batch.headers.push(headers_json.clone());
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
    #[error(
        "its message is {size} bytes (the JSON as PostgreSQL renders it from jsonb, plus the NATS headers the relay sends), over the outbox's limit of {limit}; store large data elsewhere and record a reference, or raise `Outbox::max_payload` (and the NATS server's max_payload)"
    )]
    TooLarge { size: usize, limit: usize },
    #[error(
        "its aggregate type, aggregate id and event type take {size} bytes in the subject once percent-encoded (every byte other than an ASCII letter, digit, `-`, `_` or `~` takes three), over the limit of {limit} (outbox_diesel::MAX_SUBJECT_NAMES_LEN), past which a subject can exceed the NATS server's control-line limit; use a shorter aggregate id, such as a surrogate key or a hash of the natural one"
    )]
    SubjectTooLong { size: usize, limit: usize },
    #[error("its aggregate id is empty; every event needs the id of the aggregate it belongs to")]
    EmptyAggregateId,
    #[error(
        "its aggregate id contains a line break, which cannot travel in the `Outbox-Aggregate-Id` header"
    )]
    LineBreakInAggregateId,
    #[error("its aggregate type {0:?} cannot be a NATS subject token: it {1}")]
    AggregateType(String, crate::TokenError),
    #[error("its event type must be `.`-separated NATS subject tokens, but a part {0}")]
    EventType(crate::TokenError),
    #[error("its payload could not be serialised to JSON")]
    Json(#[source] serde_json::Error),
    #[error("its header {0:?} cannot be recorded: {1}")]
    Header(String, &'static str),
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

/// `DELETE FROM table WHERE id = ANY($1)`: the second half of
/// [`Outbox::delete_after_insert`].
#[derive(Debug)]
pub(crate) struct DeleteEvents<'a> {
    table: &'a OutboxTable,
    ids: Vec<Uuid>,
}

impl QueryId for DeleteEvents<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for DeleteEvents<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("DELETE FROM ");
        self.table.walk_ast(&mut out)?;
        out.push_sql(" WHERE id = ANY(");
        out.push_bind_param::<Array<SqlUuid>, _>(&self.ids)?;
        out.push_sql(")");
        Ok(())
    }
}

/// `SELECT pg_notify($1, '')`.
#[derive(Debug)]
pub(crate) struct NotifyQuery<'a> {
    channel: &'a str,
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

/// One statement of a recording (see [`Outbox::statements`]).
#[derive(Debug)]
pub(crate) enum Statement<'a> {
    Insert(InsertEvents),
    Delete(DeleteEvents<'a>),
    Notify(NotifyQuery<'a>),
}

impl QueryId for Statement<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for Statement<'_> {
    fn walk_ast<'b>(&'b self, out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        match self {
            Statement::Insert(q) => q.walk_ast(out),
            Statement::Delete(q) => q.walk_ast(out),
            Statement::Notify(q) => q.walk_ast(out),
        }
    }
}

impl<Conn> RunQueryDsl<Conn> for Statement<'_> {}

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
