//! Publishing: ack permits and acks that do not come, stream-level rejections, subjects and
//! payloads at the server's limits, and the byte budget.

use super::*;

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
    let (relay, addr) = relay_with_metrics(&db, &stream, &["--stall-after", "2s"]);
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

/// Acks that do not come (the NATS server frozen past the 5 s ack timeout, the connection
/// up) fail their publishes as timed out: counted, retried once the server answers again, and
/// every row is in the stream once, in its aggregate's order, though the frozen server took
/// the first copies and stores them when it resumes.
#[tokio::test]
async fn acks_that_do_not_come_time_out_and_their_rows_are_sent_again_once_in_order() {
    let nats = NatsServer::start();
    let db = TestDb::new();
    let stream = TestStream::on(&nats.url());
    let (relay, addr) = relay_with_metrics(&db, &stream, &["--no-cleanup"]);
    let t = Duration::from_secs(40);
    insert_rows_over(&db, 10, 3);
    drained(&db, &relay, t).await;
    nats.pause();
    insert_rows_over(&db, 30, 3);
    wait_until(t, "the timed-out publishes counted", || async {
        http_get(&addr, "/metrics").await.is_some_and(|(_, body)| {
            body.lines().any(|l| {
                l.starts_with("outbox_publish_errors_total{kind=\"timeout\"}") && !l.ends_with(" 0")
            })
        })
    })
    .await;
    assert_eq!(unpublished(&db), 30, "rows recorded without their acks");
    nats.resume();
    drained(&db, &relay, t).await;
    let msgs = stream.read_all().await;
    assert_eq!(msgs.len(), 40, "each row once in the stream");
    let expected: HashMap<String, Vec<String>> = db
        .strings(
            "SELECT aggregate_id || ' ' || string_agg(id::text, ',' ORDER BY seq) \
             FROM outbox GROUP BY aggregate_id",
        )
        .into_iter()
        .filter_map(|l| {
            let (agg, ids) = l.split_once(' ')?;
            Some((agg.to_owned(), ids.split(',').map(str::to_owned).collect()))
        })
        .collect();
    assert_eq!(
        by_aggregate(&msgs),
        expected,
        "each aggregate in commit order"
    );
}

/// Every session of the relay has JIT off, its start-up checks' too: their statements (the
/// backlog's above all) are estimated far above `jit_above_cost`, and compiling them held the
/// first publish back by most of a second. Here every statement of a session with JIT on is
/// compiled at the highest cost, and the database's time spent in statements
/// (`pg_stat_database.active_time`) over a relay's start, first publish and stop tells
/// whether any session compiled its statements: about 500 ms when the start-up checks did,
/// tens of milliseconds when none does.
#[tokio::test]
async fn the_relay_compiles_no_statement_before_it_publishes() {
    let db = TestDb::new();
    assert_eq!(
        db.scalar("SELECT pg_jit_available()::int"),
        1,
        "this PostgreSQL has no JIT: the test needs it (Debian's packages have it)"
    );
    for cost in [
        "jit_above_cost",
        "jit_inline_above_cost",
        "jit_optimize_above_cost",
    ] {
        db.execute(
            &format!("ALTER DATABASE {} SET {cost} = 0", db.name),
            "force JIT",
        );
    }
    insert_rows(&db, 1);
    // sessions report their statistics when they end; this one's own are read without JIT
    let active_ms = || {
        #[derive(QueryableByName)]
        struct Ms {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            ms: i64,
        }
        let mut conn = db.conn();
        diesel::sql_query("SET jit = off")
            .execute(&mut conn)
            .expect("jit off");
        diesel::sql_query(
            "SELECT active_time::int8 AS ms FROM pg_stat_database WHERE datname = current_database()",
        )
        .get_result::<Ms>(&mut conn)
        .expect("active time")
        .ms
    };
    let before = active_ms();
    let stream = TestStream::new();
    let relay = Relay::start(relay_command(&db, &stream, &["--no-cleanup"]));
    wait_until(Duration::from_secs(20), "the row published", || async {
        stream.count().await == 1
    })
    .await;
    drop(relay);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let spent = active_ms() - before;
    assert!(
        spent < 250,
        "the relay's sessions spent {spent} ms in statements: one compiled them (JIT on)"
    );
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
        max_messages: 10,
        discard: DiscardPolicy::New,
        ..stream.config()
    };
    js.create_stream(config.clone())
        .await
        .expect("create the stream");
    // 30 rows over 3 aggregates: 10 fit, 20 wait
    db.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || (i % 3), 'order.placed', jsonb_build_object('n', i) \
         FROM generate_series(1, 30) AS i",
        "insert rows",
    );
    let (relay, addr) = relay_with_metrics(&db, &stream, &["--max-attempts", "2", "--no-cleanup"]);
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

