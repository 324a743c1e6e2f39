//! The `unordered` mode: competing workers claim the oldest unpublished rows with
//! `FOR UPDATE SKIP LOCKED`, publish them and mark them in the same transaction.
//!
//! Any number of workers, in any number of processes, share the table without leases. What
//! it gives up: rows of one aggregate claimed by two workers are published in whatever order
//! the two finish, so consumers must not rely on per-aggregate order.
//!
//! After a claim that found nothing, a worker's poll asks whether rows came since the snapshot
//! taken before that claim (`outbox_diesel::relay::written_since`: whether it moved, and
//! whether the table holds rows of transactions it did not see) and claims again only when
//! they may have, or, while the snapshot moves, a second after its last claim
//! (`QUIET_READ_EVERY`), which finds rows the question does not see, such as rows a worker that
//! failed unlocked. The workers of one relay share the question ([`Question`]): one asks per
//! poll interval, and the others take its answer while it is that nothing came.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use diesel_async::{AsyncConnection, AsyncPgConnection};
use outbox_diesel::relay as db;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info_span, warn};

use super::wake::{linger_step, lingering_read};
use super::{Backoff, Health, Session, SessionEnd, idle, reconnecting, retire, settle};
use crate::RelayConfig;
use crate::lease::Lease;
use crate::publish::pipeline::{BatchEnd, publish_batch};
use crate::publish::reconcile::Reconciler;

pub(crate) struct UnorderedWorker {
    pub(crate) cfg: Arc<RelayConfig>,
    pub(crate) js: jetstream::Context,
    pub(crate) reconciler: Arc<Reconciler>,
    pub(crate) health: Arc<Health>,
    pub(crate) shutdown: CancellationToken,
    /// The question the relay's workers share.
    pub(crate) question: Arc<Question>,
}

/// The idle poll's question, shared by the workers of one relay: each worker asked it at each
/// of its polls, so that `--workers 4` asked four times as often as one worker, on a quiet
/// database too. A worker's poll now takes the answer another worker's poll (or claim) had
/// within the poll interval when it was that nothing came, or leaves the question to the worker
/// asking it now (which claims if rows came), and asks only otherwise; an answer that rows may
/// have come is not shared (each worker asks, and claims, for itself). No lock is held while a
/// worker asks: one whose session hangs holds the others back for a poll interval at most.
#[derive(Debug, Default)]
pub(crate) struct Question {
    asked: std::sync::Mutex<Asked>,
}

#[derive(Debug, Default)]
struct Asked {
    /// After the latest claim that found nothing (and that followed a question), what the
    /// question knows: the snapshot asked for before it, and the latest one nothing came at.
    quiet: Option<db::QuietSince>,
    /// Which claim set `quiet` (a count): what a question learned is kept only if no claim
    /// set it again meanwhile.
    base: u64,
    /// When a poll or a claim last found that nothing came.
    nothing_at: Option<Instant>,
    /// When the question in flight was asked, if one is: the workers' polls that come
    /// meanwhile leave it to that worker, which claims if rows came.
    asking_at: Option<Instant>,
}

impl Question {
    fn asked(&self) -> std::sync::MutexGuard<'_, Asked> {
        self.asked.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether to claim: `None` when nothing can have come since the latest claim that found
    /// nothing, or the snapshot to keep should the claim find nothing. Another worker's answer
    /// that nothing came holds for `fresh` (the poll interval). When this worker's session
    /// answers, its `lease` is confirmed.
    async fn ask(
        &self,
        conn: &mut AsyncPgConnection,
        table: &outbox_diesel::OutboxTable,
        fresh: Duration,
        lease: &Lease,
    ) -> diesel::QueryResult<Option<String>> {
        let started = Instant::now();
        let (quiet, base) = {
            let mut asked = self.asked();
            let recent = |at: Option<Instant>| at.is_some_and(|at| at.elapsed() < fresh);
            if recent(asked.nothing_at) || recent(asked.asking_at) {
                return Ok(None);
            }
            asked.asking_at = Some(started);
            (asked.quiet.clone(), asked.base)
        };
        let answer = match quiet {
            Some(mut q) => q.ask(conn, table, &[]).await.map(|a| (a, Some(q))),
            None => db::current_snapshot(conn).await.map(|s| (Some(s), None)),
        };
        let mut asked = self.asked();
        asked.asking_at = None;
        let (answer, learned) = answer?;
        lease.confirm(started);
        if answer.is_none() {
            asked.nothing_at = Some(started);
        }
        if asked.base == base && learned.is_some() {
            asked.quiet = learned;
        }
        Ok(answer)
    }

    /// A claim after `snapshot` was taken found nothing: the base of the next questions.
    fn found_nothing(&self, snapshot: String) {
        let mut asked = self.asked();
        asked.quiet = Some(db::QuietSince::new(snapshot));
        asked.base += 1;
        asked.nothing_at = Some(Instant::now());
    }
}

