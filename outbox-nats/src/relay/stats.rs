//! The relay's statistics task: the backlog, stall and duplicate-window gauges, refreshed
//! every `stats_interval` on a session of its own (JIT off, `application_name`
//! `outbox-relay-stats`), so that a slow statistics query never holds up publishing; the
//! first time at a random point of the first interval.
//!
//! Reading the backlog reads every unpublished row, so the relays of a table share one
//! reading: the relay whose statistics session holds the table's statistics lock
//! ([`db::AdvisoryLock::Statistics`]) reads the figures every interval and sends them to the
//! others with `NOTIFY` on the table's statistics channel ([`db::statistics_channel`]); the
//! others set their gauges from what they hear, as it arrives. A backlog of millions is read
//! once per interval, not once per relay. The lock lasts as long as the reader's session: when
//! that relay stops, another takes it at its next tick. A relay that has heard nothing for
//! three intervals (the reader is paused, or its reading is slow) reads the figures itself,
//! and so does one that runs with another partition count than the reader (while N changes).
//!
//! A reading takes at most a tenth of the time: after one that took `d`, the next comes no
//! sooner than `10 × d` later, whatever the interval (a backlog of 10,000,000 rows read every
//! 5 s would keep the database's core busy for 2 s of every 5). The reader sends that spacing
//! with its figures, and the others wait three of them before they read themselves.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use diesel_async::AsyncPgConnection;
use futures_util::StreamExt;
use outbox_diesel::relay as db;
use outbox_diesel::relay::{Backlog, PartitionBacklog};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::metrics as m;
use crate::{Health, RelayConfig};

/// Partitions per notification: a `NOTIFY` payload is under 8,000 bytes, and a partition's
/// figures take at most ~115 in JSON.
const CHUNK: usize = 48;

/// A reading that took `d` is followed by the next no sooner than `READING_SPACING × d` later.
const READING_SPACING: u32 = 10;

/// How long after a reading that took `took` the next may come: the interval, or ten times the
/// reading when that is longer.
fn spacing(interval: Duration, took: Duration) -> Duration {
    interval.max(took.saturating_mul(READING_SPACING))
}

/// One notification of the reader's: its figures of one reading, the partitions in chunks.
#[derive(serde::Serialize, serde::Deserialize)]
struct Shared<'a> {
    /// The reading relay (a random id of its statistics task) and the reading: the
    /// notifications of one reading.
    reader: u64,
    pass: u64,
    /// The partition count the reading split the table into.
    partitions: u32,
    /// This notification's place among the reading's `chunks`.
    chunk: usize,
    chunks: usize,
    total: Cow<'a, Backlog>,
    parts: Cow<'a, [PartitionBacklog]>,
    /// Milliseconds until the reader's next reading (see [`spacing`]).
    #[serde(default)]
    next_ms: u64,
    /// When the reading began (Unix time, milliseconds; 0 from a relay that did not say).
    #[serde(default)]
    read_at_ms: u64,
}

/// A reading of the backlog: the table's, and its partitions' when it is partitioned.
struct Figures {
    total: Backlog,
    parts: Option<Vec<PartitionBacklog>>,
    /// When the reading began.
    read_at: SystemTime,
}

/// What a relay heard from the reader.
struct Heard {
    /// This task's id, to pass over its own notifications.
    me: u64,
    /// When it last heard from a reader (or started listening).
    last: Instant,
    /// The last complete reading was of another partition count than this relay's.
    other_count: bool,
    /// How long the reader said it would wait before its next reading.
    reader_spacing: Duration,
    /// The reading being received: its reader, its pass, its partitions so far.
    pending: Option<(u64, u64, Vec<PartitionBacklog>)>,
}

