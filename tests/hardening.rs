//! Failure paths found by reading the code, each with the behaviour users need (see
//! RELIABILITY.md, "Hardening: failure paths and their tests").
//!
//! Relays run as real `outbox-relay` processes: build them first with
//! `cargo build --workspace --bins`. The 100,000-row variants are `#[ignore]`d:
//! `cargo test --test hardening -- --ignored`.

mod support;

use std::fs::File;
use std::process::{Command, Stdio};
use std::time::Duration;

use diesel::prelude::*;
use support::servers::NatsServer;
use support::{Proc, TestDb, TestStream, free_port, http_get, relay_command, wait_until};

/// Inserts `n` rows of `n` distinct aggregates with plain SQL, in one statement.
fn insert_rows(db: &TestDb, n: i64) {
    diesel::sql_query(format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || i, 'order.placed', jsonb_build_object('n', i) \
         FROM generate_series(1, {n}) AS i"
    ))
    .execute(&mut db.conn())
    .expect("insert rows");
}

fn unpublished(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
}

fn parked(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL")
}

/// A relay with its stderr in a temporary file, read back with [`Relay::logs`].
struct Relay {
    proc: Proc,
    log: std::path::PathBuf,
}

impl Relay {
    fn start(mut cmd: Command) -> Self {
        let log = std::env::temp_dir().join(format!(
            "outbox-hardening-{}.log",
            uuid::Uuid::now_v7().simple()
        ));
        let file = File::create(&log).expect("relay log file");
        cmd.stdout(Stdio::null()).stderr(Stdio::from(file));
        Relay {
            proc: Proc::spawn("outbox-relay", &mut cmd),
            log,
        }
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.proc.kill();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Waits until no row is unpublished, or panics with the relay's log.
async fn drained(db: &TestDb, relay: &Relay, timeout: Duration) {
    let start = std::time::Instant::now();
    loop {
        let left = unpublished(db);
        if left == 0 {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "{left} rows still unpublished after {timeout:?}; relay log:\n{}",
            relay.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// 1. ack permits: one JetStream context, 5,000 unawaited acks by default, shared by all workers

/// Ordered mode with an in-flight window larger than the client's default ack permits.
async fn ordered_window_above_the_ack_permits_drains(rows: i64) {
    let db = TestDb::new();
    let stream = TestStream::new();
    insert_rows(&db, rows);
    let relay = Relay::start(relay_command(
        &db,
        &stream,
        &["--max-in-flight", "6000", "--no-cleanup"],
    ));
    drained(&db, &relay, Duration::from_secs(120)).await;
    assert_eq!(stream.count().await, rows as u64);
}

#[tokio::test]
async fn ordered_relay_with_6000_in_flight_drains_a_backlog_past_the_ack_permits() {
    ordered_window_above_the_ack_permits_drains(6_000).await;
}

#[tokio::test]
#[ignore = "100,000 rows: cargo test --test hardening -- --ignored"]
async fn long_ordered_relay_with_6000_in_flight_drains_100000_rows() {
    ordered_window_above_the_ack_permits_drains(100_000).await;
}

/// Unordered mode with 16 workers of 500-row batches: 8,000 publishes in flight at once.
async fn sixteen_workers_drain(rows: i64) {
    let db = TestDb::new();
    let stream = TestStream::new();
    insert_rows(&db, rows);
    let relay = Relay::start(relay_command(
        &db,
        &stream,
        &["--mode", "unordered", "--workers", "16", "--no-cleanup"],
    ));
    drained(&db, &relay, Duration::from_secs(120)).await;
    assert_eq!(stream.count().await, rows as u64);
}

#[tokio::test]
async fn unordered_relay_with_16_workers_drains_a_backlog_past_the_ack_permits() {
    sixteen_workers_drain(10_000).await;
}

#[tokio::test]
#[ignore = "100,000 rows: cargo test --test hardening -- --ignored"]
async fn long_unordered_relay_with_16_workers_drains_100000_rows() {
    sixteen_workers_drain(100_000).await;
}

/// A relay that owns work and gets no ack for `--stall-after` while rows wait (here: its NATS
/// server frozen with SIGSTOP, so the connection stays up and nothing answers) turns `/readyz`
/// to 503, and back to 200 once it publishes again.
#[tokio::test]
async fn a_relay_that_acks_nothing_while_rows_wait_is_not_ready() {
    let nats = NatsServer::start();
    let db = TestDb::new();
    let stream = TestStream::on(&nats.url());
    let addr = format!("127.0.0.1:{}", free_port());
    let relay = Relay::start(relay_command(
        &db,
        &stream,
        &["--metrics-addr", &addr, "--stall-after", "2s"],
    ));
    let t = Duration::from_secs(30);
    insert_rows(&db, 10);
    drained(&db, &relay, t).await;
    wait_until(t, "/readyz 200", || async {
        matches!(http_get(&addr, "/readyz").await, Some((200, _)))
    })
    .await;
    nats.pause();
    insert_rows(&db, 10);
    let frozen = std::time::Instant::now();
    wait_until(t, "/readyz to report the stuck relay", || async {
        matches!(http_get(&addr, "/readyz").await, Some((503, body)) if body.contains("stuck"))
    })
    .await;
    // the last progress is the empty poll just before the relay found the new rows
    assert!(
        frozen.elapsed() >= Duration::from_millis(1800),
        "not ready {:?} after the rows came, before --stall-after (2 s) passed",
        frozen.elapsed()
    );
    nats.resume();
    drained(&db, &relay, t).await;
    wait_until(t, "/readyz 200 again", || async {
        matches!(http_get(&addr, "/readyz").await, Some((200, _)))
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// 5. stream-level rejections are an outage of the stream, not faults of its rows

/// A stream at `max_msgs = 10` with `discard: new` refuses every further message. The relay
/// must treat that as an outage of the stream (backoff, an error metric, not ready), park
/// nothing, count no attempt against any row, and publish everything in order once the limit
/// is raised.
#[tokio::test]
async fn a_full_discard_new_stream_parks_nothing_and_flows_when_its_limit_is_raised() {
    use async_nats::jetstream::stream::{Config, DiscardPolicy};
    let db = TestDb::new();
    let stream = TestStream::new();
    let js = stream.js().await;
    let mut config = Config {
        name: stream.name.clone(),
        subjects: vec![format!("{}.>", stream.prefix)],
        max_messages: 10,
        discard: DiscardPolicy::New,
        ..Default::default()
    };
    js.create_stream(config.clone())
        .await
        .expect("create the stream");
    // 30 rows over 3 aggregates: 10 fit, 20 wait
    diesel::sql_query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || (i % 3), 'order.placed', jsonb_build_object('n', i) \
         FROM generate_series(1, 30) AS i",
    )
    .execute(&mut db.conn())
    .expect("insert rows");
    let addr = format!("127.0.0.1:{}", free_port());
    let relay = Relay::start(relay_command(
        &db,
        &stream,
        &[
            "--metrics-addr",
            &addr,
            "--max-attempts",
            "2",
            "--no-cleanup",
        ],
    ));
    let t = Duration::from_secs(30);
    wait_until(t, "10 messages in the stream", || async {
        stream.count().await == 10
    })
    .await;
    wait_until(t, "/readyz to report the refusing stream", || async {
        matches!(http_get(&addr, "/readyz").await, Some((503, body)) if body.contains("refuses"))
    })
    .await;
    wait_until(t, "the stream_rejected error metric", || async {
        http_get(&addr, "/metrics").await.is_some_and(|(_, body)| {
            body.lines().any(|l| {
                l.starts_with("outbox_publish_errors_total{kind=\"stream_rejected\"}")
                    && !l.ends_with(" 0")
            })
        })
    })
    .await;
    // long enough for --max-attempts 2 to have parked a row many times over
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(parked(&db), 0, "rows parked; log:\n{}", relay.logs());
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox WHERE attempts > 0"),
        0,
        "attempts counted against rows; log:\n{}",
        relay.logs()
    );
    assert_eq!(unpublished(&db), 20);

    config.max_messages = 100;
    js.update_stream(config).await.expect("raise the limit");
    drained(&db, &relay, t).await;
    wait_until(t, "/readyz 200 again", || async {
        matches!(http_get(&addr, "/readyz").await, Some((200, _)))
    })
    .await;
    let got = stream.read_all().await;
    assert_eq!(got.len(), 30);
    // per aggregate, the stream holds the rows in `seq` order (payload n rises with seq)
    let mut last: std::collections::HashMap<String, i64> = Default::default();
    for m in &got {
        let n = m.payload["n"].as_i64().expect("n");
        let prev = last.insert(m.aggregate_id.clone(), n).unwrap_or(0);
        assert!(
            n > prev,
            "{} out of order: {n} after {prev}",
            m.aggregate_id
        );
    }
}
