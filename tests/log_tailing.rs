//! The `log-tailing` relay: events read from the WAL through a logical replication slot, in
//! commit order, confirmed only after JetStream's ack. Relays run as real `outbox-relay`
//! processes; each test has its own database, stream and (cluster-wide unique) slot.

mod support;

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

#[tokio::test]
async fn interleaved_transactions_arrive_in_commit_order_not_seq_order() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;

    // T1 records a1, a2 (lower seqs); T2 records a3 and commits first; T1 commits after
    let (mut c1, mut c2) = (db.conn(), db.conn());
    let mut t2_id = None;
    let t1_ids = c1
        .transaction(|c1| {
            let ids = c1.record_events(&[changed("A", 1), changed("A", 2)])?;
            t2_id = Some(c2.transaction(|c2| c2.record_event(&changed("A", 3)))?);
            Ok::<_, diesel::result::Error>(ids)
        })
        .expect("t1");
    let t2_id = t2_id.expect("t2");
    // a third transaction, after both
    let t3_id = db
        .conn()
        .transaction(|c| c.record_event(&changed("A", 4)))
        .expect("t3");
    let seq = |id: &uuid::Uuid| db.scalar(&format!("SELECT seq FROM outbox WHERE id = '{id}'"));
    assert!(seq(&t1_ids[0]) < seq(&t2_id), "T1 inserted first");

    wait_count(&stream, 4, Duration::from_secs(30)).await;
    let got: Vec<String> = stream
        .read_all()
        .await
        .into_iter()
        .map(|m| m.msg_id)
        .collect();
    let commit_order = [t2_id, t1_ids[0], t1_ids[1], t3_id].map(|id| id.to_string());
    assert_eq!(got, commit_order, "commit order, not seq order");
}

#[tokio::test]
async fn toast_sized_payloads_arrive_whole() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;

    // random text does not compress, so PostgreSQL stores it out of line (TOAST)
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut noise = |bytes: usize| -> String {
        (0..bytes)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                char::from(b"0123456789abcdefghijklmnopqrstuv"[(state % 32) as usize])
            })
            .collect()
    };
    let sizes = [2_100, 9_000, 120_000, 700_000];
    let events: Vec<Changed> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| Changed {
            account: "T".into(),
            n: i as i64,
            blob: Some(noise(n)),
        })
        .collect();
    let mut conn = db.conn();
    conn.transaction(|c| c.record_events(&events[..2]))
        .expect("two in one transaction");
    conn.transaction(|c| c.record_event(&events[2]))
        .expect("one");
    conn.transaction(|c| c.record_event(&events[3]))
        .expect("one");
    assert!(
        db.scalar(
            "SELECT pg_total_relation_size(reltoastrelid) FROM pg_class WHERE relname = 'outbox'"
        ) > 100_000,
        "the payloads are TOASTed"
    );

    wait_count(&stream, 4, Duration::from_secs(30)).await;
    let got = stream.read_all().await;
    assert_eq!(got.len(), 4);
    for (m, e) in got.iter().zip(&events) {
        assert_eq!(m.payload["n"], e.n);
        assert_eq!(
            m.payload["blob"].as_str(),
            e.blob.as_deref(),
            "payload {} whole",
            e.n
        );
    }
}

#[tokio::test]
async fn many_events_in_one_transaction_arrive_whole_and_in_order() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    // a transaction larger than the batch size is handed to the publisher in parts
    let _relay = relay("relay", &db, &stream, &slot, &["--batch-size", "200"]);
    wait_reader(&db, &slot).await;

    let events: Vec<Changed> = (0..5_000)
        .map(|n| changed(&format!("acct-{}", n % 10), n))
        .collect();
    let ids = db
        .conn()
        .transaction(|c| c.record_events(&events))
        .expect("one transaction");
    wait_count(&stream, 5_000, Duration::from_secs(180)).await;
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    for (e, id) in events.iter().zip(&ids) {
        expected
            .entry(e.account.clone())
            .or_default()
            .push(id.to_string());
    }
    assert_exactly_once_in_order(&stream.read_all().await, &expected);
}

