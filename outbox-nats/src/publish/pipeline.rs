//! Publishing rows: pipelined, in order, never two unacked messages of one
//! aggregate at once, stopping at the first failure.

use std::collections::hash_map::RandomState;
use std::collections::{HashSet, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::atomic::Ordering;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::{self, publish::PublishAck};
use outbox_diesel::relay::OutboxRow;
use tokio_util::sync::CancellationToken;
use tracing::warn;
use uuid::Uuid;

use super::acks::{ACK_TIMEOUT, AckInbox, Answer, read_ack, reply_number};
use super::fence::{FENCE_HEADER, Fence};
pub(crate) use super::outcome::BatchEnd;
use super::outcome::classify;
use crate::RelayConfig;
use crate::health::Health;
use crate::lease::Lease;
use crate::metrics as m;
use crate::publish::to_message;

/// Publishes `rows` in order, but for those of `stored` (already in the stream, see
/// [`Pipeline::already_stored`]), and waits for their acks. Returns the `seq` of the acked (or
/// stored) rows and how it ended.
pub(crate) async fn publish_batch(
    js: &jetstream::Context,
    cfg: &RelayConfig,
    rows: &[OutboxRow],
    stored: HashSet<Uuid>,
    lease: &Lease,
    health: &Health,
    shutdown: &CancellationToken,
) -> (Vec<i64>, BatchEnd) {
    metrics::histogram!(m::BATCH_ROWS).record(rows.len() as f64);
    let mut pipe = Pipeline::new(js, cfg, lease, health, shutdown);
    pipe.already_stored(stored);
    pipe.send_all(rows).await;
    pipe.drain().await;
    (pipe.take_acked(), pipe.take_end())
}

/// What is remembered of a sent row until its ack arrives.
struct Sent {
    /// The number its reply subject ends with: the rows in flight have consecutive numbers.
    id: u64,
    /// When its ack is late: the publish fails as timed out.
    deadline: tokio::time::Instant,
    /// Its ack once it arrived (or at once, for a row found in the stream).
    ack: Option<Result<PublishAck, PublishError>>,
    seq: i64,
    attempts: i32,
    /// The row's aggregate ([`Pipeline::key`]); `None` for a row found in the stream, which
    /// was not sent.
    key: Option<u64>,
    /// The subject, when the message carried the fence's expected sequence.
    fenced: Option<String>,
    /// Whether a refusal for a wrong last sequence can only be the fence's: the row's own
    /// headers carry no `Nats-Expected-Last-Sequence`.
    fence_only: bool,
    created_at: chrono::DateTime<chrono::Utc>,
    /// Its payload's length, counted against the byte budget while in flight.
    bytes: usize,
}

/// A window of publishes in flight on one connection that outlives a batch, so that the next
/// rows are sent while the acks of the previous ones arrive.
///
/// JetStream stores one connection's pipeline in send order, but a failed publish leaves a
/// hole that its retry fills after the later messages: so a row is sent only when no earlier
/// row of its aggregate waits for its ack (with the fence, no earlier message of its subject
/// either), and nothing is sent after a failure (or once the
/// lease is in doubt, or at shutdown) until [`Pipeline::take_end`] resets it.
///
/// Each ack arrives on the pipeline's [`AckInbox`], matched to its row by the number its reply
/// subject ends with.
pub(crate) struct Pipeline<'a> {
    cfg: &'a RelayConfig,
    lease: &'a Lease,
    health: &'a Health,
    shutdown: &'a CancellationToken,
    inbox: AckInbox,
    /// The rows in flight, in send order, with their acks as they arrive.
    sent: VecDeque<Sent>,
    /// The aggregates of the rows in flight, each as a 64-bit hash of its type and id
    /// ([`Pipeline::key`]): one hash per row, no copy of its strings. Two aggregates of one
    /// hash (with the process's random keys, about one pair in 2^64) only wait for each
    /// other's acks.
    keys: HashSet<u64, BuildHasherDefault<Prehashed>>,
    hasher: RandomState,
    /// The subjects of the fenced messages in flight: two aggregates may share a subject (a
    /// template without `{aggregate_type}`), and the fence allows one unacked message per
    /// subject.
    subjects: HashSet<String>,
    /// Rows the stream holds already (reconciled): settled in turn, not sent.
    stored: HashSet<Uuid>,
    /// The last sequence of each subject, in the ordered modes with the fence on.
    fence: Option<Fence>,
    acked: Vec<i64>,
    end: Option<BatchEnd>,
    /// The payload bytes of the publishes in flight: with the batches being read, within
    /// `max_batch_bytes`, so that slow acks cannot pile messages up in memory.
    in_flight_bytes: usize,
}

