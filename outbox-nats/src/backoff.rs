//! [`Backoff`]: the one retry delay of the relay's modes, the consumer and the binary's first
//! connection.
//!
//! ```
//! use std::time::Duration;
//! use outbox_nats::backoff::Backoff;
//!
//! let mut b = Backoff::starting(Duration::from_millis(100), Duration::from_secs(5));
//! let first = b.next_delay();
//! assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
//! ```

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Capped exponential backoff with jitter: the `n`-th delay is drawn between half and all of
/// `first × 2^n` (at most the cap), so that relays cut off by one outage do not all
/// reconnect in the same instant when it ends.
#[derive(Debug)]
pub struct Backoff {
    first: Duration,
    next: Duration,
    cap: Duration,
}

impl Backoff {
    /// From 50 ms up to `cap`.
    pub fn new(cap: Duration) -> Self {
        Backoff::starting(Duration::from_millis(50), cap)
    }

    /// From `first` up to `cap`.
    pub fn starting(first: Duration, cap: Duration) -> Self {
        let first = first.min(cap);
        Backoff {
            first,
            next: first,
            cap,
        }
    }

    /// Starts over from the first delay (after a success).
    pub fn reset(&mut self) {
        self.next = self.first;
    }

    /// The next delay: between half and all of the current step, which then doubles.
    pub fn next_delay(&mut self) -> Duration {
        let step = self.next;
        self.next = (self.next * 2).min(self.cap);
        let half = step / 2;
        half + half.mul_f64(unit_random())
    }

    /// Sleeps for the next delay; `false` when shut down meanwhile.
    pub async fn sleep(&mut self, shutdown: &CancellationToken) -> bool {
        let d = self.next_delay();
        tokio::select! {
            _ = tokio::time::sleep(d) => true,
            _ = shutdown.cancelled() => false,
        }
    }
}

/// A number in `[0, 1)`, different in every call and every process: the standard library's
/// randomly keyed hasher, which is enough for spreading retries (and the relays' statistics).
pub(crate) fn unit_random() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_within_half_and_all_of_each_step() {
        let mut b = Backoff::starting(Duration::from_millis(100), Duration::from_millis(800));
        for step in [100u64, 200, 400, 800, 800, 800] {
            let d = b.next_delay();
            let step = Duration::from_millis(step);
            assert!(d >= step / 2 && d <= step, "{d:?} outside {step:?}");
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn relays_retrying_together_spread_their_delays() {
        // a hundred relays cut off by one outage: their first retries must not coincide
        let delays: std::collections::HashSet<Duration> = (0..100)
            .map(|_| Backoff::starting(Duration::from_secs(1), Duration::from_secs(5)).next_delay())
            .collect();
        assert!(delays.len() > 90, "{} distinct delays of 100", delays.len());
        let (min, max) = (
            delays.iter().min().copied().unwrap_or_default(),
            delays.iter().max().copied().unwrap_or_default(),
        );
        assert!(
            max - min > Duration::from_millis(250),
            "spread {min:?}..{max:?}"
        );
    }
}
