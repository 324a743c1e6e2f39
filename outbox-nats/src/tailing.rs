//! The `log-tailing` mode: one reader per logical replication slot reads the outbox table's
//! committed inserts from the WAL in commit order, publishes them with the same contract as
//! the polling modes, and confirms the slot only past transactions JetStream acked whole.
//!
//! One reader per slot: the reader holds the session advisory lock
//! `(outbox_diesel::wal::SLOT_LOCK_KEY, hashtext(slot))`, a key apart from the ordered mode's
//! partition locks (which use the table's OID). Other relays in this mode stand by, trying the
//! lock every `standby_interval`; PostgreSQL releases it when the reader's connection drops,
//! and ends a silent reader's session after the lease (see `lease.rs`), so a paused reader is
//! replaced and, having no recent answer from its session, publishes nothing when it wakes.
//!
//! A crash can only repeat, never skip: the slot's confirmed position moves only to the end
//! of a transaction whose events, and every earlier transaction's, JetStream acked. The next
//! reader reads from there; what was published after it comes again: JetStream drops it
//! within the duplicate window, and a row older than that is looked up in the stream first
//! and confirmed without being sent when it is there (see `reconcile`).
//!
//! Poison events: the log cannot leave one event behind and go on in order, so a row
//! JetStream keeps rejecting holds the reader (retried with backoff) until `max_attempts`,
//! then is parked: written back to the outbox table with `parked_at` and its error, counted
//! and logged, and passed over. Later events of its aggregate are not held back in this mode.
//! `outbox-relay retry` releases it (an UPDATE, which the reader sees and publishes then).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use chrono::{DateTime, Utc};
use diesel_async::AsyncPgConnection;
use outbox_diesel::relay::OutboxRow;
use outbox_diesel::wal::{self, Lsn, SlotState, WalBatch, WalError, WalReader};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};
use uuid::Uuid;

use crate::RelayConfig;
use crate::lease::Lease;
use crate::metrics as m;
use crate::pipeline::{BatchEnd, Pipeline};
use crate::reconcile::{Lookups, Reconciler};
use crate::relay::{Backoff, Health, Session, SessionEnd, reconnecting};

pub(crate) struct Tailing {
    pub(crate) cfg: Arc<RelayConfig>,
    pub(crate) js: jetstream::Context,
    pub(crate) reconciler: Arc<Reconciler>,
    pub(crate) health: Arc<Health>,
    pub(crate) shutdown: CancellationToken,
    /// An error that retrying cannot fix (the slot is lost): the relay stops with it.
    pub(crate) fatal: Arc<Mutex<Option<WalError>>>,
}

/// What the reader remembers between reads.
#[derive(Debug, Default)]
struct State {
    /// The slot's confirmed position.
    confirmed: Lsn,
    /// The highest `seq` confirmed: captured rows up to it may be deleted.
    max_confirmed_seq: i64,
    /// Commit time of the oldest transaction read and not confirmed.
    oldest_unconfirmed: Option<DateTime<Utc>>,
    /// Failed attempts of events that JetStream rejected.
    attempts: HashMap<Uuid, u32>,
    /// Parked events, by id and the end of their transaction, passed over until confirmed.
    parked: HashSet<(Uuid, Lsn)>,
}

/// The transactions read and not confirmed yet, in commit order, with their rows sent (or
/// left unsent after a failure).
///
/// The pipeline sends rows in window order and returns their acks in send order, so while
/// nothing failed the acked rows are the first `acked` rows of the window: confirming is a
/// walk from the front. After a failure later acks may still succeed out of that order;
/// [`Window::acked_seqs`] then gives them all to [`confirmable`].
#[derive(Debug, Default)]
struct Window {
    batch: WalBatch,
    /// Where the slot may be confirmed once every transaction of the window is acked.
    caught_up_to: Option<Lsn>,
    rows: Vec<OutboxRow>,
    /// Each row's transaction, an index into `batch.transactions` (nondecreasing).
    txn_of: Vec<usize>,
    /// How many rows from the front are acked.
    acked: usize,
}

