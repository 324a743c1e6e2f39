//! The `ordered` mode: the table is split into N partitions by `aggregate_hash % N`; each
//! partition is owned by one relay process at a time (a session advisory lock), and its owner
//! publishes its rows in `seq` order.
//!
//! One session per process holds the process's membership lock and its partition locks, and
//! reads every partition it owns (one statement per step for all of them: one walk through
//! their rows, or each partition by the partition index when the table has it), so that
//! losing the session loses every lease at once. Every `standby_interval` (every 100 ms while
//! the shares move, and at once when another relay says they moved) a relay counts the live
//! relays of the table in `pg_locks`, keeps its share of the partitions (N / relays, the
//! oldest relays one more when it does not divide), releases the extra ones once the acks in
//! flight have arrived and are recorded, and takes free ones. A relay that joins, and one that
//! releases partitions, tells the others with `NOTIFY` on the table's members' channel. A
//! relay that starts with another partition count than an older running one waits until that
//! one is gone: two partition counts at once would let two relays publish one aggregate.
//!
//! Publishing is a sequence of steps that keep the NATS pipeline full: in each step the rows
//! fetched by the previous one are sent while the same session records what was acked so far
//! and fetches the next batch of each partition. Nothing is written per row: a partition is
//! read by snapshot batches (see `outbox_diesel::relay::progress`), from an in-memory cursor
//! that runs ahead of the recorded one; a batch's cursor is recorded (one `INSERT`) once every
//! row of it, and of the batches before it, is acked. After a failed publish, the batch's rows
//! acked before the failure are recorded when they include its late rows, and reading goes on
//! from the recorded cursor.
//!
//! A fetched row older than the stream's duplicate window (less a margin) may have been
//! published by an owner that died before recording it: it is looked up in the stream first,
//! and counts as acked in its turn without being sent when its message is there (see
//! `reconcile`).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use async_nats::jetstream;
use diesel_async::AsyncPgConnection;
use outbox_diesel::relay::{self as db, OutboxRow, Partition};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::wake::lingering_read;
use super::{
    Backoff, Health, Peers, Session, SessionEnd, idle, reconnecting, settle, sleep_or_notified,
};
use crate::RelayConfig;
use crate::lease::Lease;
use crate::metrics as m;
use crate::publish::pipeline::Pipeline;
use crate::publish::reconcile::Reconciler;

mod progress;

use progress::Progress;

/// How soon a relay looks at the partitions' shares again while they are moving (see
/// `OrderedRelay::session`), instead of `standby_interval`.
const REBALANCE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

pub(crate) struct OrderedRelay {
    pub(crate) cfg: Arc<RelayConfig>,
    /// The mode's own settings.
    pub(crate) mode: crate::Ordered,
    pub(crate) js: jetstream::Context,
    pub(crate) reconciler: Arc<Reconciler>,
    pub(crate) health: Arc<Health>,
    pub(crate) shutdown: CancellationToken,
}

impl Session for OrderedRelay {
    async fn run_on(&self, conn: &mut AsyncPgConnection, backoff: &mut Backoff) -> SessionEnd {
        let mut owned = BTreeSet::new();
        let result = self.session(conn, &mut owned, backoff).await;
        owned.clear();
        self.set_owned(&owned);
        match result {
            Ok(()) => SessionEnd::Ended,
            Err(e) => {
                warn!(error = %e, "database session lost; its partitions are free for other relays; reconnecting");
                SessionEnd::Failed
            }
        }
    }
}

impl OrderedRelay {
    pub(crate) async fn run(self) {
        self.health.standby.store(1, Ordering::Relaxed);
        reconnecting(&self.cfg, &self.health, &self.shutdown, &self).await;
        self.health.standby.store(0, Ordering::Relaxed);
    }

    fn set_owned(&self, owned: &BTreeSet<u32>) {
        let n = owned.len();
        if n == 0 {
            // standing by is no lack of progress
            self.health.progressed();
        }
        self.health.owned.store(n, Ordering::Relaxed);
        self.health
            .standby
            .store(usize::from(n == 0), Ordering::Relaxed);
        metrics::gauge!(m::PARTITIONS_OWNED).set(n as f64);
    }

