//! Cleanup for the polling modes: published rows older than the retention are deleted (or
//! moved to an archive table) in bounded batches, on a schedule, from a connection of its own.
//!
//! The poll reads the partial index of unpublished rows, so published rows cost it nothing
//! until they pile up as dead index entries and table bloat; cleanup keeps the table to about
//! the rows of one retention period. Each batch is one short statement that locks only the
//! rows it deletes and skips rows locked by another cleaner (`FOR UPDATE SKIP LOCKED`), so
//! every relay may run it: two cleaners share the work instead of waiting on each other, and
//! the publish path, which never touches published rows, never waits on either.
//!
//! On a rotated table ([`outbox_diesel::partition_table`]) a partition whose every row is past
//! the retention goes first, whole, by one `TRUNCATE` ([`outbox_diesel::relay::truncate_expired`]);
//! rows go one by one only in the partition being filled.

use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::QueryResult;
use diesel_async::AsyncPgConnection;
use outbox_diesel::OutboxTable;
use outbox_diesel::relay as db;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::RelayConfig;
use crate::metrics as m;

/// Deletes (or archives into `archive`) every row of `table` published more than `retention`
/// ago, `batch` rows per statement, until none is left or `shutdown` is cancelled; returns how
/// many it removed one by one. Each batch counts in `outbox_cleanup_rows_deleted_total`. A
/// rotated table's partitions past the retention are emptied first, without an archive (each
/// counts in `outbox_cleanup_partitions_truncated_total`, not in the rows returned).
pub async fn sweep(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    archive: Option<&OutboxTable>,
    retention: Duration,
    batch: usize,
    shutdown: &CancellationToken,
) -> QueryResult<u64> {
    let limit = batch.max(1) as i64;
    let mut total = 0u64;
    // a rotated table: the partitions whose rows are all past the retention go whole, and
    // rows go one by one only in the partition being filled (moving them to an archive
    // needs them one by one)
    let ring = match archive {
        None => db::ring(conn, table).await?,
        Some(_) => None,
    };
    let rows_in = match &ring {
        Some(ring) if !ring.may_truncate => {
            warn!(table = %table, "cleanup may not empty the partitions of the rotated table and deletes row by row: GRANT TRUNCATE, DELETE, SELECT on each partition to the relay's role");
            table
        }
        Some(ring) => {
            let emptied = db::truncate_expired(conn, table, ring, retention).await?;
            if !emptied.is_empty() {
                metrics::counter!(m::CLEANUP_TRUNCATED).increment(emptied.len() as u64);
                let names: Vec<String> = emptied.iter().map(|p| p.to_string()).collect();
                info!(partitions = ?names, "cleanup emptied partitions past the retention");
            }
            ring.current.as_ref().unwrap_or(table)
        }
        None => table,
    };
    // the rows marked published, then those the ordered relay's progress covered
    let snapshot_batches = match &ring {
        Some(ring) => ring.cursors,
        None => db::has_progress(conn, table).await?,
    };
    for covered in [false, true] {
        if covered && !snapshot_batches {
            break;
        }
        while !shutdown.is_cancelled() {
            let n = match (archive, covered) {
                (Some(a), false) => db::archive_published(conn, table, a, retention, limit).await?,
                (None, false) => db::delete_published(conn, rows_in, retention, limit).await?,
                (Some(a), true) => db::archive_read(conn, table, a, retention, limit).await?,
                (None, true) => db::delete_read_in(conn, table, rows_in, retention, limit).await?,
            };
            total += n as u64;
            metrics::counter!(m::CLEANUP_DELETED).increment(n as u64);
            if (n as i64) < limit {
                break;
            }
        }
    }
    if snapshot_batches && !shutdown.is_cancelled() {
        db::prune_progress(conn, table, retention).await?;
    }
    Ok(total)
}

/// The relay's cleanup task.
pub(crate) struct Cleaner {
    pub(crate) cfg: Arc<RelayConfig>,
    pub(crate) cleanup: crate::Cleanup,
    pub(crate) shutdown: CancellationToken,
}

impl Cleaner {
    pub(crate) async fn run(self) {
        let (cfg, cleanup) = (&self.cfg, &self.cleanup);
        let mut conn: Option<AsyncPgConnection> = None;
        let mut tick = tokio::time::interval(cleanup.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.shutdown.cancelled() => return,
            }
            if conn.is_none() {
                conn = match connect(&cfg.database_url).await {
                    Ok(c) => Some(c),
                    Err(e) => {
                        debug!(error = %e, "cleanup cannot connect to PostgreSQL; next round");
                        continue;
                    }
                };
            }
            let Some(c) = conn.as_mut() else { continue };
            let started = Instant::now();
            let swept = sweep(
                c,
                &cfg.table,
                cleanup.archive_table.as_ref(),
                cleanup.retention,
                cleanup.batch,
                &self.shutdown,
            )
            .await;
            match swept {
                Ok(0) => {}
                Ok(n) => {
                    let took = started.elapsed();
                    metrics::histogram!(m::CLEANUP_DURATION).record(took.as_secs_f64());
                    if n as usize >= cleanup.batch * 10 {
                        info!(deleted = n, took = ?took, "cleanup removed published rows");
                    } else {
                        debug!(deleted = n, took = ?took, "cleanup removed published rows");
                    }
                }
                Err(e) => {
                    warn!(error = %e, "cleanup failed; it retries next round (does the relay's role have DELETE on the outbox table?)");
                    conn = None;
                }
            }
        }
    }
}

/// A connection named `outbox-relay-cleanup` in `pg_stat_activity`, JIT off (its settings
/// first, so that no statement is planned with JIT).
async fn connect(url: &str) -> Result<AsyncPgConnection, Box<dyn std::error::Error + Send + Sync>> {
    let mut conn = outbox_diesel::connect(url).await?;
    db::prepare_side_session(&mut conn).await?;
    outbox_diesel::relay::set_application_name(&mut conn, "outbox-relay-cleanup").await?;
    Ok(conn)
}