impl<'a> Pipeline<'a> {
    pub(crate) fn new(
        js: &'a jetstream::Context,
        cfg: &'a RelayConfig,
        lease: &'a Lease,
        health: &'a Health,
        shutdown: &'a CancellationToken,
    ) -> Self {
        let fence = cfg
            .mode
            .fence()
            .then(|| Fence::new(js.clone(), &cfg.stream));
        Pipeline {
            cfg,
            lease,
            health,
            shutdown,
            inbox: AckInbox::new(js.client()),
            sent: VecDeque::new(),
            keys: HashSet::default(),
            hasher: RandomState::new(),
            subjects: HashSet::new(),
            stored: HashSet::new(),
            fence,
            acked: Vec::new(),
            end: None,
            in_flight_bytes: 0,
        }
    }

    /// Sends `rows` in order, stopping at the first that cannot be sent; `false` when it stopped.
    #[tracing::instrument(name = "outbox.publish", level = "debug", skip_all, fields(batch.len = rows.len()))]
    pub(crate) async fn send_all(&mut self, rows: &[OutboxRow]) -> bool {
        self.look_up(rows).await;
        for row in rows {
            if !self.send(row).await {
                return false;
            }
        }
        true
    }

    /// Looks up, a few at once, the last sequence of the subjects of `rows` that the fence
    /// does not know and that no message in flight will tell (with the fence on): so that
    /// sending waits for no look-up. A failure stops the pipeline.
    pub(crate) async fn look_up<'r>(&mut self, rows: impl IntoIterator<Item = &'r OutboxRow>) {
        let Some(fence) = &mut self.fence else {
            return;
        };
        if self.end.is_some() {
            return;
        }
        let mut subjects = HashSet::new();
        for row in rows {
            if self.stored.contains(&row.id) {
                continue;
            }
            let subject = self.cfg.subject_template.render(
                &self.cfg.subject_prefix,
                &row.aggregate_type,
                &row.aggregate_id,
                &row.event_type,
            );
            // a subject in flight learns its sequence from the ack
            if fence.expected(&subject).is_none() && !self.subjects.contains(&subject) {
                subjects.insert(subject);
            }
        }
        if let Err(e) = fence.look_up(subjects.into_iter().collect()).await {
            metrics::counter!(m::PUBLISH_ERRORS, "kind" => "fence_lookup").increment(1);
            warn!(error = %e, "the last sequences of the batch's subjects cannot be looked up; the batch stops here and is retried");
            self.end = Some(BatchEnd::Transient);
        }
    }

    /// Rows (by id) whose message the stream holds already: when their turn comes, they count
    /// as acked, in send order, without being sent.
    pub(crate) fn already_stored(&mut self, ids: HashSet<Uuid>) {
        self.stored.extend(ids);
    }

    /// Stops the sending with `end` (unless it stopped already): nothing more is sent until
    /// [`Pipeline::take_end`].
    pub(crate) fn stop(&mut self, end: BatchEnd) {
        self.end.get_or_insert(end);
    }

    /// The row's aggregate as the set of aggregates in flight holds it.
    fn key(&self, row: &OutboxRow) -> u64 {
        self.hasher
            .hash_one((row.aggregate_type.as_str(), row.aggregate_id.as_str()))
    }

    /// Sends `row` once the window has room and no earlier row of its aggregate is unacked
    /// (a row [already stored](Pipeline::already_stored) is settled in its turn instead).
    /// `false` when the pipeline has stopped: the row was not sent, nor will any later one be.
    pub(crate) async fn send(&mut self, row: &OutboxRow) -> bool {
        if self.stored.contains(&row.id) {
            return self.settle_stored(row);
        }
        let key = self.key(row);
        let subject = self.fence.is_some().then(|| {
            self.cfg.subject_template.render(
                &self.cfg.subject_prefix,
                &row.aggregate_type,
                &row.aggregate_id,
                &row.event_type,
            )
        });
        let bytes = row.payload.as_str().len();
        while self.end.is_none()
            && !self.sent.is_empty()
            && (self.keys.contains(&key)
                || subject.as_ref().is_some_and(|s| self.subjects.contains(s))
                || self.sent.len() >= self.cfg.max_in_flight
                || self.in_flight_bytes + bytes > self.cfg.max_batch_bytes)
        {
            self.next_ack().await;
        }
        if self.end.is_some() || self.shutdown.is_cancelled() {
            return false;
        }
        if !self.lease.is_valid() {
            // a paused or cut-off relay must not publish what a new owner may have taken
            self.end = Some(BatchEnd::LeaseUnconfirmed);
            return false;
        }
        let mut msg = match to_message(row, &self.cfg.subject_template, &self.cfg.subject_prefix) {
            Ok(m) => m,
            Err(e) => {
                metrics::counter!(m::PUBLISH_ERRORS, "kind" => "invalid_row").increment(1);
                self.end = Some(BatchEnd::RowFailed {
                    seq: row.seq,
                    attempts: row.attempts,
                    error: e.to_string(),
                    park_now: true,
                });
                return false;
            }
        };
        let own_expectation = msg.headers.get("Nats-Expected-Last-Sequence").is_some();
        let fenced = match self.fence_message(&mut msg).await {
            Ok(fenced) => fenced,
            Err(e) => {
                metrics::counter!(m::PUBLISH_ERRORS, "kind" => "fence_lookup").increment(1);
                warn!(outbox.seq = row.seq, error = %e, "the last sequence of the row's subject cannot be looked up; the batch stops here and is retried");
                self.end = Some(BatchEnd::Transient);
                return false;
            }
        };
        match self.inbox.publish(msg).await {
            Ok(id) => {
                self.in_flight_bytes += bytes;
                self.sent.push_back(Sent {
                    id,
                    deadline: tokio::time::Instant::now() + ACK_TIMEOUT,
                    ack: None,
                    bytes,
                    seq: row.seq,
                    attempts: row.attempts,
                    created_at: row.created_at,
                    key: Some(key),
                    fence_only: fenced.is_some() && !own_expectation,
                    fenced: fenced.clone(),
                });
                self.keys.insert(key);
                if let Some(subject) = fenced {
                    self.subjects.insert(subject);
                }
                true
            }
            Err(e) => {
                self.forget_sequences();
                let fence_only = fenced.is_some() && !own_expectation;
                self.end = Some(classify(
                    row.seq,
                    row.attempts,
                    &e,
                    fence_only,
                    true,
                    self.health,
                ));
                false
            }
        }
    }

    /// Sets the fence's expected sequence on `msg` (with the fence on; it replaces a header of
    /// that name among the row's own), looking its subject up when unknown. Returns the
    /// subject when it did.
    async fn fence_message(
        &mut self,
        msg: &mut crate::publish::OutboxMessage,
    ) -> Result<Option<String>, async_nats::Error> {
        let Some(fence) = &mut self.fence else {
            return Ok(None);
        };
        let expected = match fence.expected(&msg.subject) {
            Some(seq) => seq,
            None => {
                fence.look_up(vec![msg.subject.clone()]).await?;
                fence.expected(&msg.subject).unwrap_or_default()
            }
        };
        msg.headers
            .insert(FENCE_HEADER, async_nats::HeaderValue::from(expected));
        Ok(Some(msg.subject.clone()))
    }

    /// Forgets what the fence knew of the subjects: after a takeover, or a failed publish.
    pub(crate) fn forget_sequences(&mut self) {
        if let Some(fence) = &mut self.fence {
            fence.forget();
        }
    }

    /// Settles a row the stream holds already, behind the acks in flight; `false` when the
    /// pipeline has stopped.
    fn settle_stored(&mut self, row: &OutboxRow) -> bool {
        if self.end.is_some() || self.shutdown.is_cancelled() {
            return false;
        }
        if !self.lease.is_valid() {
            self.end = Some(BatchEnd::LeaseUnconfirmed);
            return false;
        }
        self.stored.remove(&row.id);
        if let Some(fence) = &mut self.fence {
            // its message may be the subject's last: the next publish looks it up
            fence.forget_subject(&self.cfg.subject_template.render(
                &self.cfg.subject_prefix,
                &row.aggregate_type,
                &row.aggregate_id,
                &row.event_type,
            ));
        }
        self.sent.push_back(Sent {
            id: self.inbox.skip(),
            deadline: tokio::time::Instant::now(),
            ack: Some(Ok(PublishAck::default())),
            bytes: 0,
            seq: row.seq,
            attempts: row.attempts,
            created_at: row.created_at,
            key: None,
            fenced: None,
            fence_only: false,
        });
        true
    }

    /// Settles the oldest row in flight if its ack has arrived; whether it did.
    fn settle_front(&mut self) -> bool {
        let Some(result) = self.sent.front_mut().and_then(|front| front.ack.take()) else {
            return false;
        };
        if let Some(sent) = self.sent.pop_front() {
            self.in_flight_bytes = self.in_flight_bytes.saturating_sub(sent.bytes);
            self.on_ack(sent, result);
        }
        true
    }

    /// Waits for the oldest ack in flight, if any (taking the acks that arrived meanwhile).
    pub(crate) async fn next_ack(&mut self) {
        loop {
            if self.settle_front() {
                return;
            }
            let Some(front) = self.sent.front_mut() else {
                return;
            };
            match self.inbox.next(front.deadline).await {
                Answer::Message(msg) => {
                    file_ack(&mut self.sent, msg);
                    while let Some(msg) = self.inbox.try_next() {
                        file_ack(&mut self.sent, msg);
                    }
                }
                Answer::TimedOut => {
                    front.ack = Some(Err(PublishError::new(PublishErrorKind::TimedOut)));
                }
                Answer::Ended => {
                    // no ack will come for what is in flight
                    for sent in self.sent.iter_mut().filter(|s| s.ack.is_none()) {
                        sent.ack = Some(Err(PublishError::new(PublishErrorKind::BrokenPipe)));
                    }
                }
            }
        }
    }

    /// Takes the acks that have arrived, from the oldest in flight on, without waiting.
    pub(crate) fn take_arrived(&mut self) {
        while let Some(msg) = self.inbox.try_next() {
            file_ack(&mut self.sent, msg);
        }
        while self.settle_front() {}
    }

    /// Waits for every ack in flight.
    pub(crate) async fn drain(&mut self) {
        while !self.sent.is_empty() {
            self.next_ack().await;
        }
    }

    /// The lease it publishes under.
    pub(crate) fn lease(&self) -> &'a Lease {
        self.lease
    }

    /// The relay's configuration.
    pub(crate) fn config(&self) -> &'a RelayConfig {
        self.cfg
    }

    /// Nothing in flight.
    pub(crate) fn is_empty(&self) -> bool {
        self.sent.is_empty()
    }

    /// Whether a failure, a lease in doubt or shutdown stopped the sending.
    pub(crate) fn stopped(&self) -> bool {
        self.end.is_some()
    }

    /// The `seq` of the rows acked since the last call, to be marked.
    pub(crate) fn take_acked(&mut self) -> Vec<i64> {
        std::mem::take(&mut self.acked)
    }

    /// How the sending ended (`Done` when it did not stop), and lets it send again. After a
    /// stop, the fence forgets what it knew: what was in flight may or may not be stored.
    pub(crate) fn take_end(&mut self) -> BatchEnd {
        match self.end.take() {
            Some(end) => {
                self.forget_sequences();
                end
            }
            None => BatchEnd::Done,
        }
    }

    fn on_ack(&mut self, sent: Sent, result: Result<PublishAck, PublishError>) {
        let Some(key) = sent.key else {
            // found in the stream: published before, by this relay or an earlier one
            self.health.progressed();
            self.acked.push(sent.seq);
            metrics::counter!(m::EVENTS_RECONCILED).increment(1);
            return;
        };
        self.keys.remove(&key);
        if let Some(subject) = &sent.fenced {
            self.subjects.remove(subject);
        }
        match result {
            Ok(ack) => {
                self.health.progressed();
                self.health.stream_refused.store(false, Ordering::Relaxed);
                self.acked.push(sent.seq);
                metrics::counter!(m::EVENTS_PUBLISHED).increment(1);
                if ack.duplicate {
                    metrics::counter!(m::DUPLICATES).increment(1);
                }
                if let (Some(fence), Some(subject)) = (&mut self.fence, sent.fenced) {
                    if ack.duplicate {
                        // the sequence of the first copy, which may not be the subject's last
                        fence.forget_subject(&subject);
                    } else {
                        fence.set(subject, ack.sequence);
                    }
                }
                let latency = (chrono::Utc::now() - sent.created_at)
                    .to_std()
                    .unwrap_or_default();
                metrics::histogram!(m::COMMIT_TO_ACK).record(latency.as_secs_f64());
            }
            Err(e) => {
                self.forget_sequences();
                // the first failure is the one to report (the acks in flight behind it fail
                // alike: one line, not one per message); a row failure outranks a lease stop
                let first = matches!(self.end, None | Some(BatchEnd::LeaseUnconfirmed));
                let failure = classify(
                    sent.seq,
                    sent.attempts,
                    &e,
                    sent.fence_only,
                    first,
                    self.health,
                );
                if first {
                    self.end = Some(failure);
                }
            }
        }
    }
}