/// One transaction of `n` events of one aggregate, each with a 10 kB payload, relayed with
/// `--lease 3s` and a 1 MiB `--max-batch-bytes`, published one ack round trip at a time. The
/// reader used to read it whole (its memory grew with the
/// transaction) without a word to its session meanwhile, so PostgreSQL ended the session, the
/// reader read the same transaction again, and the slot never passed it. Returns the relay's
/// peak RSS and how long the transaction took, from commit to the slot confirmed past it.
/// Publishing 20,000 events takes about 2.5 s in a debug build, under the lease: with
/// `stall_broker` the relay publishes to a broker of its own, frozen for a second after every
/// quarter of a second for the first four seconds from the commit, so that the transaction
/// takes longer than the lease however fast the relay and the machine are. Each freeze is shorter than half the lease, and
/// the relay queries its session before it sends once half the lease has passed.
async fn one_large_transaction(n: u32, check_order: bool, stall_broker: bool) -> (u64, Duration) {
    let nats = stall_broker.then(|| Arc::new(NatsServer::start()));
    let db = TestDb::new();
    let stream = match &nats {
        Some(nats) => TestStream::on(&nats.url()),
        None => TestStream::new(),
    };
    let slot = Slot::new(&db);
    let tail = relay(
        "relay",
        &db,
        &stream,
        &slot,
        &["--lease", "3s", "--max-batch-bytes", "1048576"],
    );
    let reader = wait_reader(&db, &slot).await;

    diesel::sql_query(format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'account', 'L', 'account.changed', \
         jsonb_build_object('n', i, 'blob', repeat(md5(i::text), 320)) \
         FROM generate_series(1, {n}) AS i"
    ))
    .execute(&mut db.conn())
    .expect("one transaction");
    let committed = Instant::now();
    let stalls = nats.map(|nats| {
        let done = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&done);
        let thread = std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) && committed.elapsed() < Duration::from_secs(4) {
                std::thread::sleep(Duration::from_millis(250));
                nats.pause();
                std::thread::sleep(Duration::from_secs(1));
                nats.resume();
            }
            nats
        });
        (done, thread)
    });
    let timeout = Duration::from_secs(60 + u64::from(n) / 100);
    let target = db.scalar("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint");
    wait_until(
        timeout,
        "the slot confirmed past the transaction",
        || async {
            // the lease holds: the session that read the slot at the start still does
            assert_eq!(
                slot.reader(&db),
                Some(reader),
                "the reader's session was ended and the slot changed hands"
            );
            slot.confirmed(&db) >= target
        },
    )
    .await;
    let took = committed.elapsed();
    // the broker answers again, and stays up until the stream is read
    let _nats = stalls.map(|(done, thread)| {
        done.store(true, Ordering::Relaxed);
        thread.join().expect("the thread freezing the broker")
    });
    let peak = tail.peak_rss();
    assert_eq!(stream.count().await, u64::from(n), "exactly {n} messages");
    if check_order {
        let order: Vec<i64> = stream
            .read_all()
            .await
            .iter()
            .map(|m| m.payload["n"].as_i64().unwrap_or(-1))
            .collect();
        assert!(
            order.iter().copied().eq(1..=i64::from(n)),
            "the events in commit order"
        );
    }
    println!(
        "{n} events of 10 kB in one transaction: slot confirmed past it after {:.1} s, relay peak RSS {:.1} MiB",
        took.as_secs_f64(),
        peak as f64 / 1048576.0
    );
    (peak, took)
}

/// What the relay may hold with a 1 MiB budget: the part being published and the next (2
/// MiB), the replication client's buffer of `--batch-size` received changes (500 × 10 kB),
/// and the process itself (about 20 MiB in a debug build).
const LARGE_TRANSACTION_RSS_BOUND: u64 = 40 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_longer_than_the_lease_passes_in_bounded_memory() {
    let (peak, took) = one_large_transaction(20_000, true, true).await;
    assert!(
        took > Duration::from_secs(3),
        "longer than the lease: {took:?}"
    );
    assert!(
        peak < LARGE_TRANSACTION_RSS_BOUND,
        "peak RSS {:.1} MiB",
        peak as f64 / 1048576.0
    );
}

/// The scenario: 50,000 events of 10 kB (about 500 MB) in one transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: 500 MB in one transaction; run with --ignored"]
async fn long_a_transaction_of_50000_events_longer_than_the_lease_passes_in_bounded_memory() {
    let (peak, _) = one_large_transaction(50_000, false, false).await;
    assert!(
        peak < LARGE_TRANSACTION_RSS_BOUND,
        "peak RSS {:.1} MiB",
        peak as f64 / 1048576.0
    );
}

#[tokio::test]
async fn many_small_transactions_arrive_exactly_once_in_commit_order() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;

    let ledger = Ledger::default();
    join_all(start_writers(&db, &Outbox::default(), 4, 750, 1, &ledger));
    wait_count(&stream, 3_000, Duration::from_secs(180)).await;
    assert_stream_holds(&stream, &ledger).await;
}

