//! Operating the relay: metrics and health over HTTP, the stall alarm and the dedup-window
//! guard, cleanup under load, the poll's plan, `status`, trace headers, least privilege.
//!
//! Relays run as real `outbox-relay` processes: build them first with
//! `cargo build --workspace --bins`. The 1,000,000-row cleanup run is `#[ignore]`d:
//! `cargo test --test operations -- --ignored`.

mod support;

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::Read as _;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diesel::prelude::*;
use outbox_diesel::{AsyncOutboxExt, EventHeaders, Outbox, OutboxEvent, OutboxExt};
use serde::Serialize;
use support::servers::{NatsServer, nats_server_bin};
use support::{
    Proc, Relay, TestDb, TestStream, free_port, http_get, relay_bin, relay_command,
    relay_with_metrics, wait_until,
};

#[derive(Debug, Clone, Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", event_type = "order.placed")]
struct Placed {
    #[outbox(aggregate_id)]
    order: String,
    n: i64,
}

fn placed(order: impl Into<String>, n: i64) -> Placed {
    Placed {
        order: order.into(),
        n,
    }
}

/// Records `n` events over `aggregates` aggregates, one transaction.
fn record(db: &TestDb, n: usize, aggregates: usize, tag: &str) {
    let events: Vec<Placed> = (0..n)
        .map(|i| placed(format!("{tag}-{}", i % aggregates.max(1)), i as i64))
        .collect();
    db.conn()
        .transaction(|c| c.record_events(&events))
        .expect("record events");
}

fn unpublished(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL")
}

/// The value of the sample `name` (with every label of `labels`) in a Prometheus text body.
fn sample(body: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, rest) = match series.split_once('{') {
                Some((m, rest)) => (m, rest),
                None => (series, ""),
            };
            if metric != name
                || !labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
            {
                return None;
            }
            value.parse().ok()
        })
}

async fn scrape(addr: &str) -> String {
    match http_get(addr, "/metrics").await {
        Some((200, body)) => body,
        _ => String::new(),
    }
}

/// Waits until the scraped `name` satisfies `ok`; returns the body that did.
async fn wait_metric(
    addr: &str,
    name: &str,
    labels: &[(&str, &str)],
    timeout: Duration,
    what: &str,
    ok: impl Fn(f64) -> bool,
) -> String {
    let start = Instant::now();
    loop {
        let body = scrape(addr).await;
        if sample(&body, name, labels).is_some_and(&ok) {
            return body;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}; last {name} = {:?}",
            sample(&body, name, labels)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn status(url: &str, args: &[&str]) -> Output {
    Command::new(relay_bin())
        .env_clear()
        .arg("status")
        .args(["--database-url", url])
        .args(args)
        .output()
        .expect("run outbox-relay status")
}

fn status_json(url: &str, args: &[&str]) -> (i32, serde_json::Value) {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = status(url, &all);
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "status --json printed no JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), json)
}

// ---------------------------------------------------------------------------------------------
// metrics, health, stall alarm

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_the_backlog_rising_while_nats_is_down_and_falling_to_zero_after() {
    let mut nats = NatsServer::start();
    let stream = TestStream::on(&nats.url());
    let db = TestDb::new();
    let (relay, addr) = relay_with_metrics(
        &db,
        &stream,
        &[
            "--partitions",
            "2",
            "--stall-after",
            "2s",
            "--stats-interval",
            "200ms",
        ],
    );
    let t = Duration::from_secs(30);
    wait_until(t, "/readyz to answer 200", || async {
        matches!(http_get(&addr, "/readyz").await, Some((200, _)))
    })
    .await;
    assert_eq!(
        http_get(&addr, "/healthz").await.map(|r| r.0),
        Some(200),
        "/healthz"
    );

    record(&db, 20, 5, "up");
    wait_until(t, "20 rows published", || async { unpublished(&db) == 0 }).await;
    let body = wait_metric(
        &addr,
        "outbox_events_published_total",
        &[],
        t,
        "20 events published",
        |v| v >= 20.0,
    )
    .await;
    assert_eq!(sample(&body, "outbox_partitions_owned", &[]), Some(2.0));
    assert!(sample(&body, "outbox_commit_to_ack_seconds_count", &[]).is_some_and(|v| v >= 20.0));
    assert!(sample(&body, "outbox_batch_rows_count", &[]).is_some_and(|v| v >= 1.0));
    wait_metric(
        &addr,
        "outbox_backlog_rows",
        &[],
        t,
        "an empty backlog",
        |v| v == 0.0,
    )
    .await;
    assert_eq!(
        sample(&scrape(&addr).await, "outbox_nats_connected", &[]),
        Some(1.0)
    );

    // NATS down: /readyz says so, the backlog rises, the stall gauge fires past 2 s
    let down = Instant::now();
    nats.stop();
    wait_until(t, "/readyz to report NATS down", || async {
        matches!(http_get(&addr, "/readyz").await, Some((503, body)) if body.contains("NATS"))
    })
    .await;
    record(&db, 25, 5, "down-a");
    wait_metric(
        &addr,
        "outbox_backlog_rows",
        &[],
        t,
        "a backlog of 25",
        |v| v == 25.0,
    )
    .await;
    record(&db, 25, 5, "down-b");
    let body = wait_metric(
        &addr,
        "outbox_backlog_rows",
        &[],
        t,
        "a backlog of 50",
        |v| v == 50.0,
    )
    .await;
    let per_partition: f64 = ["0", "1"]
        .iter()
        .filter_map(|p| sample(&body, "outbox_partition_backlog_rows", &[("partition", p)]))
        .sum();
    assert_eq!(per_partition, 50.0, "the partitions' backlogs add up");
    assert_eq!(sample(&body, "outbox_nats_connected", &[]), Some(0.0));
    let body = wait_metric(&addr, "outbox_stalled", &[], t, "the stall gauge", |v| {
        v == 1.0
    })
    .await;
    let stalled_after = down.elapsed();
    let age = sample(&body, "outbox_oldest_unpublished_age_seconds", &[]).unwrap_or(0.0);
    assert!(age > 2.0, "stalled with an oldest age of {age}s");
    assert_eq!(sample(&body, "outbox_ready", &[]), Some(0.0));

    // NATS back: the backlog falls to 0, the alarm clears, every event is in the stream once
    let up = Instant::now();
    nats.restart();
    wait_metric(
        &addr,
        "outbox_backlog_rows",
        &[],
        Duration::from_secs(60),
        "the backlog to drain",
        |v| v == 0.0,
    )
    .await;
    let drained = up.elapsed();
    wait_metric(
        &addr,
        "outbox_stalled",
        &[],
        t,
        "the stall gauge to clear",
        |v| v == 0.0,
    )
    .await;
    wait_until(t, "/readyz 200 again", || async {
        matches!(http_get(&addr, "/readyz").await, Some((200, _)))
    })
    .await;
    assert_eq!(stream.count().await, 70);
    let logs = relay.logs();
    assert!(
        logs.contains("stalled"),
        "the stall warning is logged:\n{logs}"
    );
    println!(
        "stall gauge fired {stalled_after:?} after NATS went down (--stall-after 2s); backlog of 50 drained {drained:?} after NATS came back"
    );
}

/// An in-doubt row (a publish was tried: `attempts > 0`) older than the stream's duplicate
/// window fires the guard, and it clears once the row is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_window_guard_covers_in_doubt_rows() {
    dedup_window_guard(&[]).await;
}

/// The same with 4 partitions, whose gauges add up to the table's in one pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_window_guard_covers_in_doubt_rows_of_a_partitioned_table() {
    dedup_window_guard(&["--partitions", "4"]).await;
}