// ---------------------------------------------------------------------------------------------
// 6. long aggregate ids: a subject past the server's control-line limit closes the connection

#[derive(Debug, Clone, serde::Serialize, outbox_diesel::OutboxEvent)]
#[outbox(aggregate_type = "order", event_type = "order.placed")]
struct Placed {
    #[outbox(aggregate_id)]
    order: String,
    n: i64,
}

/// An aggregate id of 1,500 `é` is 9,000 bytes percent-encoded, past the 4 KiB control line of
/// a default nats-server: `record_event` refuses it, naming the bound; an id at the bound is
/// accepted and published.
#[tokio::test]
async fn a_subject_past_the_documented_bound_is_refused_at_record_time_and_one_at_it_publishes() {
    use outbox_diesel::{InvalidEvent, MAX_SUBJECT_NAMES_LEN, OutboxExt};
    let db = TestDb::new();
    let stream = TestStream::new();
    let mut conn = db.conn();
    let long = Placed {
        order: "é".repeat(1500),
        n: 1,
    };
    let err = conn
        .transaction(|c| c.record_event(&long))
        .expect_err("a 9,000-byte subject is refused");
    let diesel::result::Error::SerializationError(inner) = &err else {
        panic!("not a refusal: {err}");
    };
    let invalid = inner
        .downcast_ref::<InvalidEvent>()
        .expect("an InvalidEvent");
    let text = format!(
        "{invalid} {}",
        std::error::Error::source(invalid)
            .map(|s| s.to_string())
            .unwrap_or_default()
    );
    assert!(text.contains("2048"), "{text}");
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 0);

    // "order" (5) + "order.placed" (12) + the id: exactly the bound
    let at_bound = Placed {
        order: "x".repeat(MAX_SUBJECT_NAMES_LEN - 17),
        n: 2,
    };
    conn.transaction(|c| c.record_event(&at_bound))
        .expect("an id at the bound is accepted");
    let relay = Relay::start(relay_command(&db, &stream, &["--no-cleanup"]));
    drained(&db, &relay, Duration::from_secs(30)).await;
    let got = stream.read_all().await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].aggregate_id, at_bound.order);
}

/// A row written around the library (plain SQL) with that id is parked with a clear error,
/// instead of closing the connection on every retry; the aggregate after it flows.
#[tokio::test]
async fn a_row_whose_subject_is_too_long_is_parked_not_retried_forever() {
    let db = TestDb::new();
    let stream = TestStream::new();
    db.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES \
         (gen_random_uuid(), 'order', repeat('é', 1500), 'order.placed', '{\"n\": 1}'), \
         (gen_random_uuid(), 'order', 'short', 'order.placed', '{\"n\": 2}')",
        "insert rows",
    );
    let relay = Relay::start(relay_command(&db, &stream, &["--no-cleanup"]));
    let t = Duration::from_secs(30);
    let start = std::time::Instant::now();
    while parked(&db) == 0 || stream.count().await < 1 {
        assert!(
            start.elapsed() < t,
            "the long row was not parked (parked {}, in stream {}); relay log:\n{}",
            parked(&db),
            stream.count().await,
            relay.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    #[derive(QueryableByName)]
    struct E {
        #[diesel(sql_type = diesel::sql_types::Text)]
        last_error: String,
    }
    let e: E = diesel::sql_query("SELECT last_error FROM outbox WHERE parked_at IS NOT NULL")
        .get_result(&mut db.conn())
        .expect("the parked row's error");
    assert!(e.last_error.contains("subject"), "{}", e.last_error);
    let got = stream.read_all().await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].aggregate_id, "short");
}