#[tokio::test]
async fn rolled_back_transaction_publishes_nothing() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;

    let mut conn = db.conn();
    let rolled_back = conn.transaction(|c| {
        c.record_events(&[changed("R", 1), changed("R", 2)])?;
        Err::<(), _>(diesel::result::Error::RollbackTransaction)
    });
    assert!(rolled_back.is_err());
    // a savepoint rolled back inside a committed transaction publishes nothing either
    let kept = conn
        .transaction(|c| {
            let inner = c.transaction(|c| {
                c.record_event(&changed("R", 3))?;
                Err::<(), _>(diesel::result::Error::RollbackTransaction)
            });
            assert!(inner.is_err());
            c.record_event(&changed("K", 1))
        })
        .expect("commit");

    wait_count(&stream, 1, Duration::from_secs(30)).await;
    // give a wrongly published event time to show up
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got = stream.read_all().await;
    assert_eq!(got.len(), 1, "only the committed event: {got:?}");
    assert_eq!(got[0].msg_id, kept.to_string());
}

#[tokio::test]
async fn insert_then_delete_leaves_the_table_empty_and_delivers_every_event() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;

    let outbox = Outbox::default().delete_after_insert(true);
    let ledger = Ledger::default();
    join_all(start_writers(&db, &outbox, 2, 250, 3, &ledger));
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox"),
        0,
        "the table stays empty"
    );
    wait_count(&stream, 1_500, Duration::from_secs(180)).await;
    assert_stream_holds(&stream, &ledger).await;
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 0);
}

/// Captured rows deleted at the first cleanup after they are captured, every 200 ms.
const DELETE_CAPTURED_AT_ONCE: &[&str] = &[
    "--captured-retention",
    "0s",
    "--captured-cleanup-interval",
    "200ms",
];

#[tokio::test]
async fn captured_rows_are_deleted_on_schedule_without_losing_events() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, DELETE_CAPTURED_AT_ONCE);
    wait_reader(&db, &slot).await;
    let ledger = Ledger::default();
    join_all(start_writers(&db, &Outbox::default(), 2, 100, 2, &ledger));
    wait_count(&stream, 400, Duration::from_secs(30)).await;
    wait_until(Duration::from_secs(30), "captured rows deleted", || async {
        db.scalar("SELECT count(*) FROM outbox") == 0
    })
    .await;
    assert_stream_holds(&stream, &ledger).await;
}

/// Rows recorded before the relay's first start are published from the slot's snapshot, and
/// deleted on the same schedule as the rows read from the slot, without waiting for a later
/// event to be confirmed.
#[tokio::test]
async fn rows_published_by_the_first_start_are_deleted_on_schedule() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let ledger = Ledger::default();
    join_all(start_writers(&db, &Outbox::default(), 2, 50, 2, &ledger));
    let _relay = relay("relay", &db, &stream, &slot, DELETE_CAPTURED_AT_ONCE);
    wait_count(&stream, 200, Duration::from_secs(30)).await;
    wait_until(
        Duration::from_secs(10),
        "the first start's rows deleted",
        || async { db.scalar("SELECT count(*) FROM outbox") == 0 },
    )
    .await;
    assert_stream_holds(&stream, &ledger).await;
}

#[tokio::test]
async fn relay_killed_between_publish_and_slot_advance_repeats_but_never_skips() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let args = ["--batch-size", "100000", "--max-in-flight", "64"];
    let mut relay1 = relay("relay-1", &db, &stream, &slot, &args);
    wait_reader(&db, &slot).await;
    let before = slot.confirmed(&db);

    // one transaction of 8,000 events: the slot can only move past it once all are acked
    let events: Vec<Changed> = (0..8_000)
        .map(|n| changed(&format!("acct-{}", n % 50), n))
        .collect();
    let ids = db
        .conn()
        .transaction(|c| c.record_events(&events))
        .expect("commit");
    let commit_end = db.scalar("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint");
    wait_count(&stream, 1, Duration::from_secs(30)).await;
    relay1.kill(); // kill -9: published in part, not confirmed
    let published = stream.count().await;
    assert!(
        published > 0 && published < 8_000,
        "killed mid-transaction ({published} published)"
    );
    assert!(
        slot.confirmed(&db) < commit_end,
        "the slot did not move past an unacked transaction"
    );
    assert!(slot.confirmed(&db) >= before);

    let _relay2 = relay("relay-2", &db, &stream, &slot, &args);
    wait_count(&stream, 8_000, Duration::from_secs(240)).await;
    wait_until(
        Duration::from_secs(30),
        "the slot confirmed past the transaction",
        || async { slot.confirmed(&db) >= commit_end },
    )
    .await;
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    for (e, id) in events.iter().zip(&ids) {
        expected
            .entry(e.account.clone())
            .or_default()
            .push(id.to_string());
    }
    assert_exactly_once_in_order(&stream.read_all().await, &expected);
}

