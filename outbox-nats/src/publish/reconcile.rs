//! Reconciling before re-publishing: whether a row that may have been published already is
//! in the stream, so that the relay marks it instead of storing it a second time after the
//! duplicate window.
//!
//! JetStream drops a message whose `Nats-Msg-Id` it saw within the stream's duplicate window.
//! A row published, then not marked (a relay killed between the ack and the mark, an ack lost
//! while NATS was unreachable), and sent again later than that would be stored twice. So a row
//! older than the window minus a margin ([`Reconciler::check_after`]) is looked up before it
//! is sent: the ids of the messages stored on the row's subject since the row was recorded
//! (less [`CLOCK_SKEW`]) are read, and the row counts as published if and only if its id is
//! among them.
//!
//! The decision is by message id alone. A later row of the aggregate in the stream proves
//! nothing: a transaction that committed after a later row of its aggregate was published (a
//! late commit) has never been sent, and marking it would lose it.
//!
//! The relay cannot tell a row that a killed relay sent from one that nobody sent (knowing it
//! would take a write before every publish, doubling the database work of the default mode),
//! so every row past the threshold is looked up. A relay that keeps up never looks anything
//! up; rows past the threshold appear after an outage longer than the window.
//!
//! # The read
//!
//! For a row, the ids of the messages stored on its subject since `since` (its `created_at`
//! less [`CLOCK_SKEW`]), up to the horizon (below). A stream stores its messages in time
//! order, so the first sequence stored at or after `since` is found once for every subject of
//! a pass, by a binary search over the stream's sequences (the first message of any subject
//! at or after a sequence); then each subject is read forward from there: the first message
//! of the subject at or after a sequence, again and again, up to the horizon. A subject with
//! nothing recent costs one request; one with `k` messages since the row, `k + 1`. Each
//! request is a `STREAM.MSG.GET` answered by the stream's leader (nats-server 2.9 and later),
//! so a stored message is seen whether replicas are current or not.
//!
//! # The horizon and the cache
//!
//! A message of a row in doubt was stored before the relay took the row over: before its
//! session took the partition (or the slot), or before the failed publish after which it
//! reads the row again. So a [`Lookups`] reads the stream's last sequence once (the horizon)
//! and reads no message past it: what the relay publishes itself while it catches up is never
//! read. Up to the horizon the stream does not change, so what a subject's read found is kept
//! and serves every later row of the subject: a subject costs one read per horizon, however
//! many batches its rows come in. [`Lookups::reset`] starts a new horizon; modes call it when
//! they take work over and after a failed publish.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use async_nats::jetstream::{self, message::StreamMessage, stream::LastRawMessageErrorKind};
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use outbox_diesel::relay::OutboxRow;
use uuid::Uuid;

use crate::publish::subject::SubjectTemplate;

/// How far the clocks of PostgreSQL (which sets `created_at`) and NATS (which stamps a
/// stored message) may differ: the read starts this long before a row's `created_at`.
pub const CLOCK_SKEW: Duration = Duration::from_secs(5);

/// The most the margin below the duplicate window may be ([`Reconciler::check_after`]).
pub const MAX_MARGIN: Duration = Duration::from_secs(10);

/// Subjects read at once in a pass.
const CONCURRENT_READS: usize = 8;

/// The stream could not be read; the rows are not sent, and the relay retries.
#[derive(Debug, thiserror::Error)]
#[error("cannot read stream {stream} to reconcile rows in doubt: {source}")]
pub struct ReconcileError {
    stream: String,
    #[source]
    source: async_nats::Error,
}

/// The threshold and the stream of the look-ups (see the [module documentation](self)); a
/// relay's modes each make their own [`Lookups`] from it.
#[derive(Debug, Clone)]
pub struct Reconciler {
    js: jetstream::Context,
    stream: String,
    prefix: String,
    template: SubjectTemplate,
    check_after: Duration,
}

impl Reconciler {
    /// A reconciler for `stream`, whose duplicate window is `duplicate_window`, of the
    /// messages the relay makes with `template` and `prefix`.
    pub fn new(
        js: jetstream::Context,
        stream: &str,
        template: SubjectTemplate,
        prefix: &str,
        duplicate_window: Duration,
    ) -> Self {
        let margin = (duplicate_window / 2).min(MAX_MARGIN);
        Reconciler {
            js,
            stream: stream.to_owned(),
            prefix: prefix.to_owned(),
            template,
            check_after: duplicate_window.saturating_sub(margin),
        }
    }

