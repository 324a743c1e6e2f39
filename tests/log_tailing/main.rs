//! The `log-tailing` relay: events read from the WAL through a logical replication slot, in
//! commit order, confirmed only after JetStream's ack. Relays run as real `outbox-relay`
//! processes; each test has its own database, stream and (cluster-wide unique) slot.
//!
//! A module per subject: `delivery`, `cleanup`, `takeover`, `operations`, `sessions`,
//! `switching`, and `reads` (the reader's reads, without a relay); what more than one uses is
//! here.

#[path = "../support/mod.rs"]
mod support;

mod cleanup;
mod delivery;
mod operations;
mod reads;
mod sessions;
mod switching;
mod takeover;

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::prelude::*;
use outbox_diesel::{Outbox, OutboxExt};
use support::events::{Changed, changed};
use support::servers::NatsServer;
use support::slot::Slot;
use support::{Proc, TestDb, TestStream, by_aggregate, relay_bin, relay_command, wait_until};

fn relay(name: &str, db: &TestDb, stream: &TestStream, slot: &Slot, args: &[&str]) -> Proc {
    let mut all = vec!["--mode", "log-tailing", "--slot", &slot.name];
    all.extend_from_slice(args);
    Proc::spawn(name, &mut relay_command(db, stream, &all))
}

/// Waits until the relay made the slot, published what committed before it, and reads it:
/// events recorded from then on come from the slot.
async fn wait_reader(db: &TestDb, slot: &Slot) -> i64 {
    wait_until(
        Duration::from_secs(30),
        "a relay reading the slot",
        || async { slot.exists(db) && slot.reader(db).is_some() && slot.streaming(db) },
    )
    .await;
    slot.reader(db).unwrap_or_default()
}

async fn wait_count(stream: &TestStream, n: u64, timeout: Duration) {
    wait_until(timeout, &format!("{n} messages in the stream"), || async {
        stream.count().await >= n
    })
    .await;
}

/// Records one `changed(account, n)` event per transaction for each `n`; their ids, in commit
/// order.
fn record_each(conn: &mut PgConnection, account: &str, ns: std::ops::Range<i64>) -> Vec<String> {
    ns.map(|n| {
        conn.transaction(|c| c.record_event(&changed(account, n)))
            .expect("commit")
            .to_string()
    })
    .collect()
}

/// The message ids in the stream, in stream order.
async fn stream_ids(stream: &TestStream) -> Vec<String> {
    stream
        .read_all()
        .await
        .into_iter()
        .map(|m| m.msg_id)
        .collect()
}

/// Every message once, and per aggregate in `expected` order.
fn assert_exactly_once_in_order(
    got: &[support::Received],
    expected: &HashMap<String, Vec<String>>,
) {
    let total: usize = expected.values().map(Vec::len).sum();
    let ids: HashSet<&str> = got.iter().map(|m| m.msg_id.as_str()).collect();
    assert_eq!(ids.len(), total, "every event is in the stream");
    assert_eq!(got.len(), total, "and only once");
    let seen = by_aggregate(got);
    assert_eq!(seen.len(), expected.len());
    for (agg, order) in expected {
        assert_eq!(seen.get(agg), Some(order), "commit order of {agg}");
    }
}

/// The stream holds exactly the events of `ledger`, once each, in its order per aggregate.
async fn assert_stream_holds(stream: &TestStream, ledger: &Ledger) {
    let expected = ledger.lock().expect("ledger").clone();
    assert_exactly_once_in_order(&stream.read_all().await, &expected);
}

/// Waits for every writer to finish.
fn join_all(writers: Vec<std::thread::JoinHandle<()>>) {
    for w in writers {
        w.join().expect("writer");
    }
}

/// Commits per-aggregate order: what each writer committed, by aggregate, in commit order.
type Ledger = Arc<Mutex<HashMap<String, Vec<String>>>>;

/// `writers` threads commit `per_writer` transactions of `batch` events each. Each aggregate
/// belongs to one writer, so its commit order is the writer's order, which the ledger keeps.
fn start_writers(
    db: &TestDb,
    outbox: &Outbox,
    writers: usize,
    per_writer: usize,
    batch: usize,
    ledger: &Ledger,
) -> Vec<std::thread::JoinHandle<()>> {
    start_writers_from(db, outbox, 0, writers, per_writer, batch, ledger)
}

/// [`start_writers`] with writer numbers from `first`, so that aggregates stay apart.
fn start_writers_from(
    db: &TestDb,
    outbox: &Outbox,
    first: usize,
    writers: usize,
    per_writer: usize,
    batch: usize,
    ledger: &Ledger,
) -> Vec<std::thread::JoinHandle<()>> {
    start_paced_writers(
        db,
        outbox,
        first,
        writers,
        per_writer,
        batch,
        Duration::ZERO,
        ledger,
    )
}

/// [`start_writers_from`], each writer pausing `pause` before each transaction: writers that
/// keep committing while a relay starts or is switched.
#[allow(clippy::too_many_arguments)]
fn start_paced_writers(
    db: &TestDb,
    outbox: &Outbox,
    first: usize,
    writers: usize,
    per_writer: usize,
    batch: usize,
    pause: Duration,
    ledger: &Ledger,
) -> Vec<std::thread::JoinHandle<()>> {
    (first..first + writers)
        .map(|w| {
            let (url, outbox, ledger) = (db.url.clone(), outbox.clone(), ledger.clone());
            std::thread::spawn(move || {
                let mut conn = PgConnection::establish(&url).expect("connect");
                for i in 0..per_writer {
                    if !pause.is_zero() {
                        std::thread::sleep(pause);
                    }
                    let agg = format!("acct-{w}-{}", i % 13);
                    let events: Vec<Changed> = (0..batch)
                        .map(|k| changed(&agg, (i * batch + k) as i64))
                        .collect();
                    let ids = conn
                        .transaction(|c| c.record_events_in(&outbox, &events))
                        .expect("commit");
                    let mut l = ledger.lock().expect("ledger");
                    l.entry(agg)
                        .or_default()
                        .extend(ids.iter().map(|id| id.to_string()));
                }
            })
        })
        .collect()
}