#[tokio::test]
async fn standby_takes_over_when_the_active_reader_dies() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let mut a = relay("relay-a", &db, &stream, &slot, &[]);
    let reader_a = wait_reader(&db, &slot).await;
    let _b = relay("relay-b", &db, &stream, &slot, &[]);
    // b connects and stands by: a keeps the slot
    wait_until(Duration::from_secs(30), "relay b connected", || async {
        db.scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' AND datname = current_database()") >= 2
    })
    .await;
    assert_eq!(slot.reader(&db), Some(reader_a));

    let mut conn = db.conn();
    let mut expected: Vec<String> = Vec::new();
    for n in 0..50 {
        expected.push(
            conn.transaction(|c| c.record_event(&changed("S", n)))
                .expect("commit")
                .to_string(),
        );
    }
    wait_count(&stream, 50, Duration::from_secs(30)).await;

    a.kill();
    for n in 50..100 {
        expected.push(
            conn.transaction(|c| c.record_event(&changed("S", n)))
                .expect("commit")
                .to_string(),
        );
    }
    wait_count(&stream, 100, Duration::from_secs(30)).await;
    let reader_b = slot.reader(&db).expect("b reads the slot");
    assert_ne!(reader_b, reader_a, "the standby took over");
    let got: Vec<String> = stream
        .read_all()
        .await
        .into_iter()
        .map(|m| m.msg_id)
        .collect();
    assert_eq!(got, expected, "every event once, in commit order");
}

#[tokio::test]
async fn a_paused_reader_is_replaced_and_does_not_publish_after_it_wakes() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let args = ["--lease", "3s"];
    let a = relay("relay-a", &db, &stream, &slot, &args);
    let reader_a = wait_reader(&db, &slot).await;
    let _b = relay("relay-b", &db, &stream, &slot, &args);
    tokio::time::sleep(Duration::from_millis(500)).await;

    a.signal("STOP");
    let mut conn = db.conn();
    let mut expected = Vec::new();
    for n in 0..20 {
        expected.push(
            conn.transaction(|c| c.record_event(&changed("P", n)))
                .expect("commit")
                .to_string(),
        );
    }
    // PostgreSQL ends a's silent session after the lease; b takes the slot
    wait_count(&stream, 20, Duration::from_secs(30)).await;
    let reader_b = slot.reader(&db).expect("b reads");
    assert_ne!(reader_b, reader_a);

    a.signal("CONT");
    tokio::time::sleep(Duration::from_secs(1)).await;
    for n in 20..40 {
        expected.push(
            conn.transaction(|c| c.record_event(&changed("P", n)))
                .expect("commit")
                .to_string(),
        );
    }
    wait_count(&stream, 40, Duration::from_secs(30)).await;
    assert_eq!(
        slot.reader(&db),
        Some(reader_b),
        "b keeps the slot after a wakes"
    );
    let got: Vec<String> = stream
        .read_all()
        .await
        .into_iter()
        .map(|m| m.msg_id)
        .collect();
    assert_eq!(got, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_kills_during_twenty_thousand_events_deliver_each_exactly_once_in_commit_order() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let args = ["--batch-size", "2000"];
    let mut current = relay("relay-0", &db, &stream, &slot, &args);
    wait_reader(&db, &slot).await;

    // 4 writers x 1,250 transactions x 4 events; half of them delete right after inserting
    let ledger = Ledger::default();
    let mut writers = start_writers(&db, &Outbox::default(), 2, 1_250, 4, &ledger);
    writers.extend(start_writers_from(
        &db,
        &Outbox::default().delete_after_insert(true),
        2,
        2,
        1_250,
        4,
        &ledger,
    ));
    let start = Instant::now();
    let mut kills = 0;
    for k in 1..=10u64 {
        wait_count(&stream, k * 1_800, Duration::from_secs(120)).await;
        current.kill();
        kills += 1;
        current = relay(&format!("relay-{k}"), &db, &stream, &slot, &args);
    }
    join_all(writers);
    wait_count(&stream, 20_000, Duration::from_secs(180)).await;
    eprintln!(
        "{kills} kills, 20,000 events in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    drop(current);
    assert_stream_holds(&stream, &ledger).await;
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

#[tokio::test]
async fn status_reports_the_slot_lag_and_its_reader() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let relay_proc = relay("relay", &db, &stream, &slot, &[]);
    let reader = wait_reader(&db, &slot).await;
    db.conn()
        .transaction(|c| c.record_event(&changed("X", 1)))
        .expect("commit");
    wait_count(&stream, 1, Duration::from_secs(30)).await;

    let status = |extra: &[&str]| {
        let out = Command::new(relay_bin())
            .env("DATABASE_URL", &db.url)
            .args(["status", "--mode", "log-tailing", "--slot", &slot.name])
            .args(extra)
            .output()
            .expect("run outbox-relay status");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, out) = status(&["--json"]);
    assert_eq!(code, 0, "{out}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(json["slot"]["slot"], slot.name.as_str());
    assert!(json["slot"]["lag_bytes"].as_i64().is_some(), "{out}");
    assert_eq!(json["slot"]["reader_pid"].as_i64(), Some(reader), "{out}");
    assert_eq!(json["stalled"], false);
    let (code, out) = status(&[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("slot lag"), "{out}");

    // no reader: events wait in the slot, and status says it stalls
    drop(relay_proc);
    db.conn()
        .transaction(|c| c.record_event(&changed("X", 2)))
        .expect("commit");
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let (code, out) = status(&["--json", "--stall-after", "1s"]);
    let json: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(code, 1, "{out}");
    assert!(
        json["slot"]["lag_seconds"]
            .as_f64()
            .is_some_and(|s| s >= 1.0),
        "{out}"
    );
    assert_eq!(json["slot"]["reader_pid"], serde_json::Value::Null, "{out}");
}

#[tokio::test]
async fn a_role_without_replication_gets_a_clear_error() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let (role, url) = role_without_replication(&db, &slot);
    let mut conn = db.conn();
    diesel::sql_query("CREATE PUBLICATION lt_pub FOR TABLE outbox")
        .execute(&mut conn)
        .expect("publication");
    let out = relay_command(
        &db,
        &stream,
        &[
            "--mode",
            "log-tailing",
            "--slot",
            &slot.name,
            "--publication",
            "lt_pub",
        ],
    )
    .env("DATABASE_URL", &url)
    .output()
    .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("REPLICATION"), "{err}");
    drop(conn);
    drop_role(&db, &role);
}

/// The slot and the publication made beforehand by a superuser: the relay's role still needs
/// `REPLICATION` to stream the slot, and hears so at start-up instead of retrying for ever.
#[tokio::test]
async fn a_role_without_replication_cannot_stream_a_slot_made_for_it() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::create(&db);
    let (role, url) = role_without_replication(&db, &slot);
    let out = relay_command(
        &db,
        &stream,
        &["--mode", "log-tailing", "--slot", &slot.name],
    )
    .env("DATABASE_URL", &url)
    .output()
    .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("refused a replication connection") && err.contains("REPLICATION"),
        "{err}"
    );
    assert_eq!(stream.count().await, 0);
    drop_role(&db, &role);
}