    /// The age from which a row is looked up before it is sent: the duplicate window less a
    /// margin of half the window, at most [`MAX_MARGIN`] (110 s for a window of 2 minutes,
    /// 0.5 s for 1 s). The margin covers the clocks of the relay, PostgreSQL and NATS, and
    /// the time between the look-up and the send.
    pub fn check_after(&self) -> Duration {
        self.check_after
    }

    /// Whether `row` is old enough at `now` to be looked up before it is sent.
    pub fn needs_check(&self, row: &OutboxRow, now: DateTime<Utc>) -> bool {
        (now - row.created_at)
            .to_std()
            .is_ok_and(|age| age >= self.check_after)
    }

    /// Look-ups with no horizon yet: the first that needs the stream reads it.
    pub fn lookups(&self) -> Lookups {
        Lookups {
            reconciler: self.clone(),
            horizon: None,
            start: None,
            found: HashMap::new(),
        }
    }

    fn error(&self, source: async_nats::Error) -> ReconcileError {
        ReconcileError {
            stream: self.stream.clone(),
            source,
        }
    }
}

/// The most subjects whose reads [`Lookups`] keeps; past it, it forgets them all.
const MAX_KEPT_SUBJECTS: usize = 100_000;

/// What a subject's read found: the ids stored since `since`, up to the horizon.
#[derive(Debug)]
struct Found {
    since: DateTime<Utc>,
    ids: HashSet<String>,
}

/// One relay task's look-ups: the horizon, and what the reads up to it found (see [the horizon
/// and the cache](self#the-horizon-and-the-cache)).
#[derive(Debug)]
pub struct Lookups {
    reconciler: Reconciler,
    /// The stream's first and last sequence when the horizon was read.
    horizon: Option<(u64, u64)>,
    /// A time, and the first sequence stored at or after it.
    start: Option<(DateTime<Utc>, u64)>,
    found: HashMap<String, Found>,
}

impl Lookups {
    /// Forgets the horizon and what was found: the next look-up reads the stream's last
    /// sequence again. Called when the task takes work over, and after a failed publish.
    pub fn reset(&mut self) {
        self.horizon = None;
        self.start = None;
        self.found.clear();
    }

    /// One pass: the ids of the rows of `rows` that are old enough to be looked up and whose
    /// message the stream holds. Younger rows cost nothing; a subject costs one read per
    /// horizon, however many rows of it come, in this pass or later ones.
    pub async fn stored<'a>(
        &mut self,
        rows: impl IntoIterator<Item = &'a OutboxRow>,
    ) -> Result<HashSet<Uuid>, ReconcileError> {
        let r = &self.reconciler;
        let now = Utc::now();
        let mut since_of: HashMap<String, DateTime<Utc>> = HashMap::new();
        let mut checked: Vec<(Uuid, String)> = Vec::new();
        for row in rows.into_iter().filter(|row| r.needs_check(row, now)) {
            let subject = r.template.render(
                &r.prefix,
                &row.aggregate_type,
                &row.aggregate_id,
                &row.event_type,
            );
            let since = row.created_at - CLOCK_SKEW;
            if self.found.get(&subject).is_none_or(|f| since < f.since) {
                since_of
                    .entry(subject.clone())
                    .and_modify(|s| *s = (*s).min(since))
                    .or_insert(since);
            }
            checked.push((row.id, subject));
        }
        if checked.is_empty() {
            return Ok(HashSet::new());
        }
        if !since_of.is_empty() {
            let stream =
                r.js.get_stream_no_info(&r.stream)
                    .await
                    .map_err(|e| r.error(e.into()))?;
            let (first, last) = match self.horizon {
                Some(h) => h,
                None => {
                    let info = stream.get_info().await.map_err(|e| r.error(e.into()))?;
                    let h = (info.state.first_sequence, info.state.last_sequence);
                    self.horizon = Some(h);
                    h
                }
            };
            // where the reads start: the first sequence stored since the earliest row's time
            let earliest = since_of.values().min().copied().unwrap_or(now);
            let from = match self.start {
                Some((since, seq)) if since <= earliest => seq,
                _ => {
                    let seq = first_seq_since(&stream, earliest, first, last)
                        .await
                        .map_err(|e| r.error(e))?;
                    self.start = Some((earliest, seq));
                    seq
                }
            };
            let reads: Vec<_> = futures_util::stream::iter(since_of)
                .map(|(subject, since)| {
                    let stream = &stream;
                    async move {
                        let ids = ids_since(stream, &subject, since, from, last).await;
                        (subject, since, ids)
                    }
                })
                .buffer_unordered(CONCURRENT_READS)
                .collect()
                .await;
            if self.found.len() + reads.len() > MAX_KEPT_SUBJECTS {
                self.found.clear();
            }
            for (subject, since, ids) in reads {
                let ids = ids.map_err(|e| self.reconciler.error(e))?;
                self.found.insert(subject, Found { since, ids });
            }
        }
        let looked_up = checked.len();
        let stored: HashSet<Uuid> = checked
            .into_iter()
            .filter(|(id, subject)| {
                self.found
                    .get(subject)
                    .is_some_and(|f| f.ids.contains(&id.to_string()))
            })
            .map(|(id, _)| id)
            .collect();
        tracing::debug!(
            rows = looked_up,
            stored = stored.len(),
            horizon = ?self.horizon,
            "rows in doubt looked up in the stream"
        );
        Ok(stored)
    }
}