impl Session for UnorderedWorker {
    async fn run_on(&self, conn: &mut AsyncPgConnection, backoff: &mut Backoff) -> SessionEnd {
        self.health.owned.fetch_add(1, Ordering::Relaxed);
        let result = self.session(conn, backoff).await;
        self.health.owned.fetch_sub(1, Ordering::Relaxed);
        match result {
            Ok(()) => SessionEnd::Ended,
            Err(e) => {
                warn!(error = %e, "database session lost; reconnecting");
                SessionEnd::Failed
            }
        }
    }
}

impl UnorderedWorker {
    pub(crate) async fn run(self) {
        reconnecting(&self.cfg, &self.health, &self.shutdown, &self).await;
    }

    async fn session(
        &self,
        conn: &mut AsyncPgConnection,
        backoff: &mut Backoff,
    ) -> diesel::QueryResult<()> {
        let cfg = &*self.cfg;
        let lease = Lease::new(cfg.lease);
        lease.configure(conn).await?;
        if cfg.listen {
            db::listen(conn, &cfg.table).await?;
        }
        let mut average_payload = 0;
        // the last batch published: commits right after it may not have been notified
        let mut found = None;
        // whether to ask the shared question before claiming, and how fresh another worker's
        // answer must be (an idle poll, or a read within the linger after its first; not a
        // writer's notification)
        let mut ask = None;
        // the last claim within the linger that ran without asking first
        let mut lingered = None;
        while !self.shutdown.is_cancelled() {
            // nothing came since the snapshot asked for before a claim that found nothing: the
            // claim would find nothing again (a row it skipped was locked by a worker, which
            // publishes it or claims it again; one unlocked otherwise waits for the claim that
            // runs at least once a second while the snapshot moves)
            let asked = if let Some(fresh) = ask {
                let asked = self.question.ask(conn, &cfg.table, fresh, &lease).await?;
                if asked.is_none() {
                    self.health.progressed();
                    // a worker that takes the others' answers still keeps its session
                    lease.renew_if_due(conn).await?;
                    ask = self.idle(conn, found, &mut lingered).await;
                    continue;
                }
                asked
            } else {
                None
            };
            let (js, shutdown, lease, health) = (&self.js, &self.shutdown, &lease, &*self.health);
            let reconciler = &*self.reconciler;
            let average_payload = &mut average_payload;
            let end = conn
                .transaction(async |conn| {
                    let started = Instant::now();
                    let rows = db::claim_unpublished(
                        conn,
                        &cfg.table,
                        cfg.rows_for(*average_payload),
                        Some(cfg.max_batch_bytes as i64),
                    )
                    .await?;
                    if !rows.is_empty() {
                        *average_payload = super::ordered::average_payload_len(&rows);
                    }
                    lease.confirm(started);
                    if rows.is_empty() {
                        return Ok::<_, diesel::result::Error>(None);
                    }
                    let span = info_span!("outbox.batch", batch.len = rows.len());
                    // the rows stay locked by this transaction until the acks are marked:
                    // slow acks (and look-ups) must not let the idle timeout end it and hand
                    // them over
                    let publish = async {
                        // rows old enough to have been published by a worker that did not
                        // mark them are looked up first; those in the stream are not sent
                        // other workers publish meanwhile: a horizon of this pass's own
                        let stored = match reconciler.lookups().stored(&rows).await {
                            Ok(stored) => stored,
                            Err(e) => {
                                warn!(error = %e, "rows in doubt cannot be looked up; retrying");
                                return (Vec::new(), BatchEnd::Transient);
                            }
                        };
                        publish_batch(js, cfg, &rows, stored, lease, health, shutdown).await
                    }
                    .instrument(span);
                    let (acked, end) = lease.keep_alive(conn, publish).await?;
                    retire(conn, cfg, &acked).await?;
                    Ok(Some(end))
                })
                .await?;
            ask = None;
            match end {
                None => {
                    self.health.progressed();
                    if let Some(snapshot) = asked {
                        self.question.found_nothing(snapshot);
                    }
                    ask = self.idle(conn, found, &mut lingered).await;
                }
                Some(BatchEnd::Done) => {
                    backoff.reset();
                    found = Some(Instant::now());
                }
                Some(end) => {
                    if !settle(conn, cfg, end, backoff, &self.shutdown).await? {
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    /// Waits for the next poll or a writer's notification; whether the next claim asks first
    /// whether a transaction ended, and how fresh another worker's answer must be: not after a
    /// notification, nor at the first read within the linger after a batch (a debounced
    /// writer's commits come unnotified); at the linger's next reads, an answer of its step
    /// (an answer a poll interval old would hold them back); otherwise one of the poll interval.
    async fn idle(
        &self,
        conn: &mut AsyncPgConnection,
        found: Option<Instant>,
        lingered: &mut Option<Instant>,
    ) -> Option<Duration> {
        let cfg = &*self.cfg;
        let deadline = Instant::now() + cfg.poll_interval;
        if idle(conn, cfg, &self.shutdown, deadline, found)
            .await
            .is_some()
        {
            return None;
        }
        match lingering_read(cfg, found, lingered) {
            Some(true) => None,
            Some(false) => Some(linger_step(cfg)),
            None => Some(cfg.poll_interval),
        }
    }
}
