//! When an idle relay reads again: a writer's `NOTIFY`, its poll, or the reads within its
//! linger after a read that found rows.

use std::time::{Duration, Instant};

use diesel::pg::PgNotification;
use diesel_async::AsyncPgConnection;
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::RelayConfig;

/// Waits for a `NOTIFY`, the next look ([`next_look`]), or shutdown. Returns the notification
/// that woke it, if one did: a writer's (when the relay listens for them) or, in ordered mode,
/// another relay's on the members' channel.
pub(crate) async fn idle(
    conn: &mut AsyncPgConnection,
    cfg: &RelayConfig,
    shutdown: &CancellationToken,
    until: Instant,
    found: Option<Instant>,
) -> Option<PgNotification> {
    let deadline = next_look(Instant::now(), cfg, until, found);
    sleep_or_notified(conn, shutdown, deadline).await
}

/// When an idle relay reads again, `now`: after the poll interval, but not past `until`;
/// within [`RelayConfig::linger`] of `found` (the last read that found rows), after a tenth of
/// the linger (1 ms at least): a debounced writer notified only the first of the commits that
/// may follow, and under a steady stream of commits each waits for the next of these reads
/// (at 1,000 commits a second, p99 commit-to-ack 3.1-4.7 ms in 8 runs of 9 with a tenth,
/// 4.3-5.9 with a fifth; BENCHMARKS.md section 32).
fn next_look(now: Instant, cfg: &RelayConfig, until: Instant, found: Option<Instant>) -> Instant {
    let deadline = (now + cfg.poll_interval).min(until.max(now));
    match found {
        Some(found) if now < found + cfg.linger => deadline.min(now + linger_step(cfg)),
        _ => deadline,
    }
}

/// How often a relay reads within its linger: a tenth of it, 1 ms at least.
pub(crate) fn linger_step(cfg: &RelayConfig) -> Duration {
    (cfg.linger / 10).max(Duration::from_millis(1))
}

/// Waits until `deadline`, a notification on a channel this session listens on (none comes
/// when it listens on none), or shutdown; returns the notification that woke it, if one did.
/// A connection that failed ends its notifications: then it waits for the deadline, and the
/// session's next statement reports the failure.
pub(crate) async fn sleep_or_notified(
    conn: &mut AsyncPgConnection,
    shutdown: &CancellationToken,
    deadline: Instant,
) -> Option<PgNotification> {
    let sleep = tokio::time::sleep_until(deadline.into());
    let mut sleep = std::pin::pin!(sleep);
    let mut notes = std::pin::pin!(conn.notifications_stream());
    let mut open = true;
    loop {
        tokio::select! {
            _ = &mut sleep => return None,
            note = notes.next(), if open => match note {
                Some(Ok(note)) => return Some(note),
                Some(Err(_)) => {}
                None => open = false,
            },
            _ = shutdown.cancelled() => return None,
        }
    }
}

/// Within the linger after rows were found (`found`), whether this read is its first, which
/// runs at once (remembered in `lingered`, the last such read); the later ones ask PostgreSQL
/// first whether a transaction ended, as a poll does: under a steady stream the first finds
/// rows and the linger starts again, and with commits further apart most of them find nothing,
/// while a read (an ordered relay's batch statement, an unordered worker's claim) costs
/// PostgreSQL several times the question. `None` past the linger.
pub(crate) fn lingering_read(
    cfg: &RelayConfig,
    found: Option<Instant>,
    lingered: &mut Option<Instant>,
) -> Option<bool> {
    let found = found.filter(|f| f.elapsed() < cfg.linger)?;
    if lingered.is_none_or(|l| l < found) {
        *lingered = Some(Instant::now());
        Some(true)
    } else {
        Some(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_relay_looks_again_within_a_tenth_of_its_linger_after_rows() {
        let ms = Duration::from_millis;
        let cfg = RelayConfig::new("postgres://localhost/app")
            .poll_interval(ms(100))
            .linger(ms(10));
        let now = Instant::now();
        let far = now + Duration::from_secs(60);
        // nothing found lately: the poll interval, or `until` when sooner
        assert_eq!(next_look(now, &cfg, far, None), now + ms(100));
        assert_eq!(next_look(now, &cfg, now + ms(30), None), now + ms(30));
        assert_eq!(next_look(now, &cfg, now - ms(5), None), now);
        // rows found within the linger: a tenth of it
        assert_eq!(next_look(now, &cfg, far, Some(now)), now + ms(1));
        assert_eq!(next_look(now, &cfg, far, Some(now - ms(9))), now + ms(1));
        // past the linger
        assert_eq!(next_look(now, &cfg, far, Some(now - ms(10))), now + ms(100));
        let long = cfg.clone().linger(ms(50));
        assert_eq!(next_look(now, &long, far, Some(now - ms(20))), now + ms(5));
        // never less than a millisecond, and off with no linger
        let short = cfg.clone().linger(ms(4));
        assert_eq!(next_look(now, &short, far, Some(now)), now + ms(1));
        let off = cfg.linger(Duration::ZERO);
        assert_eq!(next_look(now, &off, far, Some(now)), now + ms(100));
    }
}