impl Heard {
    /// Takes in one notification; returns the reading it completes, if it is of `partitions`.
    fn take(&mut self, payload: &str, partitions: u32) -> Option<Figures> {
        let shared: Shared<'_> = match serde_json::from_str(payload) {
            Ok(s) => s,
            Err(e) => {
                debug!(error = %e, "ignored a statistics notification that is not a relay's");
                return None;
            }
        };
        if shared.reader == self.me {
            return None;
        }
        self.last = Instant::now();
        self.reader_spacing = Duration::from_millis(shared.next_ms);
        let key = (shared.reader, shared.pass);
        let mut parts = match self.pending.take() {
            _ if shared.chunk == 0 => Vec::with_capacity(partitions as usize),
            Some((reader, pass, parts)) if (reader, pass) == key => parts,
            // a chunk of a reading whose start this relay did not hear: wait for the next
            _ => return None,
        };
        parts.extend(shared.parts.iter().cloned());
        if shared.chunk + 1 < shared.chunks {
            self.pending = Some((key.0, key.1, parts));
            return None;
        }
        self.other_count = shared.partitions != partitions;
        if self.other_count || (partitions > 1 && parts.len() != partitions as usize) {
            return None;
        }
        // a reading of a relay that does not say when it read, or says a time after it was
        // heard (its clock ahead of this relay's): as heard
        let heard_at = SystemTime::now();
        let read_at = SystemTime::UNIX_EPOCH
            .checked_add(Duration::from_millis(shared.read_at_ms))
            .filter(|at| shared.read_at_ms > 0 && *at <= heard_at)
            .unwrap_or(heard_at);
        Some(Figures {
            total: shared.total.into_owned(),
            parts: (partitions > 1).then_some(parts),
            read_at,
        })
    }

    /// Whether this relay reads the figures itself though another holds the lock: it heard
    /// nothing for three of its intervals or of the reader's spacings, whichever is longer, or
    /// the reader runs with another partition count.
    fn reads_itself(&self, interval: Duration) -> bool {
        self.other_count
            || self.last.elapsed() > interval.max(self.reader_spacing).saturating_mul(3)
    }
}

/// The statistics session: its connection, its channel, and whether it holds the lock.
struct Session {
    conn: AsyncPgConnection,
    channel: String,
    reader: bool,
}

impl Session {
    async fn open(cfg: &RelayConfig) -> Option<Session> {
        let mut conn = outbox_diesel::connect(&cfg.database_url)
            .await
            .map_err(|e| debug!(error = %e, "statistics session: connect failed"))
            .ok()?;
        let set_up = async {
            db::prepare_side_session(&mut conn).await?;
            db::set_application_name(&mut conn, "outbox-relay-stats").await?;
            let channel = db::statistics_channel(&mut conn, &cfg.table).await?;
            db::listen_statistics(&mut conn, &channel).await?;
            Ok::<_, diesel::result::Error>(channel)
        };
        match set_up.await {
            Ok(channel) => Some(Session {
                conn,
                channel,
                reader: false,
            }),
            Err(e) => {
                debug!(error = %e, "statistics session: set-up failed");
                None
            }
        }
    }
}

/// What the task woke up for.
enum Wake {
    Tick,
    Note(Option<diesel::QueryResult<diesel::pg::PgNotification>>),
}