/// A login role named after the slot (roles are cluster-wide) with the table rights of a
/// log-tailing relay but not `REPLICATION`, and the test database's URL as that role.
fn role_without_replication(db: &TestDb, slot: &Slot) -> (String, String) {
    let role = format!("lt_role_{}", &slot.name[3..]);
    let mut conn = db.conn();
    diesel::sql_query(format!("CREATE ROLE {role} LOGIN"))
        .execute(&mut conn)
        .expect("role");
    diesel::sql_query(format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO {role}"
    ))
    .execute(&mut conn)
    .expect("grant");
    let url = db.url.replacen("postgres@", &format!("{role}@"), 1);
    (role, url)
}

fn drop_role(db: &TestDb, role: &str) {
    let _ = diesel::sql_query(format!("DROP OWNED BY {role}")).execute(&mut db.conn());
    let mut admin = PgConnection::establish(db.admin_url()).expect("admin");
    let _ = diesel::sql_query(format!("DROP ROLE IF EXISTS {role}")).execute(&mut admin);
}

#[tokio::test]
async fn a_poison_event_is_parked_passed_over_and_published_again_on_retry() {
    use async_nats::jetstream::stream::Config;
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    // a stream that refuses messages over 1,000 bytes, as a server's limits can
    let config = |max_message_size| Config {
        max_message_size,
        ..stream.config()
    };
    let js = stream.js().await;
    js.create_stream(config(1000)).await.expect("stream");
    let _relay = relay("relay", &db, &stream, &slot, &["--max-attempts", "2"]);
    wait_reader(&db, &slot).await;

    // recorded with delete-after-insert: the parked event is written back to the table
    let outbox = Outbox::default().delete_after_insert(true);
    let mut conn = db.conn();
    let big = Changed {
        account: "P".into(),
        n: 1,
        blob: Some("x".repeat(2000)),
    };
    let poison = conn
        .transaction(|c| c.record_event_in(&outbox, &big))
        .expect("p1");
    let mut expected = Vec::new();
    for (agg, n) in [("P", 2), ("Q", 1), ("Q", 2)] {
        expected.push(
            conn.transaction(|c| c.record_event_in(&outbox, &changed(agg, n)))
                .expect("commit")
                .to_string(),
        );
    }
    wait_count(&stream, 3, Duration::from_secs(30)).await;
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) FROM outbox WHERE id = '{poison}' AND parked_at IS NOT NULL \
             AND last_error IS NOT NULL AND attempts = 2"
        )),
        1,
        "the poison event is parked in the table"
    );
    let got: Vec<String> = stream
        .read_all()
        .await
        .into_iter()
        .map(|m| m.msg_id)
        .collect();
    assert_eq!(got, expected, "the log passed over it");

    let cli = |args: &[&str]| {
        let out = Command::new(relay_bin())
            .env("DATABASE_URL", &db.url)
            .args(args)
            .output()
            .expect("run outbox-relay");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let parked: serde_json::Value =
        serde_json::from_str(&cli(&["parked", "--json"])).expect("json");
    assert_eq!(parked[0]["id"], poison.to_string().as_str());

    js.update_stream(config(-1))
        .await
        .expect("allow big messages");
    assert!(cli(&["retry", "--all"]).contains("released 1"));
    wait_count(&stream, 4, Duration::from_secs(30)).await;
    let got = stream.read_all().await;
    assert_eq!(got[3].msg_id, poison.to_string(), "published once released");
    assert_eq!(got[3].payload["blob"].as_str().map(str::len), Some(2000));
}

