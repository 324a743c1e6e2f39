//! Recording events inside the caller's transaction: the [`Outbox`] (table, payload limit,
//! wake-up policy) and its recording on a synchronous connection. Beside it: checking events
//! into rows (`prepare.rs`, with [`InvalidEvent`]), the statements written (`sql.rs`), and
//! [`OutboxExt`] (`ext.rs`); with the `async` feature,
//! [`AsyncOutboxExt`](crate::AsyncOutboxExt) in `record_async.rs`.

mod ext;
mod prepare;
mod sql;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diesel::connection::TransactionManager;
use diesel::pg::Pg;
use diesel::result::Error as DieselError;
use diesel::{Connection, QueryResult, RunQueryDsl};
use uuid::Uuid;

use crate::headers::HeadersHook;
use crate::{EventHeaders, OutboxEvent, OutboxTable};

pub use ext::OutboxExt;
pub use prepare::InvalidEvent;
pub(crate) use sql::InsertEvents;
use sql::{DeleteEvents, NotifyQuery, Statement};

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
