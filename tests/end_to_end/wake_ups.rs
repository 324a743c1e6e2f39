//! Wake-ups: what makes an idle relay read or look at once, rather than at its next poll or
//! look: commits within its linger, `retry`, a relay that joins or stops.

use std::time::Duration;

use diesel::prelude::*;
use outbox_diesel::{Outbox, OutboxExt, OutboxTable};
use outbox_nats::RelayConfig;

use crate::support::{self, TestDb, TestStream, wait_published, wait_until};
use crate::{InProcessRelay, OrderPlaced, config};

/// A relay of `mode` that polls, and balances its partitions, every 10 s, and lingers `linger`
/// after a read that found rows: between those, only a notification wakes it.
fn polling_every_10s(
    db: &TestDb,
    stream: &TestStream,
    mode: outbox_nats::Mode,
    linger: Duration,
) -> RelayConfig {
    let mut config = config(db, stream)
        .poll_interval(Duration::from_secs(10))
        .lease(Duration::from_secs(40))
        .linger(linger);
    config.mode = mode;
    config.standby_interval = Duration::from_secs(10);
    config
}

/// A writer that notifies once a minute (so only its first commit wakes the relay), the
/// relay polling (and balancing its partitions, which reads too) every 10 s and lingering 3 s
/// after a read that found rows.
async fn commits_after_a_notified_one(mode: outbox_nats::Mode) {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let outbox = Outbox::new(OutboxTable::default())
        .notify(outbox_diesel::Notify::Debounced(Duration::from_secs(60)));
    let config = polling_every_10s(&db, &stream, mode, Duration::from_secs(3));
    let relay = InProcessRelay::start(config, &stream).await;
    let mut conn = db.conn();
    let record = |conn: &mut PgConnection, n: i64| {
        conn.transaction(|conn| {
            conn.record_event_in(
                &outbox,
                &OrderPlaced {
                    order_id: "o-1".into(),
                    n,
                },
            )
        })
        .expect("record");
    };
    // notified: read at once
    record(&mut conn, 1);
    wait_published(&db, 1, Duration::from_secs(20)).await;
    // within the debounce, so not notified: read by the relay's lingering reads
    record(&mut conn, 2);
    wait_until(
        Duration::from_secs(5),
        "the unnotified commit published while the relay lingers, before its next poll",
        || async { stream.count().await == 2 },
    )
    .await;
    // once the linger is over the relay waits for a NOTIFY or its poll again: an unnotified
    // commit waits for the poll (10 s)
    tokio::time::sleep(Duration::from_secs(4)).await;
    record(&mut conn, 3);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        stream.count().await,
        2,
        "the relay stops reading every few hundred milliseconds once the linger is over"
    );
    wait_until(
        Duration::from_secs(20),
        "the last commit published at the poll",
        || async { stream.count().await == 3 },
    )
    .await;
    relay.stop().await;
    let got = stream.read_all().await;
    let ns: Vec<i64> = got
        .iter()
        .map(|m| m.payload["n"].as_i64().unwrap_or(-1))
        .collect();
    assert_eq!(ns, [1, 2, 3]);
}

#[tokio::test]
async fn ordered_relay_reads_commits_after_a_notified_one_within_its_linger() {
    commits_after_a_notified_one(outbox_nats::Ordered::default().into()).await;
}

#[tokio::test]
async fn unordered_relay_reads_commits_after_a_notified_one_within_its_linger() {
    commits_after_a_notified_one(outbox_nats::Unordered::default().workers(1).into()).await;
}

/// The linger's reads after the first ask PostgreSQL first whether a transaction ended, as a
/// poll does: the batch statement's start (or a claim's) costs the server several times the
/// question, and with commits further apart than the reads most of them find nothing. A relay
/// lingering 3 s (a read every 300 ms) after one notified commit reads (`reads`, a `LIKE`
/// pattern of its read statement) a few times, not at each of its ten reads.
async fn lingering_reads_ask_first_after_the_first(mode: outbox_nats::Mode, reads: &str) {
    let (_cluster, db) = TestDb::counting_statements();
    let stream = TestStream::new();
    let outbox = Outbox::new(OutboxTable::default());
    let config = polling_every_10s(&db, &stream, mode, Duration::from_secs(3));
    let relay = InProcessRelay::start(config, &stream).await;
    // past the relay's start, its first reads and looks
    tokio::time::sleep(Duration::from_secs(1)).await;
    let batches = || db.calls_and_plans(reads).0;
    let questions = || {
        db.calls_and_plans("SELECT pg_current_snapshot()::text AS snap")
            .0
    };
    let (batches_before, questions_before) = (batches(), questions());
    let mut conn = db.conn();
    conn.transaction(|conn| {
        conn.record_event_in(
            &outbox,
            &OrderPlaced {
                order_id: "o-1".into(),
                n: 1,
            },
        )
    })
    .expect("record");
    wait_until(
        Duration::from_secs(5),
        "the notified commit published",
        || async { stream.count().await == 1 },
    )
    .await;
    // the linger, and a little more
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let (reads, asked) = (batches() - batches_before, questions() - questions_before);
    relay.stop().await;
    eprintln!("one commit and its linger: {reads} reads, {asked} questions");
    assert!(
        asked >= 5,
        "the lingering reads asked first: {asked} questions, {reads} reads"
    );
    assert!(
        reads <= 6,
        "the relay read {reads} times for one commit and its linger ({asked} questions)"
    );
}

#[tokio::test]
async fn the_ordered_relays_lingering_reads_ask_first_after_the_first() {
    lingering_reads_ask_first_after_the_first(
        outbox_nats::Ordered::default().into(),
        "WITH cur AS MATERIALIZED%",
    )
    .await;
}