/// A publication whose name needs quoting (capitals, a hyphen) is created and streamed
/// under that exact name.
#[tokio::test]
async fn a_publication_name_that_needs_quoting_is_streamed() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay(
        "relay",
        &db,
        &stream,
        &slot,
        &["--publication", "Outbox-Pub"],
    );
    wait_reader(&db, &slot).await;
    assert_eq!(
        db.scalar("SELECT count(*) FROM pg_publication WHERE pubname = 'Outbox-Pub'"),
        1,
        "the publication under its exact name"
    );
    let id = db
        .conn()
        .transaction(|c| c.record_event(&changed("Q", 1)))
        .expect("record");
    wait_count(&stream, 1, Duration::from_secs(30)).await;
    assert_eq!(stream.read_all().await[0].msg_id, id.to_string());
}

/// `--stats-interval` longer than `--lease`: an idle reader's only queries used to be the
/// stats, so PostgreSQL ended its session after the lease and the slot changed hands. The
/// reader renews its session while it waits.
#[tokio::test]
async fn an_idle_reader_keeps_its_session_when_stats_are_rarer_than_the_lease() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay(
        "relay",
        &db,
        &stream,
        &slot,
        &["--lease", "3s", "--stats-interval", "1h"],
    );
    let reader = wait_reader(&db, &slot).await;
    // idle for more than two leases
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(
        slot.reader(&db),
        Some(reader),
        "the same session still reads the slot"
    );
    let id = db
        .conn()
        .transaction(|c| c.record_event(&changed("I", 1)))
        .expect("record");
    wait_count(&stream, 1, Duration::from_secs(30)).await;
    assert_eq!(stream.read_all().await[0].msg_id, id.to_string());
    assert_eq!(slot.reader(&db), Some(reader));
}

/// Making the slot waits for every transaction running at that moment to end. A transaction
/// held open for more than two leases must not cost the reader its session (PostgreSQL ends a
/// session silent for the lease): the same session makes the slot, and every event comes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_keeps_its_session_while_making_its_slot_waits_for_a_long_transaction() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let before = db
        .conn()
        .transaction(|c| c.record_event(&changed("B", 1)))
        .expect("record");
    // a transaction with an id, held open across the slot's creation
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (began, began_wait) = std::sync::mpsc::channel::<()>();
    let mut open = db.conn();
    let holder = std::thread::spawn(move || {
        open.transaction(|c| {
            c.record_event(&changed("H", 1))?;
            began.send(()).ok();
            held.recv().ok();
            Ok::<_, diesel::result::Error>(())
        })
        .expect("the held transaction commits");
    });
    began_wait.recv().expect("the transaction began");
    let _relay = relay("relay", &db, &stream, &slot, &["--lease", "3s"]);
    wait_until(Duration::from_secs(30), "the reader's lock", || async {
        slot.reader(&db).is_some()
    })
    .await;
    let reader = slot.reader(&db);
    // more than two leases while the slot waits for the held transaction
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(
        slot.reader(&db),
        reader,
        "the session that began making the slot still holds it"
    );
    release.send(()).expect("end the held transaction");
    holder.join().expect("the holder");
    wait_count(&stream, 2, Duration::from_secs(60)).await;
    assert_eq!(slot.reader(&db), reader, "and reads it");
    let ids: Vec<String> = stream
        .read_all()
        .await
        .into_iter()
        .map(|m| m.msg_id)
        .collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert!(ids.contains(&before.to_string()), "{ids:?}");
}

/// Writers commit before, while and after the relay makes its slot: the rows committed
/// before the slot's consistent point come from its exported snapshot, the rest from the
/// slot, with no gap between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_start_beside_running_writers_publishes_every_event_once_in_order() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let ledger = Ledger::default();
    let pause = Duration::from_millis(2);
    let writers = start_paced_writers(&db, &Outbox::default(), 0, 4, 400, 2, pause, &ledger);
    wait_until(Duration::from_secs(30), "rows before the relay", || async {
        db.scalar("SELECT count(*) FROM outbox") >= 300
    })
    .await;
    let _relay = relay("relay", &db, &stream, &slot, &[]);
    join_all(writers);
    wait_count(&stream, 3_200, Duration::from_secs(120)).await;
    assert_stream_holds(&stream, &ledger).await;
}

