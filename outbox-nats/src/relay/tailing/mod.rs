//! The `log-tailing` mode: one reader per logical replication slot reads the outbox table's
//! committed inserts from the WAL in commit order, publishes them with the same contract as
//! the polling modes, and confirms the slot only past transactions JetStream acked whole.
//!
//! One reader per slot: the reader holds the session advisory lock
//! `(outbox_diesel::relay::SLOT_LOCK_KEY, hashtext(slot))`, a key apart from the ordered mode's
//! partition locks (which use the table's OID). Other relays in this mode stand by, trying the
//! lock every `standby_interval`, and at once when a reader that stops cleanly says it let go
//! (`NOTIFY` on the table's members' channel). PostgreSQL releases the lock when the reader's
//! connection drops, and ends a silent reader's session after the lease (see `lease.rs`), so a
//! paused reader is replaced and, having no recent answer from its session, publishes nothing
//! when it wakes.
//!
//! A crash can only repeat, never skip: the slot's confirmed position moves only to the end
//! of a transaction whose events, and every earlier transaction's, JetStream acked. The next
//! reader reads from there; what was published after it comes again: JetStream drops it
//! within the duplicate window, and a row older than that is looked up in the stream first
//! and confirmed without being sent when it is there (see `reconcile`).
//!
//! Memory: the reader holds no more than `max_batch_bytes` of events read and not acked. A
//! read stops at what is left of that budget, inside a transaction too, so a transaction of
//! any size is published in parts while the rest of it is still being read; an acked event
//! is let go at once, its transaction remembered by a count until its end is read and acked.
//! The session is queried between parts (and before a send once half the lease has passed),
//! so a transaction that takes longer than the lease to publish keeps it.
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
use outbox_diesel::relay::AdvisoryLock;
use outbox_diesel::wal::{self, Lsn, SlotState, WalBatch, WalError, WalReader};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};
use uuid::Uuid;

mod first_start;

use super::window::Window;
use super::{Backoff, Health, Peers, Session, SessionEnd, reconnecting, sleep_or_notified};
use crate::RelayConfig;
use crate::lease::Lease;
use crate::metrics as m;
use crate::publish::pipeline::{BatchEnd, Pipeline};
use crate::publish::reconcile::{Lookups, Reconciler};

pub(crate) struct TailingRelay {
    pub(crate) cfg: Arc<RelayConfig>,
    /// The mode's own settings.
    pub(crate) mode: crate::LogTailing,
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
    /// Parked events, by id and their transaction's `commit_lsn`, passed over until confirmed.
    parked: HashSet<(Uuid, Lsn)>,
}

impl Session for TailingRelay {
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

impl TailingRelay {
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
        let slot = self.mode.slot_name(&cfg.table);
        let lease = Lease::new(cfg.lease);
        lease.configure(conn).await?;
        // stand by until this session holds the slot's lock, looking again at the reader's
        // word that it let go (a clean stop), or every `standby_interval` (a reader whose
        // session ended says nothing)
        let me = outbox_diesel::relay::backend_pid(conn).await?;
        let peers = Peers::listen(conn, &cfg.table, me).await?;
        let mut announced = false;
        loop {
            if self.shutdown.is_cancelled() {
                return Ok(());
            }
            let started = Instant::now();
            let mine = AdvisoryLock::Slot(&slot).try_lock(conn).await?;
            lease.confirm(started);
            if mine {
                break;
            }
            if !announced {
                info!(slot = %slot, "another relay reads the slot; standing by");
                announced = true;
            }
            let next_look = Instant::now() + cfg.standby_interval;
            while let Some(note) = sleep_or_notified(conn, &self.shutdown, next_look).await {
                if peers.is_peer(&note) {
                    break;
                }
            }
        }
        peers.unlisten(conn).await?;
        let mut reader = WalReader::new(
            cfg.table.clone(),
            slot.clone(),
            self.mode.publication_name(&cfg.table),
        )
        .streaming(&cfg.database_url, cfg.poll_interval)?
        .recover(self.mode.recover_slot)
        // making the slot may wait longer than the lease for running transactions
        .keep_session_alive(cfg.lease / 3);
        let state = reader.setup(conn).await?;
        self.set_reader(true);
        // the highest `seq` the first start published: its rows are captured too
        let mut published_seq = 0;
        if state != SlotState::Ready {
            match self.first_start(conn, &mut reader, &lease, backoff).await? {
                Some(seq) => published_seq = seq,
                None => return Ok(()),
            }
        }
        info!(slot = %slot, publication = %reader.publication(), "reading the slot");
        let result = self
            .read_loop(conn, &mut reader, &lease, backoff, published_seq)
            .await;
        if result.is_ok() {
            // a clean stop: confirm what was acked and hand the slot over at once
            reader.close(conn).await?;
            AdvisoryLock::Slot(&slot).unlock(conn).await?;
            peers.tell(conn, "released").await?;
            info!(slot = %slot, "slot released");
        }
        result
    }