// ---------------------------------------------------------------------------------------------
// 4. the payload limit measures what is sent: jsonb's rendering and the headers

#[derive(Debug, Clone, serde::Serialize, outbox_diesel::OutboxEvent)]
#[outbox(aggregate_type = "series", event_type = "series.sampled")]
struct Sampled {
    #[outbox(aggregate_id)]
    id: String,
    values: Vec<u8>,
    note: String,
}

fn refusal(err: &diesel::result::Error) -> &outbox_diesel::InvalidEvent {
    let diesel::result::Error::SerializationError(inner) = err else {
        panic!("not a refusal: {err}");
    };
    inner
        .downcast_ref::<outbox_diesel::InvalidEvent>()
        .expect("an InvalidEvent")
}

/// 400,000 one-digit integers are 800,001 bytes of compact JSON, under the 1 MiB limit, but
/// 1,200,000 bytes as jsonb renders them (`[1, 1, ...]`): refused at record time. An event
/// whose rendering plus headers is exactly the limit is accepted and published by a server
/// with the default `max_payload`.
#[tokio::test]
async fn an_event_accepted_at_record_time_fits_the_servers_max_payload() {
    use outbox_diesel::{DEFAULT_MAX_PAYLOAD, EventHeaders, message_size};
    let db = TestDb::new();
    let stream = TestStream::new();
    let mut conn = db.conn();
    let digits = Sampled {
        id: "s-1".into(),
        values: vec![1; 400_000],
        note: String::new(),
    };
    let err = conn
        .transaction(|c| c.record_event(&digits))
        .expect_err("1,200,000 bytes rendered is over 1 MiB");
    assert!(refusal(&err).is_too_large(), "{err}");
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 0);

    // a note that brings the message to the limit exactly, then one byte over it
    let mut at_limit = Sampled {
        id: "s-2".into(),
        values: vec![7; 1000],
        note: String::new(),
    };
    let empty = outbox_diesel::jsonb_text(&at_limit).expect("render").len();
    let base = message_size(
        empty,
        "series",
        "s-2",
        "series.sampled",
        &EventHeaders::new(),
    );
    at_limit.note = "n".repeat(DEFAULT_MAX_PAYLOAD - base);
    let mut over = at_limit.clone();
    over.note.push('n');
    let err = conn
        .transaction(|c| c.record_event(&over))
        .expect_err("one byte over the limit");
    assert!(refusal(&err).is_too_large(), "{err}");
    conn.transaction(|c| c.record_event(&at_limit))
        .expect("exactly at the limit");

    let relay = Relay::start(relay_command(&db, &stream, &["--no-cleanup"]));
    drained(&db, &relay, Duration::from_secs(30)).await;
    assert_eq!(parked(&db), 0, "log:\n{}", relay.logs());
    let got = stream.read_all().await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].aggregate_id, "s-2");
}

// ---------------------------------------------------------------------------------------------
// 11. byte-bounded batches: a batch of 500 rows of large payloads is hundreds of MiB

/// `n` rows of 900 KB payloads (one per aggregate), recorded by plain SQL.
fn insert_large_rows(db: &TestDb, n: u32) {
    diesel::sql_query(format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'blob', 'b-' || i, 'blob.stored', \
         jsonb_build_object('n', i, 'data', repeat(md5(i::text), 28125)) \
         FROM generate_series(1, {n}) AS i"
    ))
    .execute(&mut db.conn())
    .expect("insert rows");
}