async fn dedup_window_guard(extra: &[&str]) {
    let stream = TestStream::new();
    let db = TestDb::new();
    // parked after 2 failed attempts, recorded a minute ago
    db.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at, \
         attempts, last_error, parked_at) VALUES (gen_random_uuid(), 'order', 'doubt', \
         'order.placed', '{}', now() - interval '1 minute', 2, 'timed out', now())",
        "insert an in-doubt row",
    );
    let mut args = vec!["--duplicate-window", "5s", "--stats-interval", "200ms"];
    args.extend_from_slice(extra);
    let (relay, addr) = relay_with_metrics(&db, &stream, &args);
    let t = Duration::from_secs(30);
    let body = wait_metric(
        &addr,
        "outbox_backlog_beyond_duplicate_window",
        &[],
        t,
        "the dedup-window guard",
        |v| v == 1.0,
    )
    .await;
    assert_eq!(sample(&body, "outbox_in_doubt_rows", &[]), Some(1.0));
    assert!(sample(&body, "outbox_oldest_in_doubt_age_seconds", &[]).is_some_and(|v| v >= 60.0));
    assert_eq!(sample(&body, "outbox_parked_rows", &[]), Some(1.0));
    wait_until(t, "the guard's warning", || async {
        relay
            .logs()
            .contains("in-doubt rows are older than the stream's duplicate window")
    })
    .await;
    // the JSON of `status` carries the same figures
    let (_, json) = status_json(&db.url, &[]);
    assert_eq!(json["backlog"]["in_doubt"], 1);
    assert!(
        json["backlog"]["oldest_in_doubt_age_seconds"]
            .as_f64()
            .is_some_and(|v| v >= 60.0)
    );

    let out = Command::new(relay_bin())
        .args(["retry", "--all", "--database-url", &db.url])
        .output()
        .expect("retry");
    assert!(out.status.success());
    wait_metric(
        &addr,
        "outbox_in_doubt_rows",
        &[],
        t,
        "no in-doubt row",
        |v| v == 0.0,
    )
    .await;
    wait_metric(
        &addr,
        "outbox_backlog_beyond_duplicate_window",
        &[],
        t,
        "the guard to clear",
        |v| v == 0.0,
    )
    .await;
    assert_eq!(stream.count().await, 1);
}