    async fn session(
        &self,
        conn: &mut AsyncPgConnection,
        owned: &mut BTreeSet<u32>,
        backoff: &mut Backoff,
    ) -> diesel::QueryResult<()> {
        let cfg = &self.cfg;
        let table = &cfg.table;
        let lease = Lease::new(cfg.lease);
        lease.configure(conn).await?;
        let me = db::backend_pid(conn).await?;
        let peers = Peers::listen(conn, table, me).await?;
        let ticket = db::join_members(conn, table, self.mode.partitions).await?;
        peers.tell(conn, "joined").await?;
        if cfg.listen {
            db::listen(conn, table).await?;
        }
        let mut next_balance = Instant::now();
        let mut warned_conflict = false;
        // whether the table has the partition index of this count, and whether this session
        // said what reading some partitions without it costs
        let mut partitioning = db::Partitioning::new(self.mode.partitions);
        let mut balances = 0u32;
        let mut warned_unindexed = false;
        let mut average_payload = 0;
        // the last read that found rows: commits right after it may not have been notified
        let mut found = None;
        // the last read within the linger that ran without asking first (`lingering_read`)
        let mut lingered = None;
        let mut lookups = self.reconciler.lookups();
        // after a read that found nothing, a poll asks whether a transaction ended first
        let mut reads = db::Reads::default();
        let mut holding = Holding {
            pipe: Pipeline::new(&self.js, cfg, &lease, &self.health, &self.shutdown),
            progress: Progress::default(),
            queue: Vec::new(),
        };
        while !self.shutdown.is_cancelled() {
            // the notifications that came while this relay worked, taken before its next
            // read: that read sees every commit a writer's notification announced
            if peers.moved(conn) {
                next_balance = Instant::now();
            }
            if Instant::now() >= next_balance {
                let before = owned.clone();
                let settled = self
                    .balance(conn, me, owned, &mut holding, &mut warned_conflict, &peers)
                    .await?;
                if !owned.is_subset(&before) {
                    // a partition taken over: its last owner may have published past any
                    // horizon read before, and past any sequence the fence knows
                    lookups.reset();
                    holding.pipe.forget_sequences();
                }
                self.check_index(conn, owned, &mut partitioning, &mut warned_unindexed)
                    .await?;
                // while the shares are moving (this relay holds more or fewer than its share,
                // or just took or gave some), and once right after its first look (relays
                // started together join within moments of each other), it looks again soon:
                // a partition released waits for its next owner's look, and a relay alone for
                // the first second owned every partition of a backlog drained by two
                balances += 1;
                next_balance = Instant::now()
                    + if settled && *owned == before && balances > 1 {
                        cfg.standby_interval
                    } else {
                        REBALANCE_INTERVAL.min(cfg.standby_interval)
                    };
            }
            if owned.is_empty() {
                // standing by: until the next look, or another relay says the shares moved
                // (a writer's notification is for the owners)
                while let Some(note) = sleep_or_notified(conn, &self.shutdown, next_balance).await {
                    if peers.is_peer(&note) {
                        next_balance = Instant::now();
                        break;
                    }
                }
                continue;
            }
            // one step: the queued rows are sent while the acks so far are recorded and the
            // next rows fetched, so that the NATS pipeline does not run dry during queries
            let Holding {
                pipe,
                progress,
                queue,
            } = &mut holding;
            progress.acked(&pipe.take_acked());
            let sending = std::mem::take(queue);
            let span = info_span!(
                "outbox.batch",
                batch.len = sending.len(),
                outbox.partitions = owned.len()
            );
            let limit = cfg.rows_for(average_payload);
            let max_bytes = cfg.max_batch_bytes as i64;
            let queries = async {
                let started = Instant::now();
                let recorded = progress.record(conn, cfg, false).await?;
                // one statement for every partition owned: one walk through their rows
                let cursors: Vec<(u32, db::Cursor)> = owned
                    .iter()
                    .map(|&p| {
                        let partition = Partition {
                            index: p,
                            count: self.mode.partitions,
                        };
                        (p, progress.read_cursor(partition))
                    })
                    .collect();
                let exclude = progress.released_in_flight();
                let batches = reads
                    .fetch(
                        conn,
                        table,
                        partitioning,
                        &cursors,
                        &exclude,
                        limit,
                        max_bytes,
                    )
                    .await?;
                let mut fetched = Vec::new();
                for ((p, batch), (_, cursor)) in batches.into_iter().zip(cursors) {
                    if batch.held > 0 {
                        debug!(
                            held = batch.held,
                            partition = p,
                            "rows held back behind a parked row of their aggregate"
                        );
                    }
                    match (&cursor.late, &batch.next.late) {
                        (None, Some(_)) => {
                            metrics::counter!(m::LATE_PASSES).increment(1);
                            info!(
                                partition = p,
                                "more late rows than a batch holds (a large transaction committed after later rows were read): they are read in parts, and the partition's next rows after them"
                            );
                        }
                        (Some(_), None) => debug!(partition = p, "late rows read"),
                        _ => {}
                    }
                    let partition = Partition {
                        index: p,
                        count: self.mode.partitions,
                    };
                    fetched.extend(progress.read(partition, cursor, batch));
                }
                lease.confirm(started);
                debug!(recorded, fetched = fetched.len(), "recorded and fetched");
                Ok::<_, diesel::result::Error>(fetched)
            };
            // the queries end first as a rule; sending on past them (acks slower than the
            // queries, a stalled broker) keeps the session that holds the partitions
            let fetched = {
                let mut send = std::pin::pin!(pipe.send_all(&sending).instrument(span));
                let mut sent = false;
                let fetched = {
                    let mut queries = std::pin::pin!(queries);
                    loop {
                        tokio::select! {
                            biased;
                            fetched = &mut queries => break fetched?,
                            _ = &mut send, if !sent => sent = true,
                        }
                    }
                };
                if !sent {
                    lease.keep_alive(conn, send).await?;
                }
                fetched
            };
            if !fetched.is_empty() {
                metrics::histogram!(m::BATCH_ROWS).record(fetched.len() as f64);
                average_payload = average_payload_len(&fetched);
                found = Some(Instant::now());
            }
            if pipe.stopped() || self.shutdown.is_cancelled() {
                // a failed publish, a lease in doubt, or shutdown: nothing more is sent; what
                // was sent is acked and recorded, the rest is read again
                holding.flush(conn).await?;
                let end = holding.pipe.take_end();
                // what was sent and not acked may be stored: a new horizon for the next look-ups
                lookups.reset();
                if !settle(conn, cfg, end, backoff, &self.shutdown).await? {
                    break;
                }
                continue;
            }
            // rows old enough to have been published by a relay that did not record them are
            // looked up first; those in the stream count as acked in their turn, not sent
            match lease.keep_alive(conn, lookups.stored(&fetched)).await? {
                Ok(stored) => pipe.already_stored(stored),
                Err(e) => {
                    warn!(error = %e, "rows in doubt cannot be looked up; retrying");
                    holding
                        .pipe
                        .stop(crate::publish::pipeline::BatchEnd::Transient);
                    holding.flush(conn).await?;
                    holding.pipe.take_end();
                    if !backoff.sleep(&self.shutdown).await {
                        break;
                    }
                    continue;
                }
            }
            backoff.reset();
            *queue = fetched;
            if queue.is_empty() {
                if pipe.is_empty() && progress.is_settled() {
                    self.health.progressed();
                    match idle(conn, cfg, &self.shutdown, next_balance, found).await {
                        Some(note) if peers.is_peer(&note) => next_balance = Instant::now(),
                        // a writer's commit: read at once, without asking first whether a
                        // transaction ended
                        Some(_) => reads.forget(),
                        // the first read within the linger after rows were found (a debounced
                        // writer's commits come unnotified): at once too; the next ones ask
                        // first, as a poll does
                        None => {
                            if lingering_read(cfg, found, &mut lingered) == Some(true) {
                                reads.forget();
                            }
                        }
                    }
                } else {
                    // caught up: let the last acks arrive, record them on the next step
                    lease.keep_alive(conn, pipe.drain()).await?;
                }
            }
        }
        // a clean stop: record what was published, then hand the partitions over at once
        holding.flush(conn).await?;
        for &p in owned.iter() {
            db::AdvisoryLock::Partition(
                table,
                Partition {
                    index: p,
                    count: self.mode.partitions,
                },
            )
            .unlock(conn)
            .await?;
        }
        // out of the members first: the others look at the shares as soon as they hear, and
        // must not count this relay, whose session ends only after
        db::leave_members(conn, table, self.mode.partitions, ticket).await?;
        if !owned.is_empty() {
            peers.tell(conn, "released").await?;
            info!(partitions = ?owned, "partitions released");
        }
        owned.clear();
        Ok(())
    }

