//! What the relay is doing, for `/healthz` and `/readyz`: the engine, its modes and the
//! publishing pipeline record it; the admin server reads it.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// What the relay is doing, for `/healthz` and `/readyz`.
#[derive(Debug, Default)]
pub struct Health {
    pub(crate) started: AtomicBool,
    pub(crate) database_ok: AtomicBool,
    pub(crate) owned: AtomicUsize,
    pub(crate) standby: AtomicUsize,
    pub(crate) nats: std::sync::OnceLock<async_nats::Client>,
    /// When the relay last showed progress ([`Health::progressed`]), in milliseconds since
    /// [`clock`].
    progress_ms: AtomicU64,
    /// How long the relay may own work without progress before it is not ready (0: forever).
    pub(crate) stuck_after_ms: AtomicU64,
    /// JetStream refused the last message for a reason of the stream's, and no ack came since.
    pub(crate) stream_refused: AtomicBool,
}

/// Milliseconds since the first call: the clock of [`Health`]'s progress.
fn clock() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

impl Health {
    /// Ready: started, connected to PostgreSQL and to NATS, and owning a partition (or the
    /// slot, or running workers) or standing by for one.
    pub fn ready(&self) -> bool {
        self.not_ready_because().is_none()
    }

    /// Why the relay is not ready, or `None` when it is.
    pub fn not_ready_because(&self) -> Option<&'static str> {
        if !self.started.load(Ordering::Relaxed) {
            Some("starting: checking the table and the stream")
        } else if !self.database_ok.load(Ordering::Relaxed) {
            Some("PostgreSQL is not reachable")
        } else if !self.nats_connected() {
            Some("NATS is not connected")
        } else if self.owned.load(Ordering::Relaxed) + self.standby.load(Ordering::Relaxed) == 0 {
            Some("neither owning work nor standing by")
        } else if self.stream_refused.load(Ordering::Relaxed) {
            Some(
                "JetStream refuses to store messages in the stream (a limit reached with discard new, storage or account limits, a sealed stream); see the relay's log",
            )
        } else if self.stuck() {
            Some(
                "stuck: it owns work, and no event was acked and no poll found it caught up within --stall-after",
            )
        } else {
            None
        }
    }

    /// Owning work without progress for longer than `--stall-after`: a relay blocked on NATS
    /// (or anything else) while rows wait must not look healthy.
    fn stuck(&self) -> bool {
        let after = self.stuck_after_ms.load(Ordering::Relaxed);
        after > 0
            && self.owned.load(Ordering::Relaxed) > 0
            && clock().saturating_sub(self.progress_ms.load(Ordering::Relaxed)) > after
    }

    /// Records progress: an ack arrived, a poll found nothing left to publish, or the relay
    /// stands by.
    pub(crate) fn progressed(&self) {
        self.progress_ms.store(clock(), Ordering::Relaxed);
    }

    /// Whether the NATS connection is up (`true` for a relay built without a client).
    pub fn nats_connected(&self) -> bool {
        self.nats
            .get()
            .is_none_or(|c| c.connection_state() == async_nats::connection::State::Connected)
    }

    /// Partitions this relay owns now (ordered mode), or workers connected (unordered).
    pub fn owned_partitions(&self) -> usize {
        self.owned.load(Ordering::Relaxed)
    }
}