/// The relays of a table read its backlog once per `--stats-interval` between them, not once
/// each (a reading reads every unpublished row): the relay holding the table's statistics lock
/// reads it and sends the figures, every relay reports them, when that relay stops another
/// reads, and while it hangs the others read themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_of_a_table_read_its_backlog_once_between_them_and_each_reports_it() {
    const PARKED: i64 = 3000;
    let stream = TestStream::new();
    let db = TestDb::new();
    // a backlog the relays leave alone: parked rows, one aggregate each
    db.execute(
        &format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, \
             parked_at) SELECT gen_random_uuid(), 'order', 'parked-' || g, 'order.placed', \
             '{{}}', now() FROM generate_series(1, {PARKED}) g"
        ),
        "insert parked rows",
    );
    let interval = Duration::from_millis(300);
    let mut relays: Vec<(Relay, String)> = (0..3)
        .map(|_| {
            relay_with_metrics(
                &db,
                &stream,
                &["--partitions", "4", "--stats-interval", "300ms"],
            )
        })
        .collect();
    let t = Duration::from_secs(30);
    for (_, addr) in &relays {
        let body = wait_metric(addr, "outbox_backlog_rows", &[], t, "the backlog", |v| {
            v == PARKED as f64
        })
        .await;
        assert_eq!(
            sample(&body, "outbox_parked_rows", &[]),
            Some(PARKED as f64)
        );
        let parts: f64 = ["0", "1", "2", "3"]
            .iter()
            .filter_map(|p| sample(&body, "outbox_partition_backlog_rows", &[("partition", p)]))
            .sum();
        assert_eq!(parts, PARKED as f64, "the partitions' backlogs add up");
    }
    let readers = |relays: &[(Relay, String)]| {
        let addrs: Vec<String> = relays.iter().map(|(_, a)| a.clone()).collect();
        async move {
            let mut flags = Vec::new();
            for a in &addrs {
                flags.push(sample(&scrape(a).await, "outbox_statistics_reader", &[]));
            }
            flags
        }
    };

    // rows the relays read in a window of readings: each reading reads every parked row, and
    // nothing else reads the table
    let rows_read = || {
        db.scalar(
            "SELECT COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0) \
             FROM pg_stat_user_tables WHERE relname = 'outbox'",
        )
    };
    let (before, start) = (rows_read(), Instant::now());
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (read, window) = (rows_read() - before, start.elapsed());
    let intervals = window.as_secs_f64() / interval.as_secs_f64();
    let readings = read as f64 / PARKED as f64;
    println!(
        "{read} rows read in {window:?} by 3 relays reading every {interval:?}: {readings:.1} readings of the backlog in {intervals:.1} intervals"
    );
    assert!(
        readings <= 1.5 * intervals + 3.0,
        "3 relays read the backlog {readings:.1} times in {intervals:.1} intervals: each read it"
    );
    assert!(
        readings >= 0.5 * intervals - 3.0,
        "the backlog was read {readings:.1} times in {intervals:.1} intervals"
    );

    wait_until(t, "one reader of the statistics", || async {
        let flags = readers(&relays).await;
        flags.iter().all(Option::is_some) && flags.iter().flatten().sum::<f64>() == 1.0
    })
    .await;

    // rows parked-<from>..=parked-<to> put in doubt; each relay at `addrs` reports `total`
    let in_doubt = |from: i64, to: i64| {
        db.execute(
            &format!(
                "UPDATE outbox SET attempts = 1 WHERE aggregate_id IN \
                 (SELECT 'parked-' || g FROM generate_series({from}, {to}) g)"
            ),
            "rows in doubt",
        );
    };
    let report = |addrs: Vec<String>, total: f64| async move {
        for addr in &addrs {
            wait_metric(
                addr,
                "outbox_in_doubt_rows",
                &[],
                t,
                "the rows in doubt",
                |v| v == total,
            )
            .await;
        }
    };
    let addrs = |relays: &[(Relay, String)]| relays.iter().map(|(_, a)| a.clone()).collect();
    let unix_now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs_f64()
    };
    // when the figures a relay reports were read: after `since` (Unix seconds)
    let read_after = |addr: String, since: f64| async move {
        let at = sample(
            &scrape(&addr).await,
            "outbox_statistics_read_timestamp_seconds",
            &[],
        )
        .expect("the reading's time");
        assert!(
            at >= since - 0.01 && at <= unix_now(),
            "{addr}: figures read at {at}, before {since} or in the future"
        );
    };

    // the figures reach every relay, with when they were read
    let changed = unix_now();
    in_doubt(1, 100);
    report(addrs(&relays), 100.0).await;
    for addr in addrs(&relays) {
        read_after(addr, changed).await;
    }
    // the reader stops: another reads
    let flags = readers(&relays).await;
    let reader = flags
        .iter()
        .position(|f| *f == Some(1.0))
        .expect("a reader");
    let (mut stopped, _) = relays.remove(reader);
    stopped.proc.signal("TERM");
    assert!(
        stopped.proc.wait_exit(t).is_some(),
        "the reader stops on SIGTERM"
    );
    in_doubt(101, 300);
    report(addrs(&relays), 300.0).await;
    wait_until(t, "another reader of the statistics", || async {
        readers(&relays).await.iter().flatten().sum::<f64>() == 1.0
    })
    .await;

    // the reader hangs (its session, and so the lock, lives on): after three intervals of
    // silence the other relay reads the figures itself
    let flags = readers(&relays).await;
    let reader = flags
        .iter()
        .position(|f| *f == Some(1.0))
        .expect("a reader");
    let (hung, _) = &relays[reader];
    let (_, other) = &relays[1 - reader];
    hung.proc.signal("STOP");
    in_doubt(301, 500);
    let silent = Instant::now();
    report(vec![other.clone()], 500.0).await;
    read_after(other.clone(), unix_now() - silent.elapsed().as_secs_f64()).await;
    hung.proc.signal("CONT");
    println!(
        "with the reader stopped, the other relay read the figures itself after {:?}",
        silent.elapsed()
    );
    assert_eq!(
        sample(&scrape(other).await, "outbox_statistics_reader", &[]),
        Some(0.0),
        "the stopped reader kept the lock"
    );
}

// ---------------------------------------------------------------------------------------------
// cleanup and the poll's plan

/// Inserts `n` rows published an hour ago, in one statement.
fn insert_published(db: &TestDb, n: i64) {
    diesel::sql_query(format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at, \
         published_at) SELECT gen_random_uuid(), 'order', 'old-' || (i % 1000), 'order.placed', \
         jsonb_build_object('n', i), now() - interval '61 minutes', now() - interval '1 hour' \
         FROM generate_series(1, {n}) AS i"
    ))
    .execute(&mut db.conn())
    .expect("insert published rows");
}

/// The relay's poll plan, planned as the relay's session plans it.
async fn poll_plan(db: &TestDb, partitions: &[i32], count: u32) -> Vec<String> {
    let mut conn = db.relay_session().await;
    outbox_diesel::relay::explain_poll(
        &mut conn,
        &outbox_diesel::OutboxTable::DEFAULT,
        partitions,
        count,
        500,
    )
    .await
    .expect("explain the poll")
}

fn assert_index_scan(plan: &[String]) {
    let text = plan.join("\n");
    assert!(
        text.contains("Index Scan using outbox_ready"),
        "the poll must scan outbox_ready:\n{text}"
    );
    assert!(
        !text.contains("Seq Scan") && !text.contains("Sort"),
        "the poll must neither scan the table nor sort:\n{text}"
    );
}

