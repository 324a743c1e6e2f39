//! Log tailing's first start: the slot made with an exported snapshot, and the rows recorded
//! before it published from that snapshot, before anything the slot sends.

use std::collections::{HashMap, HashSet};

use diesel_async::AsyncPgConnection;
use outbox_diesel::relay::OutboxRow;
use outbox_diesel::wal::{self, WalError, WalReader};
use tracing::{error, info, warn};

use super::TailingRelay;
use crate::lease::Lease;
use crate::metrics as m;
use crate::publish::pipeline::BatchEnd;
use crate::relay::Backoff;

impl TailingRelay {
    /// Makes the slot and publishes, before anything it sends, every row committed before it
    /// that no relay has published and that is not parked, in `seq` order, read from the
    /// slot's exported snapshot a page at a time: no gap between the table and the log, and
    /// nothing twice but what a retry repeats (which JetStream drops). Returns the highest
    /// `seq` it published; `None` when stopped meanwhile (the next start makes the slot again).
    pub(super) async fn first_start(
        &self,
        conn: &mut AsyncPgConnection,
        reader: &mut WalReader,
        lease: &Lease,
        backoff: &mut Backoff,
    ) -> Result<Option<i64>, WalError> {
        let cfg = &*self.cfg;
        let mut snapshot = outbox_diesel::connect(&cfg.database_url).await?;
        let at = reader.create_slot(conn, &mut snapshot).await?;
        let mut after = 0i64;
        let mut published = 0u64;
        let mut parked: HashSet<i64> = HashSet::new();
        let mut attempts: HashMap<i64, u32> = HashMap::new();
        let limit = i64::try_from(cfg.batch_size).unwrap_or(i64::MAX);
        loop {
            if self.shutdown.is_cancelled() {
                return Ok(None);
            }
            lease.renew_if_due(conn).await?;
            let page = wal::snapshot_rows(&mut snapshot, &cfg.table, after, limit).await?;
            let Some(last) = page.last().map(|r| r.seq) else {
                break;
            };
            let rows: Vec<OutboxRow> = page
                .into_iter()
                .filter(|r| !parked.contains(&r.seq))
                .collect();
            // rows a polling relay may have published without marking them
            // the session that holds the slot's lock is kept while the broker answers slowly
            let stored = match lease
                .keep_alive(conn, self.reconciler.lookups().stored(&rows))
                .await?
            {
                Ok(stored) => stored,
                Err(e) => {
                    warn!(error = %e, "rows in doubt cannot be looked up; retrying");
                    if !backoff.sleep(&self.shutdown).await {
                        return Ok(None);
                    }
                    continue;
                }
            };
            let (acked, end) = lease
                .keep_alive(
                    conn,
                    crate::publish::pipeline::publish_batch(
                        &self.js,
                        cfg,
                        &rows,
                        stored,
                        lease,
                        &self.health,
                        &self.shutdown,
                    ),
                )
                .await?;
            match end {
                BatchEnd::Done if acked.len() == rows.len() => {
                    after = last;
                    published += rows.len() as u64;
                    backoff.reset();
                }
                // stopped
                BatchEnd::Done => return Ok(None),
                // the page again, once the session answered
                BatchEnd::LeaseUnconfirmed => lease.renew_if_due(conn).await?,
                // a newer message on a subject: the session answers (or the slot is lost to
                // another reader), then the page again, its rows looked up
                BatchEnd::Fenced => lease.renew(conn).await?,
                BatchEnd::Transient => {
                    if !backoff.sleep(&self.shutdown).await {
                        return Ok(None);
                    }
                }
                BatchEnd::RowFailed {
                    seq,
                    error,
                    park_now,
                    ..
                } => {
                    let n = attempts.entry(seq).or_insert(0);
                    *n += 1;
                    let n = *n;
                    match rows.iter().find(|r| r.seq == seq) {
                        Some(row) if park_now || n >= cfg.max_attempts => {
                            wal::park(conn, &cfg.table, row, n as i32, &error).await?;
                            parked.insert(seq);
                            metrics::counter!(m::ROWS_PARKED).increment(1);
                            error!(outbox.seq = seq, outbox.id = %row.id, error = %error, "event parked: JetStream keeps rejecting it; `outbox-relay parked` lists it, `outbox-relay retry` publishes it again");
                        }
                        _ => {
                            warn!(outbox.seq = seq, attempts = n, error = %error, "publish rejected; retrying");
                            if !backoff.sleep(&self.shutdown).await {
                                return Ok(None);
                            }
                        }
                    }
                }
            }
        }
        wal::end_snapshot(&mut snapshot).await?;
        reader.finish_slot(conn, at).await?;
        info!(slot = %reader.slot(), lsn = %at, rows = published, "the rows recorded before the slot are published; reading the slot");
        Ok(Some(after))
    }
}