/// The README's switch from `ordered` to `log-tailing`, writers committing throughout: start
/// the log-tailing relay, then stop the ordered one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_from_ordered_to_log_tailing_under_load_loses_nothing() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let mut ordered = Proc::spawn("ordered", &mut relay_command(&db, &stream, &[]));
    let ledger = Ledger::default();
    let pause = Duration::from_millis(2);
    let writers = start_paced_writers(&db, &Outbox::default(), 0, 4, 500, 2, pause, &ledger);
    wait_count(&stream, 400, Duration::from_secs(30)).await;
    let _tailing = relay("tailing", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;
    ordered.signal("TERM");
    assert_eq!(ordered.wait_exit(Duration::from_secs(30)), Some(0));
    assert!(
        writers.iter().any(|w| !w.is_finished()),
        "the writers still commit after the switch"
    );
    join_all(writers);
    wait_count(&stream, 4_000, Duration::from_secs(120)).await;
    assert_stream_holds(&stream, &ledger).await;
}

/// The README's switch from `log-tailing` back to `ordered`, writers committing throughout:
/// stop the log-tailing relay, start the ordered one, drop the slot and its record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_from_log_tailing_to_ordered_under_load_loses_nothing() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let mut tailing = relay("tailing", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;
    let ledger = Ledger::default();
    let pause = Duration::from_millis(2);
    let writers = start_paced_writers(&db, &Outbox::default(), 0, 4, 500, 2, pause, &ledger);
    wait_count(&stream, 400, Duration::from_secs(30)).await;
    tailing.signal("TERM");
    assert_eq!(tailing.wait_exit(Duration::from_secs(30)), Some(0));
    let _ordered = Proc::spawn("ordered", &mut relay_command(&db, &stream, &[]));
    support::slot::drop_slot(db.admin_url(), &slot.name);
    diesel::sql_query(format!(
        "DELETE FROM outbox_relay_slots WHERE slot_name = '{}'",
        slot.name
    ))
    .execute(&mut db.conn())
    .expect("the slot's record");
    assert!(
        writers.iter().any(|w| !w.is_finished()),
        "the writers still commit after the switch"
    );
    join_all(writers);
    wait_count(&stream, 4_000, Duration::from_secs(120)).await;
    assert_stream_holds(&stream, &ledger).await;
}

/// Runs the relay until it exits (within `timeout`); its exit code and what it logged.
fn run_to_exit(
    db: &TestDb,
    stream: &TestStream,
    args: &[&str],
    timeout: Duration,
) -> (i32, String) {
    let mut child = relay_command(db, stream, args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    let start = Instant::now();
    let code = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status.code().unwrap_or(-1);
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the relay did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    (code, err)
}

/// A slot dropped under a running reader (as a failover to a standby without it would lose
/// it): the relay stops with an error that says what may be lost and how to recover, a
/// restart refuses likewise, and `--recover-slot` publishes again what the table still
/// holds, so every event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_slot_stops_the_relay_and_recover_slot_publishes_what_may_be_missing() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let mut first = relay("relay", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;
    let ledger = Ledger::default();
    join_all(start_writers(&db, &Outbox::default(), 2, 50, 1, &ledger));
    wait_count(&stream, 100, Duration::from_secs(30)).await;
    support::slot::drop_slot(db.admin_url(), &slot.name);
    // recorded while the slot is gone: no slot will ever send these
    join_all(start_writers_from(
        &db,
        &Outbox::default(),
        2,
        2,
        25,
        1,
        &ledger,
    ));
    assert_eq!(
        first.wait_exit(Duration::from_secs(30)),
        Some(1),
        "the relay stops"
    );
    let args = ["--mode", "log-tailing", "--slot", &slot.name];
    let (code, err) = run_to_exit(&db, &stream, &args, Duration::from_secs(60));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("is missing") && err.contains("--recover-slot"),
        "{err}"
    );
    assert!(!slot.exists(&db), "no slot made silently");
    let _recovered = relay("recovered", &db, &stream, &slot, &["--recover-slot"]);
    wait_count(&stream, 150, Duration::from_secs(60)).await;
    assert_stream_holds(&stream, &ledger).await;
}

