//! The relay's lease on its database session.
//!
//! A relay owns its partitions (or its claimed rows) through its PostgreSQL session: advisory
//! locks and row locks last as long as the session. A relay that is paused (SIGSTOP, a long
//! GC-like stall, a frozen VM) keeps its TCP connection, so PostgreSQL would keep its locks
//! forever. Two settings bound that:
//!
//! - the session is opened with `idle_session_timeout` and
//!   `idle_in_transaction_session_timeout` equal to the lease, so PostgreSQL ends a session
//!   that has sent nothing for that long, and its locks pass to another relay;
//! - the relay publishes only while its last successful query is younger than half the lease
//!   ([`Lease::is_valid`]), so a relay that wakes up after a pause stops before sending
//!   anything a new owner may have taken over.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use diesel_async::AsyncPgConnection;
use outbox_diesel::relay as db;

/// When the session last proved alive. Shared by the task that queries and the one that
/// publishes, hence the lock.
#[derive(Debug)]
pub(crate) struct Lease {
    duration: Duration,
    confirmed: Mutex<Option<Instant>>,
}

impl Lease {
    pub(crate) fn new(duration: Duration) -> Self {
        Lease {
            duration,
            confirmed: Mutex::new(None),
        }
    }

    /// Records that a query that started at `at` succeeded.
    pub(crate) fn confirm(&self, at: Instant) {
        let mut confirmed = self.confirmed.lock().unwrap_or_else(|e| e.into_inner());
        // queries overlap: keep the latest start that succeeded
        if confirmed.is_none_or(|t| t < at) {
            *confirmed = Some(at);
        }
    }

    /// Whether the relay may still publish: its session answered within half the lease.
    pub(crate) fn is_valid(&self) -> bool {
        self.confirmed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|t| t.elapsed() < self.duration / 2)
    }

    /// Runs `work` while keeping `conn`'s session, and the transaction it may be in, clear of
    /// the idle timeouts of [`Lease::configure`]: whenever work is still pending a third of the
    /// lease after the session last answered, a `SELECT 1` confirms the lease. A relay that
    /// waits for slow acks (or look-ups) while it holds claimed rows, partitions or a slot
    /// keeps them; a paused relay sends nothing and still loses them after the lease.
    ///
    /// Work that is done at its first poll costs no timer: the hot path sends a row this way.
    pub(crate) async fn keep_alive<T>(
        &self,
        conn: &mut AsyncPgConnection,
        work: impl std::future::Future<Output = T>,
    ) -> diesel::QueryResult<T> {
        let mut work = std::pin::pin!(work);
        if let std::task::Poll::Ready(out) =
            std::future::poll_fn(|cx| std::task::Poll::Ready(work.as_mut().poll(cx))).await
        {
            return Ok(out);
        }
        loop {
            let due = self.renewal_due();
            tokio::select! {
                biased;
                out = &mut work => return Ok(out),
                _ = tokio::time::sleep_until(due.into()) => self.renew(conn).await?,
            }
        }
    }

    /// When the session should be queried next: a third of the lease after it last answered
    /// (at once when it never did).
    fn renewal_due(&self) -> Instant {
        let confirmed = *self.confirmed.lock().unwrap_or_else(|e| e.into_inner());
        confirmed.map_or_else(Instant::now, |t| t + self.duration / 3)
    }

    /// Queries the session now: its answer confirms the lease from the moment it was asked.
    pub(crate) async fn renew(&self, conn: &mut AsyncPgConnection) -> diesel::QueryResult<()> {
        let started = Instant::now();
        db::keep_alive(conn).await?;
        self.confirm(started);
        Ok(())
    }

    /// Queries the session when a third of the lease has passed since it last answered, so
    /// that a relay whose other queries are rarer than the lease keeps its session.
    pub(crate) async fn renew_if_due(
        &self,
        conn: &mut AsyncPgConnection,
    ) -> diesel::QueryResult<()> {
        if self.renewal_due() <= Instant::now() {
            self.renew(conn).await?;
        }
        Ok(())
    }

    /// Sets the session timeouts that end a silent session after the lease.
    pub(crate) async fn configure(&self, conn: &mut AsyncPgConnection) -> diesel::QueryResult<()> {
        // the settings first: the statements after them are planned without JIT
        db::prepare_session(conn).await?;
        db::set_application_name(conn, "outbox-relay").await?;
        if !db::set_lease_timeouts(conn, self.duration).await? {
            tracing::warn!(
                "the server has no idle_session_timeout (PostgreSQL < 14): a paused relay keeps its partitions until its connection drops"
            );
        }
        Ok(())
    }
}