async fn cleanup_keeps_the_table_bounded(rows: i64) {
    let stream = TestStream::new();
    let db = TestDb::new();
    let started = Instant::now();
    insert_published(&db, rows);
    println!("inserted {rows} published rows in {:?}", started.elapsed());
    // statistics still call the table empty: the plan must not depend on them
    for (partitions, count) in [(&[0][..], 1), (&[0, 2][..], 4)] {
        let plan = poll_plan(&db, partitions, count).await;
        println!(
            "poll plan ({count} partitions, stale statistics):\n{}",
            plan.join("\n")
        );
        assert_index_scan(&plan);
    }

    // events keep flowing: 20 per transaction, every 20 ms
    let stop = Arc::new(AtomicBool::new(false));
    let recorded = Arc::new(AtomicU64::new(0));
    let writer = {
        let (url, stop, recorded) = (db.url.clone(), stop.clone(), recorded.clone());
        std::thread::spawn(move || {
            let mut conn = PgConnection::establish(&url).expect("writer connects");
            let mut n = 0i64;
            while !stop.load(Ordering::Relaxed) {
                let events: Vec<Placed> = (0..20)
                    .map(|k| placed(format!("new-{}", k % 7), n + k))
                    .collect();
                conn.transaction(|c| c.record_events(&events))
                    .expect("record");
                n += 20;
                recorded.store(n as u64, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let (_relay, addr) = relay_with_metrics(
        &db,
        &stream,
        &[
            "--retention",
            "2s",
            "--cleanup-interval",
            "250ms",
            "--cleanup-batch",
            "5000",
            "--stats-interval",
            "250ms",
        ],
    );
    let swept = Instant::now();
    let timeout = Duration::from_secs(30 + (rows / 10_000) as u64);
    wait_until(timeout, "the old published rows to be deleted", || async {
        db.scalar(
            "SELECT count(*) FROM outbox_audit WHERE published_at < now() - interval '30 minutes'",
        ) == 0
    })
    .await;
    let sweep_took = swept.elapsed();
    let oldest_published_ms = || {
        db.scalar(
            "SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(published_at)) * 1000, 0) \
             FROM outbox_audit WHERE published_at IS NOT NULL",
        )
    };
    // until vacuum has run, the first rounds after a mass delete step over the dead index
    // entries of the deleted rows: they catch up with the rows published meanwhile
    wait_until(
        timeout,
        "cleanup to catch up with the retention",
        || async { oldest_published_ms() < 5_000 },
    )
    .await;
    let caught_up = swept.elapsed();

    // while events flow, the table holds about one retention period of rows
    let mut max_rows = 0;
    let mut max_age = 0;
    let sampling = Instant::now();
    while sampling.elapsed() < Duration::from_secs(4) {
        max_rows = max_rows.max(db.scalar("SELECT count(*) FROM outbox"));
        let oldest = oldest_published_ms();
        max_age = max_age.max(oldest);
        assert!(
            oldest < 10_000,
            "a row published {oldest} ms ago is still there"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NOT NULL") > 0,
        "rows younger than --retention are kept"
    );
    assert!(
        max_rows < 10_000,
        "the table held {max_rows} rows while events flowed"
    );
    let plan = poll_plan(&db, &[0], 1).await;
    assert_index_scan(&plan);

    stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer");
    let total = recorded.load(Ordering::Relaxed);
    wait_until(Duration::from_secs(30), "every event published", || async {
        unpublished(&db) == 0
    })
    .await;
    wait_until(
        Duration::from_secs(30),
        "every event in the stream",
        || async { stream.count().await == total },
    )
    .await;
    let body = wait_metric(
        &addr,
        "outbox_cleanup_rows_deleted_total",
        &[],
        Duration::from_secs(10),
        "the cleanup counter",
        |v| v >= rows as f64,
    )
    .await;
    let latency = sample(&body, "outbox_commit_to_ack_seconds_sum", &[]).unwrap_or(0.0)
        / sample(&body, "outbox_commit_to_ack_seconds_count", &[]).unwrap_or(1.0);
    println!(
        "cleanup removed {rows} published rows in {sweep_took:?} (caught up with the retention after {caught_up:?}) while {total} events flowed; afterwards the table held at most {max_rows} rows, the oldest published row was at most {max_age} ms old (--retention 2s); mean commit-to-ack {:.1} ms",
        latency * 1000.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_keeps_a_table_of_200k_published_rows_bounded_while_events_flow() {
    cleanup_keeps_the_table_bounded(200_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "1,000,000 rows: run with --ignored"]
async fn cleanup_keeps_a_table_of_1m_published_rows_bounded_while_events_flow() {
    cleanup_keeps_the_table_bounded(1_000_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_command_deletes_only_rows_older_than_the_retention_and_cleaners_share_the_work() {
    let db = TestDb::new();
    insert_published(&db, 1000);
    db.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, published_at) \
         SELECT gen_random_uuid(), 'order', 'recent', 'order.placed', '{}', now() \
         FROM generate_series(1, 10)",
        "recent rows",
    );
    record(&db, 5, 1, "pending");
    let cleanup = |args: &[&str]| {
        Command::new(relay_bin())
            .env_clear()
            .arg("cleanup")
            .args(["--database-url", &db.url])
            .args(args)
            .output()
            .expect("run outbox-relay cleanup")
    };
    let out = cleanup(&["--retention", "5m", "--batch", "300"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "deleted 1000 published row(s) older than 5m"
    );
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 15);

    // archive instead of deleting
    db.execute("CREATE TABLE outbox_archive (LIKE outbox)", "archive table");
    let out = cleanup(&["--retention", "0", "--archive-table", "outbox_archive"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("archived 10 "));
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox_archive WHERE aggregate_id = 'recent'"),
        10
    );
    assert_eq!(unpublished(&db), 5);
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 5);

    // concurrent cleaners skip each other's rows: together they delete each row once
    insert_published(&db, 100_000);
    let cleaners: Vec<_> = (0..3)
        .map(|_| {
            let url = db.url.clone();
            std::thread::spawn(move || {
                Command::new(relay_bin())
                    .env_clear()
                    .args(["cleanup", "--database-url", &url, "--batch", "1000"])
                    .output()
                    .expect("cleanup")
            })
        })
        .collect();
    let mut deleted = 0;
    for c in cleaners {
        let out = c.join().expect("cleaner");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        deleted += text
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.parse::<i64>().ok())
            .unwrap_or_else(|| panic!("unexpected output {text:?}"));
    }
    assert_eq!(deleted, 100_000);
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 5);
}

// ---------------------------------------------------------------------------------------------
// status

/// The backend pid of the relay's partition-owning session.
fn relay_pid(db: &TestDb) -> i64 {
    db.scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
         AND application_name = 'outbox-relay' ORDER BY backend_start LIMIT 1",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_matches_the_database_and_its_exit_code_flips_when_the_relay_stalls() {
    let mut nats = NatsServer::start();
    let stream = TestStream::on(&nats.url());
    let db = TestDb::new();
    let _relay = Relay::start(relay_command(&db, &stream, &["--partitions", "4"]));
    let t = Duration::from_secs(30);
    record(&db, 40, 13, "a");
    wait_until(t, "40 rows published", || async { unpublished(&db) == 0 }).await;
    wait_until(t, "4 partitions owned", || async {
        status_json(&db.url, &[]).1["owners"]
            .as_array()
            .map(Vec::len)
            == Some(4)
    })
    .await;
    let pid = relay_pid(&db);
    let (code, json) = status_json(&db.url, &["--stall-after", "1s"]);
    assert_eq!(code, 0, "{json:#}");
    assert_eq!(json["backlog"]["unpublished"], 0);
    assert_eq!(json["stalled"], false);
    assert_eq!(json["partition_count"], 4);
    assert_eq!(json["relays"].as_array().map(Vec::len), Some(1));
    assert_eq!(json["relays"][0]["pid"], pid);
    assert_eq!(json["relays"][0]["partitions"], 4);
    for (i, p) in json["partitions"]
        .as_array()
        .expect("partitions")
        .iter()
        .enumerate()
    {
        assert_eq!(p["partition"], i);
        assert_eq!(p["unpublished"], 0);
        assert_eq!(p["owner_pid"], pid, "{p}");
        assert_eq!(p["owner_application_name"], "outbox-relay");
    }

    // the relay stalls: NATS is gone, rows wait, one is parked, a transaction stays open
    nats.stop();
    record(&db, 30, 11, "b");
    db.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, attempts, \
         last_error, parked_at) VALUES (gen_random_uuid(), 'order', 'poison', 'order.placed', \
         '{}', 5, 'rejected', now())",
        "a parked row",
    );
    let mut idle = db.conn();
    diesel::sql_query("BEGIN")
        .execute(&mut idle)
        .expect("begin");
    #[derive(QueryableByName)]
    struct Pid {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
    }
    let idle_pid = diesel::sql_query("SELECT pg_backend_pid() AS pid, txid_current()")
        .get_result::<Pid>(&mut idle)
        .expect("an open transaction")
        .pid;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let (code, json) = status_json(&db.url, &["--stall-after", "1s"]);
    assert_eq!(
        code, 1,
        "status exits 1 once the oldest row is older than --stall-after"
    );
    assert_eq!(json["stalled"], true);
    assert_eq!(json["stall_after_seconds"], 1.0);
    let b = &json["backlog"];
    assert_eq!(b["unpublished"], unpublished(&db));
    assert_eq!(b["unpublished"], 31);
    assert_eq!(b["parked"], 1);
    assert_eq!(b["in_doubt"], 1);
    let age = db.scalar("SELECT EXTRACT(EPOCH FROM now() - min(created_at)) * 1000 FROM outbox_audit WHERE published_at IS NULL") as f64 / 1000.0;
    let reported = b["oldest_age_seconds"].as_f64().expect("age");
    assert!(
        (reported - age).abs() < 1.0 && reported > 1.0,
        "{reported} vs {age}"
    );
    let mut by_partition: HashMap<i64, i64> = HashMap::new();
    for p in 0..4 {
        by_partition.insert(
            p,
            db.scalar(&format!(
                "SELECT count(*) FROM outbox_audit WHERE published_at IS NULL AND aggregate_hash % 4 = {p}"
            )),
        );
    }
    for p in json["partitions"].as_array().expect("partitions") {
        let i = p["partition"].as_i64().expect("partition");
        assert_eq!(
            p["unpublished"].as_i64(),
            by_partition.get(&i).copied(),
            "{p}"
        );
    }
    let x = &json["oldest_transaction"];
    assert_eq!(x["pid"], idle_pid, "{x}");
    assert_eq!(x["state"], "idle in transaction");
    assert!(x["age_seconds"].as_f64().is_some_and(|a| a >= 1.0), "{x}");
    // the ordered relay marks nothing: 40 row versions made dead by hand, as the statistics
    // count them
    diesel::sql_query(
        "UPDATE outbox SET last_error = NULL WHERE seq IN (SELECT seq FROM outbox ORDER BY seq \
         LIMIT 40)",
    )
    .execute(&mut db.conn())
    .expect("dead row versions");
    wait_until(t, "the dead rows to be counted", || async {
        let (_, json) = status_json(&db.url, &[]);
        let ours = json["table_stats"]["dead_rows"].as_i64().unwrap_or(-1);
        ours >= 40
            && ours
                == db.scalar("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox'")
    })
    .await;
    let text = status(&db.url, &["--stall-after", "1s"]);
    assert_eq!(text.status.code(), Some(1));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("stalled          true"), "{text}");
    assert!(text.contains("idle in transaction"), "{text}");
    drop(idle);

    // NATS back and the parked row released: the exit code flips back
    nats.restart();
    let out = Command::new(relay_bin())
        .args(["retry", "--all", "--database-url", &db.url])
        .output()
        .expect("retry");
    assert!(out.status.success());
    wait_until(
        Duration::from_secs(60),
        "status to exit 0 again",
        || async { status(&db.url, &["--stall-after", "1s"]).status.code() == Some(0) },
    )
    .await;
    assert_eq!(unpublished(&db), 0);
}

// ---------------------------------------------------------------------------------------------
// trace headers

thread_local! {
    /// The application's current trace, as its tracing layer would keep it.
    static CURRENT_TRACE: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn in_trace<T>(traceparent: &str, f: impl FnOnce() -> T) -> T {
    CURRENT_TRACE.with(|t| *t.borrow_mut() = Some(traceparent.to_owned()));
    let out = f();
    CURRENT_TRACE.with(|t| *t.borrow_mut() = None);
    out
}

fn traced_outbox() -> Outbox {
    Outbox::default().headers_from(|| {
        CURRENT_TRACE
            .with(|t| t.borrow().clone())
            .map(EventHeaders::traceparent)
            .unwrap_or_default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_set_around_a_recording_arrives_as_a_nats_header() {
    const TRACE_A: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    const TRACE_C: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    const TRACE_D: &str = "00-11111111111111111111111111111111-2222222222222222-00";
    let stream = TestStream::new();
    let db = TestDb::new();
    let outbox = traced_outbox();
    let mut conn = db.conn();
    // A: inside the trace; B: outside it; C: inside, with its own headers over the hook's
    in_trace(TRACE_A, || {
        conn.transaction(|c| outbox.record(c, &placed("a", 1)))
    })
    .expect("record A");
    conn.transaction(|c| outbox.record(c, &placed("b", 2)))
        .expect("record B");
    in_trace(TRACE_A, || {
        conn.transaction(|c| {
            outbox.record_with_headers(
                c,
                &placed("c", 3),
                &EventHeaders::traceparent(TRACE_C).with("tenant", "acme"),
            )
        })
    })
    .expect("record C");
    // D: async, through the extension trait
    {
        use diesel_async::AsyncConnection;
        let mut conn = db.async_conn().await;
        conn.transaction(async |c| {
            c.record_event_with_headers(&placed("d", 4), &EventHeaders::traceparent(TRACE_D))
                .await
        })
        .await
        .expect("record D");
    }
    // a header that would override the relay's own is refused, and nothing is written
    let refused = conn.transaction(|c| {
        c.record_event_with_headers(
            &placed("e", 5),
            &EventHeaders::new().with("Nats-Msg-Id", "x"),
        )
    });
    assert!(matches!(
        refused,
        Err(diesel::result::Error::SerializationError(_))
    ));
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 4);

    let _relay = Relay::start(relay_command(&db, &stream, &[]));
    wait_until(
        Duration::from_secs(30),
        "4 events in the stream",
        || async { stream.count().await == 4 },
    )
    .await;
    let msgs = stream.read_all().await;
    let header = |agg: &str, name: &str| {
        msgs.iter()
            .find(|m| m.aggregate_id == agg)
            .and_then(|m| m.headers.get(name).map(|v| v.as_str().to_owned()))
    };
    assert_eq!(header("a", "traceparent").as_deref(), Some(TRACE_A));
    assert_eq!(header("b", "traceparent"), None);
    assert_eq!(header("c", "traceparent").as_deref(), Some(TRACE_C));
    assert_eq!(header("c", "tenant").as_deref(), Some("acme"));
    assert_eq!(header("d", "traceparent").as_deref(), Some(TRACE_D));
}

// ---------------------------------------------------------------------------------------------
// least privilege

/// A login role of its own, dropped on `Drop` (after the test database that holds its grants).
struct Role {
    name: String,
}

impl Drop for Role {
    fn drop(&mut self) {
        if let Ok(mut admin) = PgConnection::establish(&format!("{}/postgres", support::pg_base()))
        {
            let _ =
                diesel::sql_query(format!("DROP ROLE IF EXISTS {}", self.name)).execute(&mut admin);
        }
    }
}

/// A private `nats-server -js` that requires a user and password.
fn nats_with_password(user: &str, password: &str) -> (Proc, u16, std::path::PathBuf) {
    private_nats(&["--user", user, "--pass", password])
}

/// A private `nats-server -js` with `auth` (`--user`/`--pass`, `--auth TOKEN`).
fn private_nats(auth: &[&str]) -> (Proc, u16, std::path::PathBuf) {
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("outbox-nats-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).expect("nats dir");
    let proc = Proc::spawn(
        "nats-server",
        Command::new(nats_server_bin())
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(&dir)
            .args(auth)
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "nats-server did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (proc, port, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_runs_with_the_readme_grants_and_leaks_no_password() {
    let id = uuid::Uuid::now_v7().simple().to_string();
    let role = Role {
        name: format!("outbox_relay_{}", &id[20..]),
    };
    let db_password = format!("pg-secret-{id}");
    let nats_password = format!("nats-secret-{id}");
    let db = TestDb::new();
    {
        let mut admin = db.conn();
        for sql in [
            format!("CREATE ROLE {} LOGIN PASSWORD '{db_password}'", role.name),
            format!("GRANT USAGE ON SCHEMA public TO {}", role.name),
            format!("GRANT SELECT, UPDATE, DELETE ON outbox TO {}", role.name),
            format!(
                "GRANT SELECT, INSERT, DELETE ON outbox_progress TO {}",
                role.name
            ),
        ] {
            diesel::sql_query(sql)
                .execute(&mut admin)
                .expect("set up the role");
        }
    }
    assert_eq!(
        db.scalar(&format!(
            "SELECT has_table_privilege('{}', 'outbox', 'INSERT')::int",
            role.name
        )),
        0
    );
    let role_url = format!(
        "postgres://{}:{db_password}@127.0.0.1:5432/{}",
        role.name, db.name
    );
    let base = support::pg_base();
    let role_url = if base.ends_with("127.0.0.1:5432") {
        role_url
    } else {
        // another server: keep its host and port
        let host = base.rsplit('@').next().unwrap_or("127.0.0.1:5432");
        format!("postgres://{}:{db_password}@{host}/{}", role.name, db.name)
    };
    let (_nats, port, nats_dir) = nats_with_password("relay", &nats_password);
    // the stream is read with the credentials (the private server goes with its streams)
    let stream = TestStream::on(&format!("nats://127.0.0.1:{port}"));
    let js = async_nats::jetstream::new(
        async_nats::ConnectOptions::with_user_and_password("relay".into(), nats_password.clone())
            .connect(&stream.nats_url)
            .await
            .expect("connect to the private NATS"),
    );
    let addr = format!("127.0.0.1:{}", free_port());
    let mut cmd = relay_command(
        &db,
        &stream,
        &[
            "--nats-user",
            "relay",
            "--nats-password",
            &nats_password,
            "--metrics-addr",
            &addr,
            "--retention",
            "0s",
            "--cleanup-interval",
            "200ms",
            "--stats-interval",
            "200ms",
        ],
    );
    cmd.env("DATABASE_URL", &role_url)
        .env("NATS_URL", format!("nats://127.0.0.1:{port}"))
        .env("RUST_LOG", "debug");
    let mut relay = Relay::start(cmd);

    record(&db, 20, 4, "lp");
    let t = Duration::from_secs(30);
    wait_until(t, "20 events in the stream", || async {
        match js.get_stream(&stream.name).await {
            Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0) == 20,
            Err(_) => false,
        }
    })
    .await;
    wait_until(t, "the published rows deleted by the role", || async {
        db.scalar("SELECT count(*) FROM outbox") == 0
    })
    .await;
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
             AND usename = '{}'",
            role.name
        )),
        1,
        "the relay runs as the role"
    );

    let metrics = wait_metric(
        &addr,
        "outbox_cleanup_rows_deleted_total",
        &[],
        t,
        "the cleanup counter",
        |v| v >= 20.0,
    )
    .await;
    let readyz = http_get(&addr, "/readyz").await.expect("/readyz");
    assert_eq!(readyz.0, 200, "{}", readyz.1);
    // a second relay takes the NATS credentials from its URL, and stands by
    let addr2 = format!("127.0.0.1:{}", free_port());
    let mut cmd = relay_command(&db, &stream, &["--metrics-addr", &addr2]);
    cmd.env("DATABASE_URL", &role_url)
        .env(
            "NATS_URL",
            format!("nats://relay:{nats_password}@127.0.0.1:{port}"),
        )
        .env("RUST_LOG", "debug");
    let mut standby = Relay::start(cmd);
    wait_until(t, "the standby's /readyz", || async {
        matches!(http_get(&addr2, "/readyz").await, Some((200, _)))
    })
    .await;
    let standby_metrics = scrape(&addr2).await;
    standby.proc.signal("TERM");
    assert_eq!(standby.proc.wait_exit(Duration::from_secs(20)), Some(0));
    let standby_logs = standby.logs();
    assert!(standby_logs.contains("relay:***@"), "{standby_logs}");
    let outputs = [
        status(&role_url, &[]),
        status(&role_url, &["--json"]),
        // a failing connection prints the URL, without its password
        status(
            &format!(
                "postgres://{}:{db_password}@127.0.0.1:1/{}",
                role.name, db.name
            ),
            &[],
        ),
    ];
    assert!(
        outputs[0].status.success(),
        "{}",
        String::from_utf8_lossy(&outputs[0].stderr)
    );
    let failed = String::from_utf8_lossy(&outputs[2].stderr).into_owned();
    assert!(failed.contains(&format!("{}:***@", role.name)), "{failed}");

    relay.proc.signal("TERM");
    assert_eq!(relay.proc.wait_exit(Duration::from_secs(20)), Some(0));
    let logs = relay.logs();
    assert!(
        logs.contains("outbox relay started"),
        "the logs were captured:\n{logs}"
    );
    assert!(
        logs.contains(":***@"),
        "the database URL is logged redacted:\n{logs}"
    );
    let mut places = vec![
        ("the relay's logs", logs),
        ("/metrics", metrics),
        ("the standby's logs", standby_logs),
        ("the standby's /metrics", standby_metrics),
    ];
    for out in &outputs {
        places.push((
            "status stdout",
            String::from_utf8_lossy(&out.stdout).into_owned(),
        ));
        places.push((
            "status stderr",
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    for (place, text) in &places {
        for secret in [&db_password, &nats_password] {
            assert!(
                !text.contains(secret.as_str()),
                "{place} shows a password:\n{text}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(nats_dir);
}

// ---------------------------------------------------------------------------------------------
// deploy/: the dashboard and the alerts query what the relay exports

/// The `outbox_*` metric names that a file in deploy/ queries, histogram series
/// (`_bucket`, `_sum`, `_count`) named by their histogram.
fn queried_metrics(file: &str) -> std::collections::BTreeSet<String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("outbox_") {
        let tail = &rest[at..];
        let len = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..len];
        let preceded = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !preceded {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            names.insert(base.to_owned());
        }
        rest = &tail[len..];
    }
    names
}

/// The metric names in a Prometheus text body.
fn exported_metrics(body: &str) -> std::collections::BTreeSet<String> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(|name| {
            ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name)
                .to_owned()
        })
        .collect()
}

/// Every metric that deploy/grafana-dashboard.json and deploy/prometheus-alerts.yml query is
/// one that a relay exports: an ordered relay with partitions, cleanup and a parked row, and a
/// log-tailing relay that deletes captured rows.
#[tokio::test]
async fn the_dashboard_and_the_alerts_query_only_metrics_the_relay_exports() {
    let mut queried = queried_metrics("deploy/grafana-dashboard.json");
    let alerts = queried_metrics("deploy/prometheus-alerts.yml");
    assert!(
        queried.len() >= 20 && !alerts.is_empty(),
        "the files were read: {queried:?} {alerts:?}"
    );
    queried.extend(alerts);
    let t = Duration::from_secs(30);

    // ordered, two partitions, cleanup, and a row over NATS's max payload (parked at once)
    let (db, stream) = (TestDb::new(), TestStream::new());
    let (ordered, addr) = relay_with_metrics(
        &db,
        &stream,
        &[
            "--partitions",
            "2",
            "--stats-interval",
            "200ms",
            "--retention",
            "0s",
            "--cleanup-interval",
            "200ms",
        ],
    );
    record(&db, 20, 4, "dash");
    db.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'order', 'too-big', 'order.placed', \
         to_jsonb(repeat('x', 2 * 1024 * 1024)))",
        "an oversized row",
    );
    wait_metric(
        &addr,
        "outbox_cleanup_rows_deleted_total",
        &[],
        t,
        "cleanup",
        |v| v >= 20.0,
    )
    .await;
    let mut exported = exported_metrics(
        &wait_metric(&addr, "outbox_parked_rows", &[], t, "the parked row", |v| {
            v >= 1.0
        })
        .await,
    );
    drop(ordered);

    // log tailing, deleting what it captured
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = support::slot::Slot::new(&db);
    let (tailing, addr) = relay_with_metrics(
        &db,
        &stream,
        &[
            "--mode",
            "log-tailing",
            "--slot",
            &slot.name,
            "--stats-interval",
            "200ms",
            "--captured-retention",
            "0s",
            "--captured-cleanup-interval",
            "200ms",
        ],
    );
    wait_metric(
        &addr,
        "outbox_slot_reader",
        &[],
        t,
        "the slot's reader",
        |v| v == 1.0,
    )
    .await;
    wait_until(t, "the reader streaming the slot", || async {
        slot.streaming(&db)
    })
    .await;
    record(&db, 20, 4, "dash");
    exported.extend(exported_metrics(
        &wait_metric(
            &addr,
            "outbox_captured_rows_deleted_total",
            &[],
            t,
            "captured rows deleted",
            |v| v >= 20.0,
        )
        .await,
    ));
    drop(tailing);

    let missing: Vec<&String> = queried.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "deploy/ queries metrics no relay exported: {missing:?}\nexported: {exported:?}"
    );
}

/// The PostgreSQL server of the tests as libpq's `key=value` pairs for `database`, with
/// `extra` pairs appended.
fn key_value_url(database: &str, extra: &str) -> String {
    let base = support::pg_base();
    let rest = base.split_once("://").map_or(base.as_str(), |(_, r)| r);
    let (user, host) = rest.split_once('@').unwrap_or(("postgres", rest));
    let user = user.split(':').next().unwrap_or(user);
    let (host, port) = host.split_once(':').unwrap_or((host, "5432"));
    format!("host={host} port={port} user={user} dbname={database} {extra}")
}

/// Runs `cmd` to its exit (within 20 s); exit code and everything it printed.
fn output_of(cmd: &mut Command) -> (Option<i32>, String) {
    let mut p = Proc::spawn(
        "outbox-relay",
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()),
    );
    let code = p.wait_exit(Duration::from_secs(20));
    p.kill();
    let mut text = String::new();
    for pipe in [
        p.child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read>),
        p.child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read>),
    ]
    .into_iter()
    .flatten()
    {
        let mut pipe = pipe;
        let _ = pipe.read_to_string(&mut text);
    }
    (code, text)
}