#[tokio::test]
async fn the_unordered_relays_lingering_claims_ask_first_after_the_first() {
    lingering_reads_ask_first_after_the_first(
        outbox_nats::Unordered::default().workers(1).into(),
        "SELECT o.seq, o.id, o.aggregate_type%SKIP LOCKED%",
    )
    .await;
}

/// A parked row, released by `retry` while the relay idles (polling and balancing every 10 s):
/// `retry` notifies the table's channel, and the relay publishes the row at once (before, at
/// its next poll: an idle relay's question does not see a row whose `UPDATE` kept its
/// transaction id).
/// `before_retry`: the rows published before it (5 when the parked row holds the rest of its
/// aggregate back, in the ordered mode; 10 in the unordered one).
async fn retry_wakes_an_idle_relay(mode: outbox_nats::Mode, before_retry: u64) {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let outbox = Outbox::new(OutboxTable::default());
    let mut conn = db.conn();
    let record = |conn: &mut PgConnection, order: &str, n: i64| {
        conn.transaction(|conn| {
            conn.record_event_in(
                &outbox,
                &OrderPlaced {
                    order_id: order.into(),
                    n,
                },
            )
        })
        .expect("record");
    };
    record(&mut conn, "o-1", 0);
    db.execute("UPDATE outbox SET parked_at = now(), attempts = 5", "park");
    for n in 1..=5 {
        record(&mut conn, "o-1", n);
        record(&mut conn, "o-2", n);
    }
    let config = polling_every_10s(&db, &stream, mode, Duration::from_millis(200));
    let relay = InProcessRelay::start(config, &stream).await;
    wait_until(
        Duration::from_secs(20),
        "every row published that the parked one does not hold back",
        || async { stream.count().await == before_retry },
    )
    .await;
    // past the linger and the first looks: the relay waits for a notification or its poll
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut a = db.async_conn().await;
    let released = outbox_nats::operations::retry(
        &mut a,
        &OutboxTable::DEFAULT,
        outbox_nats::operations::Retry::All,
    )
    .await
    .expect("retry");
    assert_eq!(released, 1);
    wait_until(
        Duration::from_secs(3),
        "the released row published at once, not at the next poll",
        || async { stream.count().await == 11 },
    )
    .await;
    relay.stop().await;
    let o1: Vec<i64> = stream
        .read_all()
        .await
        .iter()
        .filter(|m| m.aggregate_id == "o-1")
        .map(|m| m.payload["n"].as_i64().unwrap_or(-1))
        .collect();
    if before_retry == 5 {
        // ordered: the released row first, then the rows it held back
        assert_eq!(o1, [0, 1, 2, 3, 4, 5]);
    } else {
        assert_eq!(o1, [1, 2, 3, 4, 5, 0]);
    }
}

#[tokio::test]
async fn retry_wakes_an_idle_ordered_relay_at_once() {
    retry_wakes_an_idle_relay(outbox_nats::Ordered::default().into(), 5).await;
}

#[tokio::test]
async fn retry_wakes_idle_unordered_workers_at_once() {
    retry_wakes_an_idle_relay(outbox_nats::Unordered::default().workers(2).into(), 10).await;
}

/// Relays that look at the partitions' shares every 20 s: one that joins, and one that
/// stops, move the shares at once (relays tell each other with `NOTIFY`), whether the others
/// are idle or standing by, not at the others' next look.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_move_the_shares_at_once_when_one_joins_or_stops() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let relay = || {
        let mut config = config(&db, &stream).lease(Duration::from_secs(60));
        config.mode = outbox_nats::Ordered::default().partitions(2).into();
        config.standby_interval = Duration::from_secs(20);
        InProcessRelay::start(config, &stream)
    };
    let soon = Duration::from_secs(5);
    let a = relay().await;
    wait_until(soon, "the first relay owns both partitions", || async {
        support::partitions_per_owner(&db).values().eq([&2])
    })
    .await;
    // past the first relay's second look (100 ms after its first): its next is 20 s away
    tokio::time::sleep(Duration::from_secs(1)).await;

    let b = relay().await;
    wait_until(
        soon,
        "a relay that joins gets its share at once",
        || async {
            let s = support::partitions_per_owner(&db);
            s.len() == 2 && s.values().all(|&n| n == 1)
        },
    )
    .await;
    let first_two: Vec<i32> = support::partitions_per_owner(&db).into_keys().collect();

    // a third relay stands by: no partition is left for it
    let c = relay().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let s = support::partitions_per_owner(&db);
    assert!(
        s.len() == 2 && s.keys().all(|pid| first_two.contains(pid)),
        "the two relays keep their partitions: {s:?}"
    );

    a.stop().await;
    wait_until(
        soon,
        "the relay standing by takes the partition of one that stops, at once",
        || async {
            let s = support::partitions_per_owner(&db);
            s.len() == 2
                && s.values().all(|&n| n == 1)
                && s.keys().any(|pid| !first_two.contains(pid))
        },
    )
    .await;

    b.stop().await;
    wait_until(
        soon,
        "the relay left takes the partition of the next that stops, at once",
        || async {
            let s = support::partitions_per_owner(&db);
            s.len() == 1 && s.iter().all(|(pid, &n)| n == 2 && !first_two.contains(pid))
        },
    )
    .await;

    let mut conn = db.conn();
    for i in 0..20 {
        conn.transaction(|conn| {
            conn.record_event(&OrderPlaced {
                order_id: format!("o-{}", i % 5),
                n: i,
            })
        })
        .expect("record");
    }
    wait_published(&db, 20, Duration::from_secs(30)).await;
    c.stop().await;
    assert_eq!(stream.count().await, 20);
}