    /// Looks whether the table has the partition index of this relay's count (made or dropped
    /// since the last look): with it, the partitions this relay owns are each read by it when
    /// it owns some of them. Says once per session what reading some of them without it costs.
    async fn check_index(
        &self,
        conn: &mut AsyncPgConnection,
        owned: &BTreeSet<u32>,
        partitioning: &mut db::Partitioning,
        warned: &mut bool,
    ) -> diesel::QueryResult<()> {
        let n = self.mode.partitions;
        if n < 2 {
            return Ok(());
        }
        let indexed = db::has_partition_index(conn, &self.cfg.table, n).await?;
        if indexed != partitioning.indexed {
            info!(
                partitions = n,
                index = %outbox_diesel::partition_index_name(&self.cfg.table, n),
                "{}",
                if indexed {
                    "the table has the partition index of this partition count: each partition this relay owns is read by it"
                } else {
                    "the partition index of this partition count is gone: the partitions this relay owns are read by one walk through every partition's rows"
                }
            );
            *partitioning = partitioning.indexed(indexed);
        }
        // (a relay that owns more partitions than a statement reads by the index walks `ready`
        // with it too)
        if !indexed
            && !owned.is_empty()
            && owned.len() < n as usize
            && owned.len() <= db::MAX_PARTITIONS_BY_INDEX
            && !*warned
        {
            warn!(
                partitions = n,
                owned = owned.len(),
                "this relay owns some of the partitions and reads every partition's rows to find its own; `outbox-relay index --partitions {n}` makes the index by which each relay reads only its own"
            );
            *warned = true;
        }
        Ok(())
    }