/// 40 rows of 900 KB payloads (36 MB) drained by a relay with a 1 MiB budget: it peaks far
/// below what one 40-row batch takes (about 92 MiB without a budget), in both polling modes.
async fn large_payloads_stay_within_the_budget(mode: &str) -> u64 {
    let db = TestDb::new();
    let stream = TestStream::new();
    insert_large_rows(&db, 100);
    let mut cmd = relay_command(&db, &stream, &["--mode", mode, "--no-cleanup"]);
    // an environment variable, so that a relay without the flag runs too (and shows the peak)
    cmd.env("OUTBOX_MAX_BATCH_BYTES", (1u64 << 20).to_string());
    let relay = Relay::start(cmd);
    let mut peak = 0;
    let start = std::time::Instant::now();
    while unpublished(&db) > 0 {
        peak = peak.max(relay.proc.peak_rss());
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "not drained; log:\n{}",
            relay.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    peak = peak.max(relay.proc.peak_rss());
    assert_eq!(stream.count().await, 100);
    assert_eq!(parked(&db), 0, "log:\n{}", relay.logs());
    peak
}

#[tokio::test]
async fn an_ordered_relay_holds_large_payloads_within_its_byte_budget() {
    let peak = large_payloads_stay_within_the_budget("ordered").await;
    println!("ordered relay peak RSS: {:.1} MiB", peak as f64 / 1048576.0);
    // 30-58 MiB seen (the allocator's caches vary with the server's pace); 170 MiB without
    // the budget
    assert!(peak < 80 << 20, "peak RSS {peak} bytes");
}

#[tokio::test]
async fn unordered_workers_hold_large_payloads_within_their_byte_budget() {
    let peak = large_payloads_stay_within_the_budget("unordered").await;
    println!(
        "unordered relay peak RSS: {:.1} MiB",
        peak as f64 / 1048576.0
    );
    // four workers, each with two batches, four connections and their allocator caches
    // (55-66 MiB seen; 185 MiB without the budget)
    assert!(peak < 96 << 20, "peak RSS {peak} bytes");
}

/// Acks that do not come must not let the relay pile messages up in memory: the publishes in
/// flight stay within `--max-batch-bytes` too, not only the batches read (`--max-in-flight`,
/// 512, counts messages, and 512 of 900 KB are 450 MB). The proxy holds everything the relay
/// sends for 3 s while 100 rows of 900 KB wait, with a 1 MiB budget: the relay sends one
/// message and waits for its ack. Then everything flows, each row published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_in_flight_stay_within_the_byte_budget_while_acks_do_not_come() {
    use support::proxy::NatsProxy;
    let db = TestDb::new();
    let stream = TestStream::new();
    let proxy = NatsProxy::start(&stream.nats_url);
    let mut cmd = relay_command(&db, &stream, &["--no-cleanup"]);
    cmd.env("NATS_URL", proxy.url())
        .env("OUTBOX_MAX_BATCH_BYTES", (1u64 << 20).to_string());
    let relay = Relay::start(cmd);
    // the relay made its stream: it is connected and polling
    wait_until(Duration::from_secs(30), "the relay's stream", || async {
        stream.js().await.get_stream(&stream.name).await.is_ok()
    })
    .await;
    proxy.hold();
    insert_large_rows(&db, 100);
    // the fault itself (no ack for 3 s), not a synchronisation
    tokio::time::sleep(Duration::from_secs(3)).await;
    let held = proxy.held_publishes();
    assert!(
        (1..=2).contains(&held),
        "{held} publishes of 900 KB in flight with a 1 MiB budget; log:\n{}",
        relay.logs()
    );
    proxy.up();
    wait_until(Duration::from_secs(120), "every row published", || async {
        unpublished(&db) == 0
    })
    .await;
    assert_eq!(stream.count().await, 100);
    assert_eq!(parked(&db), 0, "log:\n{}", relay.logs());
}