/// Files the ack `msg` with the row in flight its reply subject numbers (an ack of a row no
/// longer in flight, timed out before, is dropped).
fn file_ack(sent: &mut VecDeque<Sent>, msg: async_nats::Message) {
    let Some(front) = sent.front() else { return };
    let Some(id) = reply_number(&msg) else {
        return;
    };
    let Some(index) = id.checked_sub(front.id) else {
        return;
    };
    if let Some(row) = usize::try_from(index).ok().and_then(|i| sent.get_mut(i))
        && row.id == id
        && row.ack.is_none()
    {
        row.ack = Some(read_ack(&msg));
    }
}

/// The hasher of a set of hashes: a value hashed already is its own hash.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // only `u64`s are hashed with it; anything else is folded in, never lost
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::acks::answer;

    fn in_flight(ids: std::ops::Range<u64>) -> VecDeque<Sent> {
        ids.map(|id| Sent {
            id,
            deadline: tokio::time::Instant::now(),
            ack: None,
            seq: id as i64,
            attempts: 0,
            key: Some(id),
            fenced: None,
            fence_only: false,
            created_at: chrono::Utc::now(),
            bytes: 10,
        })
        .collect()
    }

    const OK: &str = r#"{"stream":"S","seq":42,"duplicate":true}"#;

    #[test]
    fn acks_are_filed_with_the_row_their_reply_subject_numbers_in_any_order() {
        let mut sent = in_flight(5..8);
        file_ack(&mut sent, answer("_INBOX.abc.7", OK, None));
        file_ack(&mut sent, answer("_INBOX.abc.5", OK, None));
        let filed: Vec<bool> = sent.iter().map(|s| s.ack.is_some()).collect();
        assert_eq!(filed, [true, false, true]);
        let ack = sent[0]
            .ack
            .take()
            .and_then(Result::ok)
            .map(|a| (a.sequence, a.duplicate));
        assert_eq!(ack, Some((42, true)));
        // a row timed out and gone (4), a number never sent (9), a subject without a number, and
        // a second answer for a row answered already change nothing
        for stale in [
            "_INBOX.abc.4",
            "_INBOX.abc.9",
            "_INBOX.abc.x",
            "_INBOX.abc.7",
        ] {
            file_ack(&mut sent, answer(stale, r#"{"error":{"code":503}}"#, None));
        }
        assert!(sent[0].ack.is_none() && sent[1].ack.is_none());
        assert!(matches!(sent[2].ack, Some(Ok(_))));
    }
}
