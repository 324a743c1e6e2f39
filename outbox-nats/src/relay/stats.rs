//! The relay's statistics task: the backlog, stall and duplicate-window gauges, refreshed
//! every `stats_interval` on a session of its own (JIT off, `application_name`
//! `outbox-relay-stats`), so that a slow statistics query never holds up publishing; the
//! first time at a random point of the first interval.

use std::sync::Arc;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use outbox_diesel::relay as db;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::metrics as m;
use crate::{Health, RelayConfig};

/// Refreshes the backlog gauges (per partition too when partitioned), the connection and
/// readiness gauges, and warns on a stall or a backlog older than the stream's duplicate
/// window.
pub(super) async fn stats(
    cfg: Arc<RelayConfig>,
    health: Arc<Health>,
    duplicate_window: Duration,
    shutdown: CancellationToken,
) {
    let mut conn: Option<AsyncPgConnection> = None;
    // the first pass at a random point of the first interval: each pass reads every
    // unpublished row, and relays started together (a fleet restarted on a backlog of
    // millions) read it all at once, each of them, when the database is busiest
    let first = cfg.stats_interval.mul_f64(crate::backoff::unit_random());
    let mut tick =
        tokio::time::interval_at(tokio::time::Instant::now() + first, cfg.stats_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let partitions = cfg.mode.partitions();
    let partitioned = partitions > 1;
    let window = duplicate_window.as_secs_f64();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        metrics::gauge!(m::NATS_CONNECTED).set(if health.nats_connected() { 1.0 } else { 0.0 });
        metrics::gauge!(m::READY).set(if health.ready() { 1.0 } else { 0.0 });
        if conn.is_none() {
            conn = match outbox_diesel::connect(&cfg.database_url).await {
                Ok(mut c) => match db::prepare_side_session(&mut c).await {
                    Ok(()) => db::set_application_name(&mut c, "outbox-relay-stats")
                        .await
                        .ok()
                        .map(|()| c),
                    Err(_) => None,
                },
                Err(_) => None,
            };
        }
        let Some(c) = conn.as_mut() else { continue };
        // one snapshot for the table and its partitions, the partitions' gauges set first: a
        // scrape never sees a total its partitions do not add up to
        let read = if partitioned {
            db::backlogs(c, &cfg.table, partitions)
                .await
                .map(|(b, parts)| (b, Some(parts)))
        } else {
            db::backlog(c, &cfg.table).await.map(|b| (b, None))
        };
        match read {
            Ok((b, parts)) => {
                for p in parts.into_iter().flatten() {
                    let label = p.partition.to_string();
                    metrics::gauge!(m::PARTITION_BACKLOG_ROWS, "partition" => label.clone())
                        .set(p.unpublished as f64);
                    metrics::gauge!(m::PARTITION_OLDEST_AGE, "partition" => label)
                        .set(p.oldest_age_seconds);
                }
                metrics::gauge!(m::BACKLOG_ROWS).set(b.unpublished as f64);
                metrics::gauge!(m::OLDEST_AGE).set(b.oldest_age_seconds);
                metrics::gauge!(m::PARKED_ROWS).set(b.parked as f64);
                metrics::gauge!(m::IN_DOUBT_ROWS).set(b.in_doubt as f64);
                metrics::gauge!(m::OLDEST_IN_DOUBT_AGE).set(b.oldest_in_doubt_age_seconds);
                let stalled = b.oldest_age_seconds > cfg.stall_after.as_secs_f64();
                metrics::gauge!(m::STALLED).set(if stalled { 1.0 } else { 0.0 });
                if stalled && health.owned_partitions() > 0 {
                    warn!(
                        oldest_age_seconds = b.oldest_age_seconds,
                        backlog = b.unpublished,
                        "outbox backlog is stalled: its oldest row waits longer than --stall-after"
                    );
                }
                // an in-doubt row may already be in the stream: once older than the window, JetStream
                // no longer drops its re-publish, so the relay looks it up first (`reconcile`)
                let beyond =
                    b.oldest_age_seconds > window || b.oldest_in_doubt_age_seconds > window;
                metrics::gauge!(m::BEYOND_DUPLICATE_WINDOW).set(if beyond { 1.0 } else { 0.0 });
                if beyond {
                    warn!(
                        oldest_age_seconds = b.oldest_age_seconds,
                        in_doubt = b.in_doubt,
                        oldest_in_doubt_age_seconds = b.oldest_in_doubt_age_seconds,
                        duplicate_window = ?duplicate_window,
                        "unpublished or in-doubt rows are older than the stream's duplicate window: JetStream would not drop a re-publish of them, so each is looked up in the stream before it is sent (outbox_events_reconciled_total counts those found)"
                    );
                }
            }
            Err(e) => {
                debug!(error = %e, "backlog query failed");
                conn = None;
                continue;
            }
        }
    }
}