impl Window {
    /// After `n` more acks in order: the end of the last transaction acked whole (or the
    /// caught-up position when all are), the highest `seq` up to it, and the first
    /// transaction not acked whole.
    fn ack_in_order(&mut self, n: usize) -> (Option<Lsn>, i64, Option<usize>) {
        self.acked = (self.acked + n).min(self.rows.len());
        let first_open = self.txn_of.get(self.acked).copied();
        let done = first_open.unwrap_or(self.batch.transactions.len());
        let mut to = done
            .checked_sub(1)
            .and_then(|t| self.batch.transactions.get(t))
            .map(|t| t.end_lsn);
        if first_open.is_none() {
            to = to.max(self.caught_up_to);
        }
        let rows_done = self.txn_of.partition_point(|&t| t < done);
        let max_seq = self.rows[..rows_done]
            .iter()
            .map(|r| r.seq)
            .max()
            .unwrap_or(0);
        (to, max_seq, first_open)
    }

    /// Every acked `seq`: the first `acked` rows and `late`, acks that came after a failure.
    fn acked_seqs(&self, late: &[i64]) -> Vec<i64> {
        let mut all: Vec<i64> = self.rows[..self.acked].iter().map(|r| r.seq).collect();
        all.extend_from_slice(late);
        all
    }

    /// Drops the first `n` transactions (confirmed, so acked whole) and their rows.
    fn drop_confirmed(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let rows = self.txn_of.partition_point(|&t| t < n);
        self.rows.drain(..rows);
        self.txn_of.drain(..rows);
        for t in &mut self.txn_of {
            *t -= n;
        }
        self.batch.transactions.drain(..n);
        self.acked = self.acked.saturating_sub(rows);
    }

    /// The row `seq` that was not acked (given every acked `seq`), and its transaction's end.
    fn unacked_row(&self, seq: i64, acked: &[i64]) -> Option<(OutboxRow, Lsn)> {
        let i = self
            .rows
            .iter()
            .position(|r| r.seq == seq && !acked.contains(&seq))?;
        let t = self.batch.transactions.get(self.txn_of[i])?;
        Some((self.rows[i].clone(), t.end_lsn))
    }
}

impl Session for Tailing {
    async fn run_on(&self, conn: &mut AsyncPgConnection, backoff: &mut Backoff) -> SessionEnd {
        let result = self.session(conn, backoff).await;
        self.set_reader(false);
        let Err(e) = result else {
            return SessionEnd::Ended;
        };
        match e {
            WalError::Query(e) => {
                warn!(error = %e, "database session lost; the slot is free for a standby; reconnecting")
            }
            e @ WalError::Stream { .. } => {
                warn!(error = %e, "replication connection lost; the slot is free for a standby; reconnecting")
            }
            e @ (WalError::SlotMissing { .. } | WalError::SlotLost { .. }) => {
                error!(error = %e, "log tailing cannot go on; the relay stops");
                *self.fatal.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                self.shutdown.cancel();
                return SessionEnd::Stop;
            }
            e => error!(error = %e, "log tailing cannot go on; retrying"),
        }
        SessionEnd::Failed
    }
}

impl Tailing {
    pub(crate) async fn run(self) {
        self.set_reader(false);
        reconnecting(&self.cfg, &self.health, &self.shutdown, &self).await;
        self.health.standby.store(0, Ordering::Relaxed);
    }

    fn set_reader(&self, reader: bool) {
        // standing by, or taking the slot, is no lack of progress
        self.health.progressed();
        self.health
            .owned
            .store(usize::from(reader), Ordering::Relaxed);
        self.health
            .standby
            .store(usize::from(!reader), Ordering::Relaxed);
        metrics::gauge!(m::SLOT_READER).set(if reader { 1.0 } else { 0.0 });
        metrics::gauge!(m::PARTITIONS_OWNED).set(if reader { 1.0 } else { 0.0 });
    }