    /// Reads the stream and keeps the NATS pipeline full across reads: the rows of what was
    /// read are sent while the acks of earlier ones arrive, and the slot is confirmed past the
    /// transactions acked whole, in commit order. What is read and not acked stays within
    /// `max_batch_bytes`: each read takes what is left of it (stopping inside a transaction if
    /// need be), and none is made while it is spent. A failed publish stops the sending; the
    /// acks in flight are let in, the slot confirmed as far as they allow, and the reader goes
    /// back to the confirmed position, so that what was not acked comes again. Rows up to
    /// `published_seq` (what the first start published) are captured from the start.
    async fn read_loop(
        &self,
        conn: &mut AsyncPgConnection,
        reader: &mut WalReader,
        lease: &Lease,
        backoff: &mut Backoff,
        published_seq: i64,
    ) -> Result<(), WalError> {
        let cfg = &*self.cfg;
        let mut state = State {
            confirmed: reader.confirmed(conn).await?.unwrap_or_default(),
            max_confirmed_seq: published_seq,
            ..State::default()
        };
        let mut next_stats = Instant::now();
        let mut next_cleanup = Instant::now() + self.mode.captured_cleanup_interval;
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
                next_cleanup = Instant::now() + self.mode.captured_cleanup_interval;
            }
            // The stream proves nothing about the session that holds the slot's lock, so the
            // lease is not confirmed by a read; the reader queries its session instead, while
            // idle or between the parts of a long transaction, before PostgreSQL ends it as
            // silent (whatever --stats-interval is).
            lease.renew_if_due(conn).await?;
            let room = cfg.max_batch_bytes.saturating_sub(window.bytes);
            if room == 0 && !pipe.is_empty() {
                // the budget is spent on events in flight: the oldest ack frees some
                lease.keep_alive(conn, pipe.next_ack()).await?;
                self.confirm(conn, reader, &mut window, &mut pipe, &mut state)
                    .await?;
                if !pipe.stopped() {
                    continue;
                }
            } else {
                // with acks in flight, take only what has arrived; else wait for a transaction
                let wait = if pipe.is_empty() {
                    cfg.poll_interval
                } else {
                    Duration::ZERO
                };
                let read = tokio::select! {
                    r = reader.read_within(conn, cfg.batch_size, room, wait) => r,
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
                    // nothing new: wait for the next ack or the next transaction, whichever
                    // comes first (waiting for every ack in flight let the commits meanwhile
                    // wait for the slowest of them, and come in bursts)
                    if !pipe.is_empty() {
                        let until = tokio::time::Instant::now() + cfg.poll_interval;
                        let next = async {
                            tokio::select! {
                                () = pipe.next_ack() => {}
                                _ = reader.wait_readable(until) => {}
                            }
                            pipe.take_arrived();
                        };
                        lease.keep_alive(conn, next).await?;
                    }
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
            }
            // a failure: what is in flight still counts, the rest comes again
            lease.keep_alive(conn, pipe.drain()).await?;
            self.confirm(conn, reader, &mut window, &mut pipe, &mut state)
                .await?;
            let end = pipe.take_end();
            reader.rewind();
            // what was sent and not acked may be stored: a new horizon for the next look-ups
            lookups.reset();
            let failed = match &end {
                BatchEnd::RowFailed { seq, .. } => window.unacked_row(*seq),
                _ => None,
            };
            window = Window::default();
            match end {
                BatchEnd::Done | BatchEnd::LeaseUnconfirmed => {}
                // a newer message on a subject: the session answers (or the slot is lost to
                // another reader), then the transactions again from the confirmed position
                BatchEnd::Fenced => lease.renew(conn).await?,
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
                    let Some((row, commit_lsn)) = failed else {
                        continue;
                    };
                    let n = state.attempts.entry(row.id).or_insert(0);
                    *n += 1;
                    let n = *n;
                    if park_now || n >= cfg.max_attempts {
                        wal::park(conn, &cfg.table, &row, n as i32, &error).await?;
                        state.attempts.remove(&row.id);
                        state.parked.insert((row.id, commit_lsn));
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
        lease.keep_alive(conn, pipe.drain()).await?;
        self.confirm(conn, reader, &mut window, &mut pipe, &mut state)
            .await?;
        Ok(())
    }

    /// Adds `batch` (whole transactions, or parts of one) to the window and sends its rows
    /// (not the parked ones) into the pipeline, until it stops. Before a row is sent, a lease
    /// in doubt is renewed with a query: a part may take longer than half the lease to
    /// publish (one ack round trip per event of one aggregate), and the lease must not lapse
    /// on a live session.
    /// Transactions read again (after a restart or a failed publish) may be in the stream
    /// already: their rows old enough for that are looked up first, and those found are
    /// confirmed in their turn, not sent.
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
        let first = window.add(batch, parked);
        if !pipe.stopped() {
            match lease
                .keep_alive(
                    conn,
                    lookups.stored(window.rows.range(first..).map(|(r, _)| r)),
                )
                .await?
            {
                Ok(stored) => pipe.already_stored(stored),
                Err(e) => {
                    warn!(error = %e, "rows in doubt cannot be looked up; reading them again");
                    pipe.stop(BatchEnd::Transient);
                }
            }
        }
        lease
            .keep_alive(
                conn,
                pipe.look_up(window.rows.range(first..).map(|(r, _)| r)),
            )
            .await?;
        for (row, _) in window.rows.range(first..) {
            if pipe.stopped() {
                break;
            }
            if !lease.is_valid() {
                lease.renew(conn).await?;
            }
            // a row waits for acks while the window is full: the session is kept meanwhile
            lease.keep_alive(conn, pipe.send(row)).await?;
        }
        Ok(())
    }

    /// Takes the acks that arrived out of the window and confirms the slot past the
    /// transactions acked whole, which leave the window.
    async fn confirm(
        &self,
        conn: &mut AsyncPgConnection,
        reader: &mut WalReader,
        window: &mut Window,
        pipe: &mut Pipeline<'_>,
        state: &mut State,
    ) -> Result<(), WalError> {
        let acked = pipe.take_acked();
        if !state.attempts.is_empty() {
            for seq in &acked {
                if let Some((r, _)) = window.rows.iter().find(|(r, _)| r.seq == *seq) {
                    state.attempts.remove(&r.id);
                }
            }
        }
        window.ack(&acked);
        let c = window.confirmable();
        if let Some(to) = c.to
            && to > state.confirmed
        {
            state.confirmed = match reader.advance(conn, to).await {
                Ok(lsn) => lsn,
                // confirmed on the next round; until then a restart repeats a little more
                Err(WalError::SlotBusy { .. }) => state.confirmed,
                Err(e) => return Err(e),
            };
            reader.settle_released(conn, state.confirmed).await?;
            state.max_confirmed_seq = state.max_confirmed_seq.max(c.max_seq);
            let confirmed = state.confirmed;
            state
                .parked
                .retain(|(_, commit_lsn)| !wal::confirms(confirmed, *commit_lsn));
            debug!(lsn = %state.confirmed, "slot confirmed");
        }
        window.drop_confirmed(c.done);
        state.oldest_unconfirmed = window.oldest();
        Ok(())
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
        let lagging = lag.lag_bytes as u64 > self.mode.slot_lag_warn_bytes
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
                self.mode.captured_retention,
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