    /// Keeps this relay's fair share of the partitions: releases extra ones, takes free ones.
    /// Returns whether it holds its share.
    async fn balance(
        &self,
        conn: &mut AsyncPgConnection,
        me: i32,
        owned: &mut BTreeSet<u32>,
        holding: &mut Holding<'_>,
        warned_conflict: &mut bool,
        others: &Peers,
    ) -> diesel::QueryResult<bool> {
        let cfg = &self.cfg;
        let n = self.mode.partitions;
        let started = Instant::now();
        let members = db::members(conn, &cfg.table).await?;
        holding.pipe.lease().confirm(started);
        let my_ticket = members.iter().find(|m| m.pid == me).map(|m| m.joined);
        let older_conflict = members.iter().find(|m| {
            m.partitions != n as i32 && my_ticket.is_some_and(|mine| m.joined < mine) && m.pid != me
        });
        if let Some(other) = older_conflict {
            if !*warned_conflict {
                warn!(
                    other_pid = other.pid,
                    other_partitions = other.partitions,
                    partitions = n,
                    "a relay with another --partitions count runs on this table; this relay waits until it stops (stop every relay to change the count)"
                );
                *warned_conflict = true;
            }
            if !owned.is_empty() {
                // a partition is released only once what was published from it is marked
                holding.flush(conn).await?;
                self.release(conn, owned, owned.len(), holding, others)
                    .await?;
            }
            self.set_owned(owned);
            return Ok(true);
        }
        *warned_conflict = false;
        let peers: Vec<i32> = members
            .iter()
            .filter(|m| m.partitions == n as i32)
            .map(|m| m.pid)
            .collect();
        let count = peers.len().max(1);
        // the oldest `n % count` relays keep one partition more than the others
        let rank = peers.iter().position(|&p| p == me).unwrap_or(0);
        let fair = n as usize / count + usize::from(rank < n as usize % count);
        if owned.len() > fair {
            let extra = owned.len() - fair;
            holding.flush(conn).await?;
            self.release(conn, owned, extra, holding, others).await?;
        } else if owned.len() < fair {
            // start where this relay's share would begin, to spread the first attempts
            let start = (rank * fair) as u32 % n;
            let mut taken = Vec::new();
            for k in 0..n {
                if owned.len() >= fair {
                    break;
                }
                let p = (start + k) % n;
                if owned.contains(&p) {
                    continue;
                }
                if db::AdvisoryLock::Partition(&cfg.table, Partition { index: p, count: n })
                    .try_lock(conn)
                    .await?
                {
                    holding
                        .progress
                        .acquire(conn, cfg, Partition { index: p, count: n })
                        .await?;
                    owned.insert(p);
                    taken.push(p);
                }
            }
            if !taken.is_empty() {
                info!(partitions = ?taken, owned = owned.len(), relays = count, "partitions acquired");
            }
        }
        self.set_owned(owned);
        Ok(owned.len() == fair)
    }