/// Refreshes the backlog gauges (per partition too when partitioned), the connection and
/// readiness gauges, and warns on a stall or a backlog older than the stream's duplicate
/// window.
pub(super) async fn stats(
    cfg: Arc<RelayConfig>,
    health: Arc<Health>,
    duplicate_window: Duration,
    shutdown: CancellationToken,
) {
    let mut session: Option<Session> = None;
    // the first pass at a random point of the first interval: each reading reads every
    // unpublished row, and a relay that finds no reader reads, so relays started together
    // (a fleet restarted on a backlog of millions) would read it all at once
    let first = cfg.stats_interval.mul_f64(crate::backoff::unit_random());
    let mut tick =
        tokio::time::interval_at(tokio::time::Instant::now() + first, cfg.stats_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let partitions = cfg.mode.partitions();
    let mut heard = Heard {
        me: (crate::backoff::unit_random() * u64::MAX as f64) as u64,
        last: Instant::now(),
        other_count: false,
        reader_spacing: Duration::ZERO,
        pending: None,
    };
    // no reading before this (see `spacing`)
    let mut next_reading = Instant::now();
    let mut pass = 0u64;
    let lock = db::AdvisoryLock::Statistics(&cfg.table);
    loop {
        let wake = match session.as_mut() {
            Some(s) => {
                let mut notes = std::pin::pin!(s.conn.notifications_stream());
                tokio::select! {
                    _ = tick.tick() => Wake::Tick,
                    n = notes.next() => Wake::Note(n),
                    _ = shutdown.cancelled() => return,
                }
            }
            None => tokio::select! {
                _ = tick.tick() => Wake::Tick,
                _ = shutdown.cancelled() => return,
            },
        };
        match wake {
            Wake::Note(Some(Ok(note))) => {
                if let Some(f) = heard.take(&note.payload, partitions) {
                    apply(&cfg, &health, duplicate_window, &f);
                }
                continue;
            }
            Wake::Note(Some(Err(e))) => {
                debug!(error = %e, "statistics session failed");
                session = None;
                continue;
            }
            Wake::Note(None) => {
                session = None;
                continue;
            }
            Wake::Tick => {}
        }
        metrics::gauge!(m::NATS_CONNECTED).set(if health.nats_connected() { 1.0 } else { 0.0 });
        metrics::gauge!(m::READY).set(if health.ready() { 1.0 } else { 0.0 });
        if session.is_none() {
            session = Session::open(&cfg).await;
        }
        let Some(s) = session.as_mut() else {
            metrics::gauge!(m::STATISTICS_READER).set(0.0);
            continue;
        };
        if !s.reader {
            match lock.try_lock(&mut s.conn).await {
                Ok(taken) => s.reader = taken,
                Err(e) => {
                    debug!(error = %e, "statistics lock failed");
                    session = None;
                    continue;
                }
            }
            if s.reader {
                debug!("this relay reads the table's backlog figures for its relays");
            }
            metrics::gauge!(m::STATISTICS_READER).set(if s.reader { 1.0 } else { 0.0 });
        }
        if !s.reader && !heard.reads_itself(cfg.stats_interval) {
            continue;
        }
        let started = Instant::now();
        if started < next_reading {
            continue;
        }
        match read(&mut s.conn, &cfg, partitions).await {
            Ok(f) => {
                apply(&cfg, &health, duplicate_window, &f);
                let took = started.elapsed();
                let next = spacing(cfg.stats_interval, took);
                // the tick that comes at the end of the spacing reads, not the one after it
                next_reading = started + next.saturating_sub(cfg.stats_interval / 2);
                debug!(
                    backlog = f.total.unpublished,
                    took = ?took,
                    next = ?next,
                    for_the_others = s.reader,
                    "read the backlog"
                );
                if s.reader {
                    pass += 1;
                    if let Err(e) = share(s, (heard.me, pass), partitions, next, &f).await {
                        debug!(error = %e, "statistics could not be sent to the other relays");
                        session = None;
                    }
                }
            }
            Err(e) => {
                debug!(error = %e, "backlog query failed");
                session = None;
            }
        }
    }
}

/// Reads the backlog: one snapshot for the table and its partitions.
async fn read(
    conn: &mut AsyncPgConnection,
    cfg: &RelayConfig,
    partitions: u32,
) -> diesel::QueryResult<Figures> {
    let read_at = SystemTime::now();
    if partitions > 1 {
        let (total, parts) = db::backlogs(conn, &cfg.table, partitions).await?;
        Ok(Figures {
            total,
            parts: Some(parts),
            read_at,
        })
    } else {
        let total = db::backlog(conn, &cfg.table).await?;
        Ok(Figures {
            total,
            parts: None,
            read_at,
        })
    }
}

/// Sends a reading to the table's other relays: one notification per [`CHUNK`] partitions,
/// all in one transaction.
async fn share(
    s: &mut Session,
    (reader, pass): (u64, u64),
    partitions: u32,
    next: Duration,
    f: &Figures,
) -> diesel::QueryResult<()> {
    let parts = f.parts.as_deref().unwrap_or(&[]);
    let chunks: Vec<&[PartitionBacklog]> = match parts.len() {
        0 => vec![&[]],
        _ => parts.chunks(CHUNK).collect(),
    };
    let payloads = chunks
        .iter()
        .enumerate()
        .map(|(chunk, parts)| {
            serde_json::to_string(&Shared {
                reader,
                pass,
                partitions,
                chunk,
                chunks: chunks.len(),
                total: Cow::Borrowed(&f.total),
                parts: Cow::Borrowed(parts),
                next_ms: next.as_millis() as u64,
                read_at_ms: since_epoch(f.read_at).as_millis() as u64,
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| diesel::result::Error::SerializationError(Box::new(e)))?;
    db::notify_statistics(&mut s.conn, &s.channel, &payloads).await
}

/// Sets the gauges from a reading (the partitions' first: a scrape never sees a total its
/// partitions do not add up to), and warns on a stall or rows older than the duplicate window.
fn apply(cfg: &RelayConfig, health: &Health, duplicate_window: Duration, f: &Figures) {
    for p in f.parts.iter().flatten() {
        let label = p.partition.to_string();
        metrics::gauge!(m::PARTITION_BACKLOG_ROWS, "partition" => label.clone())
            .set(p.unpublished as f64);
        metrics::gauge!(m::PARTITION_OLDEST_AGE, "partition" => label).set(p.oldest_age_seconds);
    }
    let b = &f.total;
    metrics::gauge!(m::BACKLOG_ROWS).set(b.unpublished as f64);
    metrics::gauge!(m::OLDEST_AGE).set(b.oldest_age_seconds);
    metrics::gauge!(m::PARKED_ROWS).set(b.parked as f64);
    metrics::gauge!(m::IN_DOUBT_ROWS).set(b.in_doubt as f64);
    metrics::gauge!(m::OLDEST_IN_DOUBT_AGE).set(b.oldest_in_doubt_age_seconds);
    let stalled = b.oldest_age_seconds > cfg.stall_after.as_secs_f64();
    metrics::gauge!(m::STALLED).set(if stalled { 1.0 } else { 0.0 });
    metrics::gauge!(m::STATISTICS_READ_AT).set(unix_seconds(f.read_at));
    if stalled && health.owned_partitions() > 0 {
        warn!(
            oldest_age_seconds = b.oldest_age_seconds,
            backlog = b.unpublished,
            "outbox backlog is stalled: its oldest row waits longer than --stall-after"
        );
    }
    // an in-doubt row may already be in the stream: once older than the window, JetStream
    // no longer drops its re-publish, so the relay looks it up first (`reconcile`)
    let window = duplicate_window.as_secs_f64();
    let beyond = b.oldest_age_seconds > window || b.oldest_in_doubt_age_seconds > window;
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

/// The time from the Unix epoch to `at` (none before the epoch).
fn since_epoch(at: SystemTime) -> Duration {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
}

/// `at` as Unix time in seconds (0 before the epoch).
fn unix_seconds(at: SystemTime) -> f64 {
    since_epoch(at).as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backlog(unpublished: i64) -> Backlog {
        Backlog {
            unpublished,
            oldest_age_seconds: 1.5,
            parked: 0,
            in_doubt: 0,
            oldest_in_doubt_age_seconds: 0.0,
        }
    }

    fn part(partition: i32) -> PartitionBacklog {
        PartitionBacklog {
            partition,
            unpublished: i64::MAX,
            oldest_age_seconds: 1.234_567_890_123_456_7e-5,
            parked: i64::MAX,
        }
    }

    fn payload(reader: u64, pass: u64, count: u32, chunk: usize, chunks: usize) -> String {
        let parts: Vec<_> = (0..count as i32)
            .skip(chunk * CHUNK)
            .take(CHUNK)
            .map(part)
            .collect();
        serde_json::to_string(&Shared {
            reader,
            pass,
            partitions: count,
            chunk,
            chunks,
            total: Cow::Owned(backlog(7)),
            parts: Cow::Owned(parts),
            next_ms: u64::MAX,
            read_at_ms: 1_700_000_000_123,
        })
        .expect("serialize")
    }

    fn heard() -> Heard {
        Heard {
            me: 1,
            last: Instant::now(),
            other_count: false,
            reader_spacing: Duration::ZERO,
            pending: None,
        }
    }

    #[test]
    fn a_full_chunk_of_the_widest_figures_fits_a_notification() {
        let p = payload(u64::MAX, u64::MAX, 1024, 0, 22);
        assert!(p.len() < 8000, "{} bytes", p.len());
    }

    #[test]
    fn a_reading_in_chunks_is_taken_once_complete_and_of_the_same_partition_count() {
        let mut h = heard();
        let chunks = 100usize.div_ceil(CHUNK);
        for c in 0..chunks - 1 {
            assert!(h.take(&payload(2, 9, 100, c, chunks), 100).is_none());
        }
        let f = h
            .take(&payload(2, 9, 100, chunks - 1, chunks), 100)
            .expect("complete");
        assert_eq!(f.total.unpublished, 7);
        let parts = f.parts.expect("partitions");
        assert_eq!(parts.len(), 100);
        assert!(
            parts
                .iter()
                .enumerate()
                .all(|(i, p)| p.partition == i as i32)
        );
        // another count: not taken, and this relay reads itself
        assert!(h.take(&payload(2, 10, 8, 0, 1), 100).is_none());
        assert!(h.reads_itself(Duration::from_secs(60)));
        assert!(h.take(&payload(2, 11, 100, 0, chunks), 100).is_none());
        assert!(h.take(&payload(2, 11, 100, 1, chunks), 100).is_none());
        assert!(h.take(&payload(2, 11, 100, 2, chunks), 100).is_some());
        assert!(!h.reads_itself(Duration::from_secs(60)));
    }

    #[test]
    fn a_reading_heard_from_its_middle_or_its_own_or_not_a_relays_is_not_taken() {
        let mut h = heard();
        assert!(h.take(&payload(2, 9, 100, 1, 3), 100).is_none());
        assert!(h.take(&payload(2, 9, 100, 2, 3), 100).is_none());
        // this relay's own
        assert!(h.take(&payload(1, 9, 1, 0, 1), 1).is_none());
        assert!(h.take("not json", 1).is_none());
        // chunks of two readers interleaved: neither completes
        assert!(h.take(&payload(2, 9, 100, 0, 3), 100).is_none());
        assert!(h.take(&payload(3, 1, 100, 1, 3), 100).is_none());
        assert!(h.take(&payload(2, 9, 100, 2, 3), 100).is_none());
        // one unpartitioned reading
        let f = h.take(&payload(3, 2, 1, 0, 1), 1).expect("taken");
        assert!(f.parts.is_none());
    }

    #[test]
    fn a_slow_reading_spaces_the_next_and_the_others_wait_for_it() {
        let s = Duration::from_secs(5);
        assert_eq!(spacing(s, Duration::from_millis(200)), s);
        assert_eq!(spacing(s, Duration::from_secs(2)), Duration::from_secs(20));
        let mut h = heard();
        h.last = Instant::now() - Duration::from_secs(16);
        assert!(h.reads_itself(s), "nothing heard for three intervals");
        let mut p: serde_json::Value = serde_json::from_str(&payload(2, 1, 1, 0, 1)).expect("json");
        p["next_ms"] = 20_000.into();
        assert!(h.take(&p.to_string(), 1).is_some());
        h.last = Instant::now() - Duration::from_secs(16);
        assert!(!h.reads_itself(s), "the reader said it reads every 20 s");
        h.last = Instant::now() - Duration::from_secs(61);
        assert!(h.reads_itself(s));
        // a reader that sends no spacing: the interval
        let mut old = p.clone();
        old.as_object_mut().expect("object").remove("next_ms");
        assert!(h.take(&old.to_string(), 1).is_some());
        h.last = Instant::now() - Duration::from_secs(16);
        assert!(h.reads_itself(s));
    }

    #[test]
    fn figures_heard_carry_when_the_reader_read_them() {
        let mut h = heard();
        let f = h.take(&payload(2, 1, 1, 0, 1), 1).expect("taken");
        assert_eq!(unix_seconds(f.read_at), 1_700_000_000.123);
        // a reader that does not say: when they were heard
        let mut old: serde_json::Value =
            serde_json::from_str(&payload(2, 2, 1, 0, 1)).expect("json");
        old.as_object_mut().expect("object").remove("read_at_ms");
        let before = SystemTime::now();
        let f = h.take(&old.to_string(), 1).expect("taken");
        assert!(f.read_at >= before && f.read_at <= SystemTime::now());
        // nor one after it was heard
        let mut far: serde_json::Value =
            serde_json::from_str(&payload(2, 3, 1, 0, 1)).expect("json");
        far["read_at_ms"] = u64::MAX.into();
        let f = h.take(&far.to_string(), 1).expect("taken");
        assert!(f.read_at <= SystemTime::now());
        assert_eq!(
            unix_seconds(SystemTime::UNIX_EPOCH - Duration::from_secs(1)),
            0.0
        );
    }
}