/// Issue 15, item 7: a password in libpq's `key=value` form or in a URL's query, and a NATS
/// token (in the URL or in `NATS_TOKEN`), appear in no log line (at debug level), no error,
/// no `status` output, no `/metrics` and no `Debug` output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_in_key_value_urls_query_parameters_and_nats_tokens_reach_no_output() {
    let id = uuid::Uuid::now_v7().simple().to_string();
    let secret = format!("Xsecret{}", &id[16..]);
    let token = format!("Xtoken{}", &id[16..]);
    let db = TestDb::new();
    let (_nats, port, nats_dir) = private_nats(&["--auth", &token]);
    let stream = TestStream::on(&format!("nats://{token}@127.0.0.1:{port}"));
    let js = async_nats::jetstream::new(
        async_nats::ConnectOptions::with_token(token.clone())
            .connect(format!("nats://127.0.0.1:{port}"))
            .await
            .expect("connect to the private NATS"),
    );
    // the test server trusts local connections, so any password opens the database
    let key_value = key_value_url(&db.name, &format!("password='{secret}' sslmode=disable"));
    let in_query = format!("{}?password={secret}", db.url);
    let mut places: Vec<(String, String)> = Vec::new();

    // a relay with the password in key=value form and the token in the URL, and a standby
    // with the password in the query and the token in NATS_TOKEN
    let addr = format!("127.0.0.1:{}", free_port());
    let mut cmd = relay_command(&db, &stream, &["--metrics-addr", &addr]);
    cmd.env("DATABASE_URL", &key_value).env("RUST_LOG", "debug");
    let mut relay = Relay::start(cmd);
    let addr2 = format!("127.0.0.1:{}", free_port());
    let mut cmd = relay_command(&db, &stream, &["--metrics-addr", &addr2]);
    cmd.env("DATABASE_URL", &in_query)
        .env("NATS_URL", format!("nats://127.0.0.1:{port}"))
        .env("NATS_TOKEN", &token)
        .env("RUST_LOG", "debug");
    let mut standby = Relay::start(cmd);
    record(&db, 10, 2, "sec");
    let t = Duration::from_secs(30);
    wait_until(t, "10 events in the stream", || async {
        match js.get_stream(&stream.name).await {
            Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0) == 10,
            Err(_) => false,
        }
    })
    .await;
    for a in [&addr, &addr2] {
        wait_until(t, "/readyz", || async {
            matches!(http_get(a, "/readyz").await, Some((200, _)))
        })
        .await;
        places.push((format!("/metrics of {a}"), scrape(a).await));
    }
    for (url, what) in [(&key_value, "key=value"), (&in_query, "query")] {
        for args in [&[][..], &["--json"][..]] {
            let out = status(url, args);
            assert!(out.status.success(), "status with the {what} URL: {out:?}");
            places.push((
                format!("status {args:?} with the {what} URL"),
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            ));
        }
    }
    for r in [&mut relay, &mut standby] {
        r.proc.signal("TERM");
        assert_eq!(r.proc.wait_exit(Duration::from_secs(20)), Some(0));
    }
    let logs = relay.logs();
    assert!(
        logs.contains("password=***") && logs.contains("nats://***@127.0.0.1"),
        "the settings are logged, redacted:\n{logs}"
    );
    places.push(("the relay's logs".into(), logs));
    places.push(("the standby's logs".into(), standby.logs()));

    // failures: a refused connection, a database that does not exist, a refused token
    let dead = format!("host=127.0.0.1 port={} password={secret}", free_port());
    let missing = key_value_url("no_such_database", &format!("password={secret}"));
    for (url, args) in [
        (&dead, &["--startup-timeout", "1s"][..]),
        (&missing, &[][..]),
    ] {
        let mut cmd = relay_command(&db, &stream, args);
        cmd.env("DATABASE_URL", url).env("RUST_LOG", "debug");
        places.push((
            format!("the relay failing on {url:.20}"),
            output_of(&mut cmd).1,
        ));
        places.push((
            format!("status failing on {url:.20}"),
            format!("{:?}", status(url, &[])),
        ));
    }
    let mut cmd = relay_command(&db, &stream, &[]);
    cmd.env("NATS_URL", format!("nats://{token}wrong@127.0.0.1:{port}"))
        .env("RUST_LOG", "debug");
    let (code, text) = output_of(&mut cmd);
    assert_eq!(code, Some(2), "a refused token fails at once: {text}");
    places.push(("the relay with a refused token".into(), text));

    // Debug output of every type that holds a setting, and of the errors
    let relay_config = outbox_nats::RelayConfig::new(key_value.clone());
    places.push((
        "RelayConfig (key=value)".into(),
        format!("{relay_config:?}"),
    ));
    places.push((
        "RelayConfig (query)".into(),
        format!("{:?}", outbox_nats::RelayConfig::new(in_query.clone())),
    ));
    places.push((
        "ConsumerConfig".into(),
        format!(
            "{:?}",
            outbox_nats::ConsumerConfig::new("c", format!("postgres://u:{secret}@h/db"))
        ),
    ));
    let reader = outbox_diesel::wal::WalReader::new(
        outbox_diesel::OutboxTable::DEFAULT,
        "outbox_slot",
        "outbox_pub",
    )
    .streaming(&key_value, Duration::from_millis(100))
    .expect("a streaming reader");
    places.push(("WalReader".into(), format!("{reader:?}")));
    let mut nats = outbox_nats::NatsOptions::new(format!("nats://{token}@127.0.0.1:{port}"));
    nats.token = Some(token.clone());
    places.push(("NatsOptions".into(), format!("{nats:?}")));
    for url in [&dead, &missing] {
        let e = outbox_diesel::connect(url).await.err().expect("refused");
        places.push(("outbox_diesel::ConnectError".into(), format!("{e} {e:?}")));
    }
    let nats_client = async_nats::ConnectOptions::with_token(token.clone())
        .connect(format!("nats://127.0.0.1:{port}"))
        .await
        .expect("connect");
    let refused = outbox_nats::Relay::new(
        relay_config
            .startup_timeout(Duration::from_secs(1))
            .table("no_such_table".parse().expect("a table name")),
        nats_client,
    );
    places.push(("Relay".into(), format!("{refused:?}")));
    let e = refused
        .run(tokio_util::sync::CancellationToken::new())
        .await
        .expect_err("no such table");
    places.push(("RelayError".into(), format!("{e} {e:?}")));

    for (place, text) in &places {
        for s in [&secret, &token] {
            assert!(
                !text.contains(s.as_str()),
                "{place} shows a secret:\n{text}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(nats_dir);
}