/// `outbox-relay retry` releases a parked row while the reader lags behind a backlog and the
/// cleanup of captured rows runs meanwhile: the row, old and below the confirmed `seq`, was
/// deleted before the reader read its release, and never published. It is published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_row_is_published_once_when_cleanup_runs_before_the_reader_sees_the_release() {
    use async_nats::jetstream::stream::Config;
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let config = |max_message_size| Config {
        max_message_size,
        ..stream.config()
    };
    let js = stream.js().await;
    js.create_stream(config(1000)).await.expect("stream");
    let _relay = relay(
        "relay",
        &db,
        &stream,
        &slot,
        &[
            "--max-attempts",
            "2",
            "--captured-retention",
            "0s",
            "--captured-cleanup-interval",
            "100ms",
        ],
    );
    wait_reader(&db, &slot).await;
    let mut conn = db.conn();
    let big = Changed {
        account: "P".into(),
        n: 1,
        blob: Some("x".repeat(2000)),
    };
    let poison = conn.transaction(|c| c.record_event(&big)).expect("record");
    wait_until(Duration::from_secs(60), "the event parked", || async {
        db.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL") == 1
    })
    .await;
    js.update_stream(config(-1)).await.expect("limit lifted");
    // a backlog the reader takes a while to publish, then the release behind it
    let ledger = Ledger::default();
    join_all(start_writers(&db, &Outbox::default(), 2, 40, 50, &ledger));
    let out = Command::new(relay_bin())
        .args(["retry", "--all"])
        .env("DATABASE_URL", &db.url)
        .output()
        .expect("retry");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_count(&stream, 4_001, Duration::from_secs(60)).await;
    let got = stream.read_all().await;
    let ids: Vec<&str> = got.iter().map(|m| m.msg_id.as_str()).collect();
    assert_eq!(
        ids.iter().filter(|id| **id == poison.to_string()).count(),
        1,
        "the retried event published once"
    );
    assert_eq!(got.len(), 4_001);
    wait_until(Duration::from_secs(30), "captured rows deleted", || async {
        db.scalar("SELECT count(*) FROM outbox") == 0
    })
    .await;
}

/// The value of the unlabelled metric `name` on the relay's `/metrics` at `addr`.
async fn metric(addr: &str, name: &str) -> Option<f64> {
    let (_, body) = support::http_get(addr, "/metrics").await?;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_lag_in_seconds_is_the_age_of_the_oldest_unconfirmed_commit() {
    let mut nats = support::servers::NatsServer::start();
    let (db, stream) = (TestDb::new(), TestStream::on(&nats.url()));
    let slot = Slot::new(&db);
    let addr = format!("127.0.0.1:{}", support::free_port());
    let _relay = relay(
        "relay",
        &db,
        &stream,
        &slot,
        &["--metrics-addr", &addr, "--stats-interval", "200ms"],
    );
    wait_reader(&db, &slot).await;
    // NATS gone: the commit is read and never acked, so the slot is not confirmed past it
    nats.stop();
    let committed = Instant::now();
    db.conn()
        .transaction(|c| c.record_event(&changed("L", 1)))
        .expect("commit");
    wait_until(
        Duration::from_secs(30),
        "a slot lag of a second",
        || async {
            metric(&addr, "outbox_slot_lag_seconds")
                .await
                .is_some_and(|s| s >= 1.0)
        },
    )
    .await;
    let lag = metric(&addr, "outbox_slot_lag_seconds")
        .await
        .unwrap_or_default();
    let age = committed.elapsed().as_secs_f64();
    assert!(
        lag <= age + 1.0,
        "the slot lags {lag} s behind a commit made {age} s ago"
    );
    nats.restart();
    wait_count(&stream, 1, Duration::from_secs(30)).await;
}

/// Acks slower than the lease (the broker frozen for 4.5 s, within the client's 5 s ack
/// timeout, past a 3 s lease): the reader waiting for them keeps its session, which holds the
/// slot's lock, and its replication connection; PostgreSQL's idle timeout does not end them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reader_keeps_its_session_while_acks_are_slower_than_the_lease() {
    let nats = support::servers::NatsServer::start();
    let (db, stream) = (TestDb::new(), TestStream::on(&nats.url()));
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, &["--lease", "3s"]);
    let reader = wait_reader(&db, &slot).await;
    let sessions = || {
        db.strings(
            "SELECT pid::text FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
             AND datname = current_database() ORDER BY pid",
        )
    };
    let before = sessions();
    assert!(!before.is_empty());

    nats.pause();
    db.conn()
        .transaction(|c| {
            let events: Vec<Changed> = (0..20)
                .map(|i| changed(&format!("K{}", i % 5), i))
                .collect();
            c.record_events(&events)
        })
        .expect("commit");
    // the reader gets the transaction from the slot at once and sends it; the acks come
    // within the client's 5 s timeout
    tokio::time::sleep(Duration::from_millis(4500)).await;
    nats.resume();

    wait_count(&stream, 20, Duration::from_secs(30)).await;
    assert_eq!(
        (slot.reader(&db), sessions()),
        (Some(reader), before),
        "the reader's sessions were ended while it waited for acks"
    );
    assert_eq!(stream.count().await, 20);
}