/// The first sequence among `first..=upto` whose message was stored at or after `since`
/// (`upto + 1` when none was): a binary search over the stream, every subject alike.
pub async fn first_seq_since(
    stream: &jetstream::stream::Stream<()>,
    since: DateTime<Utc>,
    first: u64,
    upto: u64,
) -> Result<u64, async_nats::Error> {
    let since = nats_time(since)?;
    let (mut lo, mut hi) = (first.max(1), upto.saturating_add(1));
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match first_from(stream, ">", mid).await? {
            Some(m) if m.sequence <= upto && m.time < since => lo = m.sequence + 1,
            // stored at or after `since`, or nothing up to the horizon: no later start
            _ => hi = mid,
        }
    }
    Ok(lo)
}

/// The `Nats-Msg-Id` of every message of `subject` stored at or after `since`, among the
/// stream's sequences `from..=upto` (see [the read](self#the-read)).
pub async fn ids_since(
    stream: &jetstream::stream::Stream<()>,
    subject: &str,
    since: DateTime<Utc>,
    from: u64,
    upto: u64,
) -> Result<HashSet<String>, async_nats::Error> {
    let since = nats_time(since)?;
    let mut ids = HashSet::new();
    let mut seq = from;
    while seq <= upto {
        let Some(m) = first_from(stream, subject, seq).await? else {
            break;
        };
        if m.sequence > upto {
            break;
        }
        if m.time >= since
            && let Some(id) = m.headers.get("Nats-Msg-Id")
        {
            ids.insert(id.as_str().to_owned());
        }
        seq = m.sequence + 1;
    }
    Ok(ids)
}

/// `t` as async-nats's time (whichever time crate it was built with).
fn nats_time(t: DateTime<Utc>) -> Result<async_nats::datetime::DateTime, async_nats::Error> {
    let nanos = t.timestamp_nanos_opt().unwrap_or(i64::MIN);
    async_nats::datetime::from_nanos(i128::from(nanos))
}

/// The first message on `subject` at or after `seq`, if any.
async fn first_from(
    stream: &jetstream::stream::Stream<()>,
    subject: &str,
    seq: u64,
) -> Result<Option<StreamMessage>, async_nats::Error> {
    match stream.get_first_raw_message_by_subject(subject, seq).await {
        Ok(m) => Ok(Some(m)),
        Err(e) if matches!(e.kind(), LastRawMessageErrorKind::NoMessageFound) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(age: Duration) -> OutboxRow {
        OutboxRow {
            seq: 1,
            id: Uuid::now_v7(),
            aggregate_type: "a".into(),
            aggregate_id: "1".into(),
            event_type: "e".into(),
            payload: serde_json::json!({}).into(),
            headers: serde_json::json!({}),
            created_at: Utc::now() - age,
            attempts: 0,
        }
    }

    #[tokio::test]
    async fn only_rows_older_than_the_window_less_the_margin_are_looked_up() {
        // a client that never connects: building one makes no request
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect("127.0.0.1:1")
            .await
            .expect("a client");
        let js = jetstream::new(client);
        let r = Reconciler::new(
            js.clone(),
            "S",
            SubjectTemplate::default(),
            "outbox",
            Duration::from_secs(120),
        );
        assert_eq!(r.check_after(), Duration::from_secs(110));
        let short = Reconciler::new(
            js,
            "S",
            SubjectTemplate::default(),
            "outbox",
            Duration::from_secs(1),
        );
        assert_eq!(short.check_after(), Duration::from_millis(500));
        let now = Utc::now();
        assert!(!r.needs_check(&row(Duration::from_secs(100)), now));
        assert!(r.needs_check(&row(Duration::from_secs(111)), now));
        // the happy path: young rows, no request (the server does not exist)
        let young = [row(Duration::ZERO), row(Duration::from_secs(60))];
        let mut lookups = r.lookups();
        assert!(lookups.stored(&young).await.expect("no look-up").is_empty());
    }
}