    async fn session(
        &self,
        conn: &mut AsyncPgConnection,
        backoff: &mut Backoff,
    ) -> Result<(), WalError> {
        let cfg = &*self.cfg;
        let slot = cfg.slot_name();
        let lease = Lease::new(cfg.lease);
        lease.configure(conn).await?;
        // stand by until this session holds the slot's lock
        let mut announced = false;
        loop {
            if self.shutdown.is_cancelled() {
                return Ok(());
            }
            let started = Instant::now();
            let mine = wal::try_lock_slot(conn, &slot).await?;
            lease.confirm(started);
            if mine {
                break;
            }
            if !announced {
                info!(slot = %slot, "another relay reads the slot; standing by");
                announced = true;
            }
            tokio::select! {
                _ = tokio::time::sleep(cfg.standby_interval) => {}
                _ = self.shutdown.cancelled() => return Ok(()),
            }
        }
        let mut reader = WalReader::new(cfg.table.clone(), slot.clone(), cfg.publication_name())
            .streaming(&cfg.database_url, cfg.poll_interval)?
            .recover(cfg.recover_slot);
        let state = reader.setup(conn).await?;
        self.set_reader(true);
        if state != SlotState::Ready
            && !self.first_start(conn, &mut reader, &lease, backoff).await?
        {
            return Ok(());
        }
        info!(slot = %slot, publication = %reader.publication(), "reading the slot");
        let result = self.read_loop(conn, &mut reader, &lease, backoff).await;
        if result.is_ok() {
            // a clean stop: confirm what was acked and hand the slot over at once
            reader.close(conn).await?;
            wal::unlock_slot(conn, &slot).await?;
            info!(slot = %slot, "slot released");
        }
        result
    }