    async fn release(
        &self,
        conn: &mut AsyncPgConnection,
        owned: &mut BTreeSet<u32>,
        how_many: usize,
        holding: &mut Holding<'_>,
        others: &Peers,
    ) -> diesel::QueryResult<()> {
        let n = self.mode.partitions;
        let victims: Vec<u32> = owned.iter().rev().take(how_many).copied().collect();
        for p in &victims {
            db::AdvisoryLock::Partition(
                &self.cfg.table,
                Partition {
                    index: *p,
                    count: n,
                },
            )
            .unlock(conn)
            .await?;
            owned.remove(p);
            holding.progress.forget(*p);
        }
        if !victims.is_empty() {
            others.tell(conn, "released").await?;
            info!(partitions = ?victims, owned = owned.len(), "partitions released to balance with other relays");
        }
        Ok(())
    }
}

/// The average payload length of `rows`, to size the next query.
pub(crate) fn average_payload_len(rows: &[OutboxRow]) -> usize {
    let total: usize = rows.iter().map(|r| r.payload.as_str().len()).sum();
    total / rows.len().max(1)
}

/// What a relay holds between steps: the pipeline, the progress of its partitions, and the
/// queue of fetched rows not sent yet, in `seq` order per partition.
struct Holding<'a> {
    pipe: Pipeline<'a>,
    progress: Progress,
    queue: Vec<OutboxRow>,
}

impl Holding<'_> {
    /// Sends the queued rows (unless stopped), waits for every ack in flight and records what
    /// was acked; then reads on from what is recorded: afterwards the relay holds no row, and
    /// may hand a partition over.
    async fn flush(&mut self, conn: &mut AsyncPgConnection) -> diesel::QueryResult<()> {
        let lease = self.pipe.lease();
        let pipe = &mut self.pipe;
        let queue = &self.queue;
        lease
            .keep_alive(conn, async {
                pipe.send_all(queue).await;
                pipe.drain().await;
            })
            .await?;
        self.queue.clear();
        self.progress.acked(&self.pipe.take_acked());
        let started = Instant::now();
        let recorded = self.progress.record(conn, self.pipe.config(), true).await?;
        self.pipe.lease().confirm(started);
        self.progress.rewind();
        debug!(recorded, "flushed");
        Ok(())
    }
}