    /// Makes the slot and publishes, before anything it sends, every row committed before it
    /// that no relay has published and that is not parked, in `seq` order, read from the
    /// slot's exported snapshot a page at a time: no gap between the table and the log, and
    /// nothing twice but what a retry repeats (which JetStream drops). `false` when stopped
    /// meanwhile (the next start makes the slot again).
    async fn first_start(
        &self,
        conn: &mut AsyncPgConnection,
        reader: &mut WalReader,
        lease: &Lease,
        backoff: &mut Backoff,
    ) -> Result<bool, WalError> {
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
                return Ok(false);
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
            let stored = match self.reconciler.lookups().stored(&rows).await {
                Ok(stored) => stored,
                Err(e) => {
                    warn!(error = %e, "rows in doubt cannot be looked up; retrying");
                    if !backoff.sleep(&self.shutdown).await {
                        return Ok(false);
                    }
                    continue;
                }
            };
            let (acked, end) = crate::pipeline::publish_batch(
                &self.js,
                cfg,
                &rows,
                stored,
                lease,
                &self.health,
                &self.shutdown,
            )
            .await;
            match end {
                BatchEnd::Done if acked.len() == rows.len() => {
                    after = last;
                    published += rows.len() as u64;
                    backoff.reset();
                }
                // stopped
                BatchEnd::Done => return Ok(false),
                // the page again, once the session answered
                BatchEnd::LeaseUnconfirmed => lease.renew_if_due(conn).await?,
                BatchEnd::Transient => {
                    if !backoff.sleep(&self.shutdown).await {
                        return Ok(false);
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
                                return Ok(false);
                            }
                        }
                    }
                }
            }
        }
        wal::end_snapshot(&mut snapshot).await?;
        reader.finish_slot(conn, at).await?;
        info!(slot = %reader.slot(), lsn = %at, rows = published, "the rows recorded before the slot are published; reading the slot");
        Ok(true)
    }

    /// Reads the stream and keeps the NATS pipeline full across reads: the rows of what was
    /// read are sent while the acks of earlier ones arrive, and the slot is confirmed past the
    /// transactions acked whole, in commit order. A failed publish stops the sending; the
    /// acks in flight are let in, the slot confirmed as far as they allow, and the reader goes
    /// back to the confirmed position, so that what was not acked comes again.
    async fn read_loop(
        &self,
        conn: &mut AsyncPgConnection,
        reader: &mut WalReader,
        lease: &Lease,
        backoff: &mut Backoff,
    ) -> Result<(), WalError> {
        let cfg = &*self.cfg;
        let mut state = State {
            confirmed: reader.confirmed(conn).await?.unwrap_or_default(),
            ..State::default()
        };
        let mut next_stats = Instant::now();
        let mut next_cleanup = Instant::now() + cfg.captured_cleanup_interval;
        let mut window = Window::default();
        let mut lookups = self.reconciler.lookups();
        let mut pipe = Pipeline::new(&self.js, cfg, lease, &self.health, &self.shutdown);
        while !self.shutdown.is_cancelled() {
            if Instant::now() >= next_stats {
                self.stats(conn, reader, &state).await?;
                next_stats = Instant::now() + cfg.stats_interval;
            }
            if Instant::now() >= next_cleanup {
                self.cleanup(conn, &state).await?;
                next_cleanup = Instant::now() + cfg.captured_cleanup_interval;
            }
            // The stream proves nothing about the session that holds the slot's lock, so the
            // lease is not confirmed by a read; an idle reader queries its session instead,
            // before PostgreSQL ends it as silent (whatever --stats-interval is).
            lease.renew_if_due(conn).await?;
            // with acks in flight, take only what has arrived; else wait for a transaction.
            let wait = if pipe.is_empty() {
                cfg.poll_interval
            } else {
                Duration::ZERO
            };
            let read = tokio::select! {
                r = reader.read_within(conn, cfg.batch_size, wait) => r,
                _ = self.shutdown.cancelled() => break,
            };
            let batch = match read {
                Ok(b) => b,
                Err(WalError::SlotBusy { .. }) => {
                    // `outbox-relay status` reads the slot for an instant
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let fresh = !batch.transactions.is_empty();
            if fresh {
                let span = info_span!(
                    "outbox.batch",
                    batch.transactions = batch.transactions.len()
                );
                self.send(
                    conn,
                    &mut pipe,
                    &mut window,
                    &mut lookups,
                    batch,
                    &state.parked,
                    lease,
                )
                .instrument(span)
                .await?;
            } else {
                if pipe.is_empty() {
                    self.health.progressed();
                }
                window.caught_up_to = window.caught_up_to.max(batch.caught_up_to);
                // nothing new: let the acks in flight arrive
                pipe.drain().await;
            }
            if !pipe.stopped() {
                self.confirm(conn, reader, &mut window, &mut pipe, &mut state)
                    .await?;
            }
            if !pipe.stopped() {
                if !fresh {
                    backoff.reset();
                }
                continue;
            }
            // a failure: what is in flight still counts, the rest comes again
            pipe.drain().await;
            let acked = self
                .confirm(conn, reader, &mut window, &mut pipe, &mut state)
                .await?;
            let end = pipe.take_end();
            reader.rewind();
            // what was sent and not acked may be stored: a new horizon for the next look-ups
            lookups.reset();
            let failed = match &end {
                BatchEnd::RowFailed { seq, .. } => window.unacked_row(*seq, &acked),
                _ => None,
            };
            window = Window::default();
            match end {
                BatchEnd::Done | BatchEnd::LeaseUnconfirmed => {}
                BatchEnd::Transient => {
                    if !backoff.sleep(&self.shutdown).await {
                        break;
                    }
                }
                BatchEnd::RowFailed {
                    seq,
                    error,
                    park_now,
                    ..
                } => {
                    let Some((row, end_lsn)) = failed else {
                        continue;
                    };
                    let n = state.attempts.entry(row.id).or_insert(0);
                    *n += 1;
                    let n = *n;
                    if park_now || n >= cfg.max_attempts {
                        wal::park(conn, &cfg.table, &row, n as i32, &error).await?;
                        state.attempts.remove(&row.id);
                        state.parked.insert((row.id, end_lsn));
                        metrics::counter!(m::ROWS_PARKED).increment(1);
                        error!(outbox.seq = seq, outbox.id = %row.id, error = %error, "event parked: JetStream keeps rejecting it, so log tailing passes over it (later events of its aggregate are not held back); `outbox-relay parked` lists it, `outbox-relay retry` publishes it again");
                    } else {
                        warn!(outbox.seq = seq, attempts = n, error = %error, "publish rejected; the slot waits and retries");
                        if !backoff.sleep(&self.shutdown).await {
                            break;
                        }
                    }
                }
            }
        }
        // stopping: the acks in flight still count
        pipe.drain().await;
        self.confirm(conn, reader, &mut window, &mut pipe, &mut state)
            .await?;
        Ok(())
    }

    /// Adds `batch` to the window and sends its rows (not the parked ones) into the pipeline,
    /// until it stops. Before a row is sent, a lease in doubt is renewed with a query: a
    /// transaction of many events is read whole and may take longer than half the lease to
    /// publish, and the lease must not lapse on a live session.
    #[allow(clippy::too_many_arguments)]
    async fn send(
        &self,
        conn: &mut AsyncPgConnection,
        pipe: &mut Pipeline<'_>,
        window: &mut Window,
        lookups: &mut Lookups,
        batch: WalBatch,
        parked: &HashSet<(Uuid, Lsn)>,
        lease: &Lease,
    ) -> Result<(), WalError> {
        window.caught_up_to = window.caught_up_to.max(batch.caught_up_to);
        let (rows, txn_of) = pending_rows(&batch, parked);
        // transactions read again (after a restart or a failed publish) may be in the stream
        // already: their rows old enough for that are looked up, and found ones are confirmed
        // in their turn, not sent
        if !pipe.stopped() {
            match lookups.stored(&rows).await {
                Ok(stored) => pipe.already_stored(stored),
                Err(e) => {
                    warn!(error = %e, "rows in doubt cannot be looked up; reading them again");
                    pipe.stop(BatchEnd::Transient);
                }
            }
        }
        let base = window.batch.transactions.len();
        for (row, t) in rows.into_iter().zip(txn_of) {
            if !pipe.stopped() {
                if !lease.is_valid() {
                    let started = Instant::now();
                    outbox_diesel::relay::keep_alive(conn).await?;
                    lease.confirm(started);
                }
                pipe.send(&row).await;
            }
            window.rows.push(row);
            window.txn_of.push(base + t);
        }
        window.batch.transactions.extend(batch.transactions);
        Ok(())
    }

    /// Confirms the slot past the transactions of the window acked whole, and drops them.
    /// Returns every acked `seq` still in the window when the pipeline has stopped (for the
    /// failure's row), else nothing.
    async fn confirm(
        &self,
        conn: &mut AsyncPgConnection,
        reader: &mut WalReader,
        window: &mut Window,
        pipe: &mut Pipeline<'_>,
        state: &mut State,
    ) -> Result<Vec<i64>, WalError> {
        let acked = pipe.take_acked();
        if !state.attempts.is_empty() {
            for seq in &acked {
                if let Some(r) = window.rows.iter().find(|r| r.seq == *seq) {
                    state.attempts.remove(&r.id);
                }
            }
        }
        let (confirm_to, max_seq, first_open, all_acked) = if pipe.stopped() {
            let all = window.acked_seqs(&acked);
            window.batch.caught_up_to = window.caught_up_to;
            let (to, max_seq, first_open) =
                confirmable(&window.batch, &window.rows, &window.txn_of, &all);
            (to, max_seq, first_open, all)
        } else {
            let (to, max_seq, first_open) = window.ack_in_order(acked.len());
            (to, max_seq, first_open, Vec::new())
        };
        state.oldest_unconfirmed =
            first_open.and_then(|i| window.batch.transactions.get(i).map(|t| t.commit_time));
        if let Some(to) = confirm_to
            && to > state.confirmed
        {
            state.confirmed = match reader.advance(conn, to).await {
                Ok(lsn) => lsn,
                // confirmed on the next round; until then a restart repeats a little more
                Err(WalError::SlotBusy { .. }) => state.confirmed,
                Err(e) => return Err(e),
            };
            reader.settle_released(conn, state.confirmed).await?;
            state.max_confirmed_seq = state.max_confirmed_seq.max(max_seq);
            let confirmed = state.confirmed;
            state.parked.retain(|(_, lsn)| *lsn > confirmed);
            debug!(lsn = %state.confirmed, "slot confirmed");
        }
        if !pipe.stopped() {
            window.drop_confirmed(first_open.unwrap_or(window.batch.transactions.len()));
        }
        Ok(all_acked)
    }

    /// Refreshes the slot's lag figures and warns when it lags.
    async fn stats(
        &self,
        conn: &mut AsyncPgConnection,
        reader: &WalReader,
        state: &State,
    ) -> Result<(), WalError> {
        let slot = reader.slot();
        let cfg = &*self.cfg;
        let lag_seconds = state
            .oldest_unconfirmed
            .map(|t| (Utc::now() - t).to_std().unwrap_or_default().as_secs_f64())
            .unwrap_or(0.0);
        metrics::gauge!(m::SLOT_LAG_SECONDS).set(lag_seconds);
        reader.save_position(conn, state.confirmed).await?;
        let Some(lag) = wal::slot_lag(conn, reader.slot()).await? else {
            return Ok(());
        };
        metrics::gauge!(m::SLOT_LAG_BYTES).set(lag.lag_bytes as f64);
        metrics::gauge!(m::SLOT_RETAINED_BYTES).set(lag.retained_bytes as f64);
        let lagging = lag.lag_bytes as u64 > cfg.slot_lag_warn_bytes
            || lag_seconds > cfg.stall_after.as_secs_f64();
        metrics::gauge!(m::SLOT_LAGGING).set(if lagging { 1.0 } else { 0.0 });
        metrics::gauge!(m::STALLED).set(if lag_seconds > cfg.stall_after.as_secs_f64() {
            1.0
        } else {
            0.0
        });
        if lagging {
            warn!(
                slot,
                lag_bytes = lag.lag_bytes,
                lag_seconds,
                retained_bytes = lag.retained_bytes,
                "the replication slot lags: PostgreSQL keeps its WAL until the relay confirms it (see max_slot_wal_keep_size)"
            );
        }
        if matches!(lag.wal_status.as_deref(), Some("unreserved" | "lost")) {
            error!(slot, wal_status = ?lag.wal_status, "the replication slot is about to lose (or lost) WAL it needs: max_slot_wal_keep_size is reached");
        }
        Ok(())
    }

    /// Deletes captured rows older than the retention, in batches.
    async fn cleanup(&self, conn: &mut AsyncPgConnection, state: &State) -> Result<(), WalError> {
        if state.max_confirmed_seq <= 0 {
            return Ok(());
        }
        const LIMIT: i64 = 5_000;
        loop {
            let n = wal::delete_captured(
                conn,
                &self.cfg.table,
                state.max_confirmed_seq,
                self.cfg.captured_retention,
                LIMIT,
            )
            .await?;
            metrics::counter!(m::CAPTURED_DELETED).increment(n as u64);
            if n > 0 {
                debug!(deleted = n, "captured rows deleted");
            }
            if (n as i64) < LIMIT || self.shutdown.is_cancelled() {
                return Ok(());
            }
        }
    }
}

/// The rows to publish, in commit order, without parked ones, and each row's transaction.
fn pending_rows(batch: &WalBatch, parked: &HashSet<(Uuid, Lsn)>) -> (Vec<OutboxRow>, Vec<usize>) {
    let mut rows = Vec::new();
    let mut txn_of = Vec::new();
    for (t, tx) in batch.transactions.iter().enumerate() {
        for row in &tx.rows {
            if !parked.contains(&(row.id, tx.end_lsn)) {
                rows.push(row.clone());
                txn_of.push(t);
            }
        }
    }
    (rows, txn_of)
}

/// How far the slot may be confirmed: past the longest run of transactions whose rows were
/// all acked (and past the whole read when every one was). Returns that position, the highest
/// `seq` in it, and the first transaction not confirmed.
fn confirmable(
    batch: &WalBatch,
    rows: &[OutboxRow],
    txn_of: &[usize],
    acked: &[i64],
) -> (Option<Lsn>, i64, Option<usize>) {
    let mut acked_left: HashMap<i64, usize> = HashMap::new();
    for seq in acked {
        *acked_left.entry(*seq).or_default() += 1;
    }
    let mut complete = vec![true; batch.transactions.len()];
    for (row, &t) in rows.iter().zip(txn_of) {
        match acked_left.get_mut(&row.seq) {
            Some(n) if *n > 0 => *n -= 1,
            _ => complete[t] = false,
        }
    }
    let mut to = None;
    let mut max_seq = 0;
    for (t, tx) in batch.transactions.iter().enumerate() {
        if !complete[t] {
            return (to, max_seq, Some(t));
        }
        to = Some(tx.end_lsn);
        max_seq = tx.rows.iter().map(|r| r.seq).fold(max_seq, i64::max);
    }
    (to.max(batch.caught_up_to), max_seq, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_diesel::wal::Transaction;

    fn row(seq: i64) -> OutboxRow {
        OutboxRow {
            seq,
            id: Uuid::now_v7(),
            aggregate_type: "a".into(),
            aggregate_id: "1".into(),
            event_type: "e".into(),
            payload: serde_json::json!({}).into(),
            headers: serde_json::json!({}),
            created_at: Utc::now(),
            attempts: 0,
        }
    }

    fn batch() -> WalBatch {
        let tx = |end: u64, seqs: &[i64]| Transaction {
            xid: end as u32,
            end_lsn: Lsn(end),
            commit_time: Utc::now(),
            rows: seqs.iter().map(|&s| row(s)).collect(),
        };
        WalBatch {
            // commit order differs from seq order
            transactions: vec![tx(100, &[5, 6]), tx(200, &[3]), tx(300, &[7])],
            caught_up_to: Some(Lsn(400)),
            messages: 10,
        }
    }

    #[test]
    fn confirms_only_past_whole_acked_transactions() {
        let b = batch();
        let (rows, txn_of) = pending_rows(&b, &HashSet::new());
        assert_eq!(rows.iter().map(|r| r.seq).collect::<Vec<_>>(), [5, 6, 3, 7]);
        // all acked: past the whole read
        assert_eq!(
            confirmable(&b, &rows, &txn_of, &[5, 6, 3, 7]),
            (Some(Lsn(400)), 7, None)
        );
        // 6 failed while 3 and 7 were acked: nothing past the first transaction's start
        assert_eq!(
            confirmable(&b, &rows, &txn_of, &[5, 3, 7]),
            (None, 0, Some(0))
        );
        // the last transaction is not acked yet
        assert_eq!(
            confirmable(&b, &rows, &txn_of, &[5, 6, 3]),
            (Some(Lsn(200)), 6, Some(2))
        );
        assert_eq!(confirmable(&b, &rows, &txn_of, &[]), (None, 0, Some(0)));
    }

    #[test]
    fn parked_events_are_passed_over_in_their_transaction_only() {
        let b = batch();
        let parked: HashSet<_> = [(b.transactions[0].rows[1].id, Lsn(100))].into();
        let (rows, txn_of) = pending_rows(&b, &parked);
        assert_eq!(rows.iter().map(|r| r.seq).collect::<Vec<_>>(), [5, 3, 7]);
        assert_eq!(
            confirmable(&b, &rows, &txn_of, &[5, 3, 7]).0,
            Some(Lsn(400))
        );
        let elsewhere: HashSet<_> = [(b.transactions[0].rows[1].id, Lsn(200))].into();
        assert_eq!(pending_rows(&b, &elsewhere).0.len(), 4);
    }

    /// The window as `send` fills it from `b`.
    fn window(b: WalBatch) -> Window {
        let (rows, txn_of) = pending_rows(&b, &HashSet::new());
        Window {
            caught_up_to: b.caught_up_to,
            batch: b,
            rows,
            txn_of,
            acked: 0,
        }
    }

    #[test]
    fn the_window_confirms_acks_in_order_as_confirmable_does() {
        // acks in send order, one at a time: the same answers as the general function
        for n in 0..=4 {
            let mut w = window(batch());
            let seqs = w.acked_seqs(&[]);
            assert!(seqs.is_empty());
            let in_order: Vec<i64> = w.rows[..n].iter().map(|r| r.seq).collect();
            let mut b = w.batch.clone();
            b.caught_up_to = w.caught_up_to;
            let expected = confirmable(&b, &w.rows, &w.txn_of, &in_order);
            assert_eq!(w.ack_in_order(n), expected, "{n} acks");
        }
    }

    #[test]
    fn the_window_drops_what_is_confirmed_and_keeps_the_rest_in_order() {
        let mut w = window(batch());
        // the first transaction, then part of the second read
        assert_eq!(w.ack_in_order(3), (Some(Lsn(200)), 6, Some(2)));
        w.drop_confirmed(2);
        assert_eq!(w.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), [7]);
        assert_eq!((w.txn_of.as_slice(), w.acked), (&[0][..], 0));
        assert_eq!(w.batch.transactions[0].end_lsn, Lsn(300));
        // the failed row is found with its transaction's end, an acked one is not
        assert_eq!(
            w.unacked_row(7, &[]).map(|(r, lsn)| (r.seq, lsn)),
            Some((7, Lsn(300)))
        );
        assert!(w.unacked_row(7, &[7]).is_none());
        assert_eq!(w.acked_seqs(&[7]), [7]);
        assert_eq!(w.ack_in_order(1), (Some(Lsn(400)), 7, None));
        w.drop_confirmed(1);
        assert!(w.rows.is_empty() && w.batch.transactions.is_empty() && w.acked == 0);
    }

    #[test]
    fn a_transaction_whose_events_are_all_parked_is_confirmed_with_its_neighbours() {
        let b = batch();
        let parked: HashSet<_> = [(b.transactions[1].rows[0].id, Lsn(200))].into();
        let (rows, txn_of) = pending_rows(&b, &parked);
        let mut w = Window {
            caught_up_to: b.caught_up_to,
            batch: b,
            rows,
            txn_of,
            acked: 0,
        };
        // 5 and 6 acked: the parked-only transaction at 200 goes with the first
        assert_eq!(w.ack_in_order(2), (Some(Lsn(200)), 6, Some(2)));
    }
}
