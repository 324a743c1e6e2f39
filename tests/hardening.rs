//! Failure paths found by reading the code, each with the behaviour users need (see
//! RELIABILITY.md, "Hardening: failure paths and their tests").
//!
//! Relays run as real `outbox-relay` processes: build them first with
//! `cargo build --workspace --bins`. The 100,000-row variants are `#[ignore]`d:
//! `cargo test --test hardening -- --ignored`.

mod support;

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use diesel::prelude::*;
use outbox_diesel::OutboxExt;
use support::events::{Changed, changed};
use support::servers::NatsServer;
use support::{
    Proc, Relay, TestDb, TestStream, by_aggregate, http_get, relay_command, relay_with_metrics,
    wait_published, wait_until,
};

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

/// Inserts `n` rows over `aggregates` aggregates (`o-0`, `o-1`, ...) with plain SQL, in one
/// statement.
fn insert_rows_over(db: &TestDb, n: i64, aggregates: i64) {
    diesel::sql_query(format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || (i % {aggregates}), 'order.placed', \
         jsonb_build_object('n', i) FROM generate_series(1, {n}) AS i"
    ))
    .execute(&mut db.conn())
    .expect("insert rows");
}

fn unpublished(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL")
}

fn parked(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL")
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

fn record(conn: &mut PgConnection, n: usize, aggregates: usize) {
    conn.transaction(|conn| {
        let events: Vec<Changed> = (0..n)
            .map(|i| changed(&format!("acct-{}", i % aggregates), i as i64))
            .collect();
        conn.record_events(&events)
    })
    .expect("record");
}

/// A login role of its own, with only the README's GRANTs on the outbox of `db`; dropped on
/// `Drop` (roles are cluster-wide: the name is unique, and its grants go first).
struct Role {
    name: String,
    db_url: String,
}

impl Role {
    fn relay(db: &TestDb) -> Role {
        let name = format!(
            "outbox_hard_{}",
            &uuid::Uuid::now_v7().simple().to_string()[16..]
        );
        let mut admin = db.conn();
        for sql in [
            format!("CREATE ROLE {name} LOGIN"),
            format!("GRANT USAGE ON SCHEMA public TO {name}"),
            format!("GRANT SELECT, UPDATE, DELETE ON outbox TO {name}"),
            format!("GRANT SELECT, INSERT, DELETE ON outbox_progress TO {name}"),
        ] {
            diesel::sql_query(sql)
                .execute(&mut admin)
                .expect("set up the role");
        }
        Role {
            name,
            db_url: db.url.clone(),
        }
    }

    /// `db`'s URL with this role as the user.
    fn url(&self) -> String {
        let base = support::pg_base();
        let host = base.rsplit('@').next().unwrap_or("127.0.0.1:5432");
        let db = self.db_url.rsplit('/').next().unwrap_or_default();
        format!("postgres://{}@{host}/{db}", self.name)
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        if let Ok(mut conn) = PgConnection::establish(&self.db_url) {
            let _ = diesel::sql_query(format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{}'",
                self.name
            ))
            .execute(&mut conn);
            let _ = diesel::sql_query(format!("DROP OWNED BY {}", self.name)).execute(&mut conn);
        }
        if let Ok(mut admin) = PgConnection::establish(&format!("{}/postgres", support::pg_base()))
        {
            let _ =
                diesel::sql_query(format!("DROP ROLE IF EXISTS {}", self.name)).execute(&mut admin);
        }
    }
}

/// Partitions per owner pid.
fn owners_per_pid(db: &TestDb) -> HashMap<i32, usize> {
    let mut per_pid: HashMap<i32, usize> = HashMap::new();
    for (_, pid) in support::partition_owners(db) {
        *per_pid.entry(pid).or_default() += 1;
    }
    per_pid
}

// 2. Relays running as different roles, with only the README's GRANTs: each sees the other in
// `pg_locks` (another role's `pg_stat_activity.backend_start` is NULL to it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_running_as_different_roles_share_the_partitions() {
    let db = TestDb::new();
    let stream = TestStream::new();
    let (a, b) = (Role::relay(&db), Role::relay(&db));
    let args = ["--partitions", "4"];
    let mut cmd = relay_command(&db, &stream, &args);
    cmd.env("DATABASE_URL", a.url());
    let _ra = Proc::spawn("relay-a", &mut cmd);
    let mut cmd = relay_command(&db, &stream, &args);
    cmd.env("DATABASE_URL", b.url());
    let _rb = Proc::spawn("relay-b", &mut cmd);

    wait_until(
        Duration::from_secs(20),
        "4 partitions spread 2 and 2 over the two roles' relays",
        || async {
            let per_pid = owners_per_pid(&db);
            per_pid.len() == 2 && per_pid.values().all(|&n| n == 2)
        },
    )
    .await;
    // and they stay shared: no relay loops on a failing balance and drops its partitions
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per_pid = owners_per_pid(&db);
    assert!(
        per_pid.len() == 2 && per_pid.values().all(|&n| n == 2),
        "{per_pid:?}"
    );
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(DISTINCT usename) FROM pg_stat_activity WHERE application_name = \
             'outbox-relay' AND usename IN ('{}', '{}')",
            a.name, b.name
        )),
        2,
        "each relay runs as its own role"
    );
    record(&mut db.conn(), 200, 40);
    wait_published(&db, 200, Duration::from_secs(30)).await;
    assert_eq!(stream.count().await, 200);
}

// 8. The largest partition count: two relays share 1,024 partitions, and the membership keys
// of one table cannot be read as another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_share_the_largest_partition_count() {
    let db = TestDb::new();
    let stream = TestStream::new();
    let max = outbox_diesel::relay::MAX_PARTITIONS.to_string();
    let args = ["--partitions", max.as_str()];
    let _r1 = Proc::spawn("relay-1", &mut relay_command(&db, &stream, &args));
    let _r2 = Proc::spawn("relay-2", &mut relay_command(&db, &stream, &args));
    wait_until(
        Duration::from_secs(60),
        "1,024 partitions spread 512 and 512",
        || async {
            let per_pid = owners_per_pid(&db);
            per_pid.len() == 2 && per_pid.values().all(|&n| n == 512)
        },
    )
    .await;
    // both are members of this table with their count, and of no other table
    let mut conn = db.async_conn().await;
    let members = outbox_diesel::relay::members(&mut conn, &outbox_diesel::OutboxTable::DEFAULT)
        .await
        .expect("members");
    assert_eq!(members.len(), 2, "{members:?}");
    assert!(members.iter().all(|m| m.partitions == 1024), "{members:?}");
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
             AND classid <> 'outbox'::regclass::oid \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ),
        0,
        "a membership key names another table"
    );
    record(&mut db.conn(), 300, 300);
    wait_published(&db, 300, Duration::from_secs(30)).await;
}

#[test]
fn a_partition_count_above_the_largest_is_refused_at_start() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let over = (outbox_diesel::relay::MAX_PARTITIONS + 1).to_string();
    let out = relay_command(&db, &stream, &["--partitions", over.as_str()])
        .output()
        .expect("run the relay");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--partitions 1025 is out of range 1..=1024"),
        "{stderr}"
    );
}

/// `outbox-relay run` for `table`, with the given timings (no defaults of `relay_command` to
/// override).
fn relay_for(db_url: &str, stream: &TestStream, table: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(support::relay_bin());
    cmd.arg("run")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env(
            "RUST_LOG",
            std::env::var("OUTBOX_TEST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .env("DATABASE_URL", db_url)
        .env("NATS_URL", &stream.nats_url)
        .args(["--stream", &stream.name, "--subject-prefix", &stream.prefix])
        .args(["--table", table, "--startup-timeout", "20s"])
        .args(args);
    cmd
}

fn count_published(db: &TestDb, table: &outbox_diesel::OutboxTable) -> i64 {
    db.scalar(&format!(
        "SELECT count(*) FROM {} WHERE published_at IS NOT NULL",
        table.audit_view()
    ))
}

// 3. A table whose `schema.table` is longer than PostgreSQL's 63-byte channel names: the
// wake-up never fails the business transaction, and it still wakes the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_table_name_never_fails_the_business_transaction_and_still_wakes_the_relay() {
    let db = TestDb::new();
    let stream = TestStream::new();
    let schema = format!("s{}", "x".repeat(39));
    let name = format!("t{}", "y".repeat(29));
    assert_eq!((schema.len(), name.len()), (40, 30));
    let table = outbox_diesel::OutboxTable::with_schema(&schema, &name).expect("valid names");
    assert!(table.channel().len() <= 63, "{}", table.channel());
    let mut conn = db.conn();
    diesel::sql_query(format!("CREATE SCHEMA {schema}"))
        .execute(&mut conn)
        .expect("schema");
    outbox_diesel::create_table(&mut conn, &table).expect("create the table");
    let outbox =
        outbox_diesel::Outbox::new(table.clone()).notify(outbox_diesel::Notify::EveryTransaction);
    let event = changed("a", 0);
    conn.transaction(|conn| outbox.record(conn, &event).map(drop))
        .expect("the business transaction commits");

    // the relay polls every 10 s: a publish within 3 s is the NOTIFY's doing
    let full = table.to_string();
    let _relay = Proc::spawn(
        "relay",
        &mut relay_for(
            &db.url,
            &stream,
            &full,
            &[
                "--mode",
                "unordered",
                "--workers",
                "1",
                "--poll-interval",
                "10s",
                "--lease",
                "40s",
            ],
        ),
    );
    wait_until(
        Duration::from_secs(20),
        "the first row published",
        || async { count_published(&db, &table) == 1 },
    )
    .await;
    // the relay has polled and now idles for 10 s; let it settle into the wait
    tokio::time::sleep(Duration::from_millis(500)).await;
    conn.transaction(|conn| outbox.record(conn, &event).map(drop))
        .expect("the business transaction commits");
    wait_until(
        Duration::from_secs(3),
        "the second row published on the NOTIFY, before the next poll",
        || async { count_published(&db, &table) == 2 },
    )
    .await;
}

// 13. A table name with a backslash and a quote, on a server with
// `standard_conforming_strings = off`: names reach SQL as bind parameters or through one
// quoting function that is right under either setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_name_with_a_backslash_and_a_quote_works_without_standard_conforming_strings() {
    let db = TestDb::new();
    let stream = TestStream::new();
    diesel::sql_query(format!(
        "ALTER DATABASE {} SET standard_conforming_strings = off",
        db.name
    ))
    .execute(&mut db.conn())
    .expect("set standard_conforming_strings");
    let name = r"we\'ird";
    let table = outbox_diesel::OutboxTable::new(name).expect("a valid name");
    let mut conn = db.conn();
    assert_eq!(
        db.scalar("SELECT (current_setting('standard_conforming_strings') = 'off')::int"),
        1
    );
    outbox_diesel::create_table(&mut conn, &table).expect("create the table");
    outbox_diesel::create_table(&mut conn, &table).expect("a second create finds it");
    let outbox =
        outbox_diesel::Outbox::new(table.clone()).notify(outbox_diesel::Notify::EveryTransaction);
    for n in 0..10 {
        let event = changed(&format!("a{}", n % 3), n);
        conn.transaction(|conn| outbox.record(conn, &event).map(drop))
            .expect("record");
    }
    let _relay = Proc::spawn(
        "relay",
        &mut relay_for(
            &db.url,
            &stream,
            name,
            &["--partitions", "2", "--poll-interval", "50ms"],
        ),
    );
    wait_until(Duration::from_secs(20), "10 rows published", || async {
        count_published(&db, &table) == 10
    })
    .await;
    // status reads the same table and sees the two partitions' owner
    let out = Command::new(support::relay_bin())
        .args(["status", "--json", "--table", name])
        .env_clear()
        .env("DATABASE_URL", &db.url)
        .output()
        .expect("status");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value = serde_json::from_str(&stdout).expect("status JSON");
    assert_eq!(
        status["relays"].as_array().map(Vec::len),
        Some(1),
        "{status}"
    );
    assert_eq!(stream.count().await, 10);
}

/// The backend pids of the relay's publishing sessions.
fn relay_sessions(db: &TestDb) -> Vec<i32> {
    #[derive(QueryableByName)]
    struct P {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
    }
    let rows: Vec<P> = diesel::sql_query(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
         AND datname = current_database() ORDER BY pid",
    )
    .load(&mut db.conn())
    .expect("sessions");
    rows.into_iter().map(|p| p.pid).collect()
}

// 12. Acks slower than the lease: a relay waiting for them keeps its session (the unordered
// mode's claim transaction holds its rows; the ordered mode's session holds its partitions),
// and the idle timeouts must not end it and hand its work to another relay.
async fn session_survives_acks_slower_than_the_lease(args: &[&str]) {
    let db = TestDb::new();
    let nats = NatsServer::start();
    let stream = TestStream::on(&nats.url());
    let mut all = vec!["--lease", "3s"];
    all.extend_from_slice(args);
    let unordered = args.contains(&"unordered");
    let _relay = Proc::spawn("relay", &mut relay_command(&db, &stream, &all));
    record(&mut db.conn(), 1, 1);
    wait_published(&db, 1, Duration::from_secs(30)).await;
    let before = relay_sessions(&db);
    assert_eq!(before.len(), 1, "{before:?}");

    // JetStream stalls for 4.5 s (within the client's 5 s ack timeout, past the 3 s lease)
    // right when the relay has sent a batch
    nats.pause();
    record(&mut db.conn(), 20, 5);
    if unordered {
        wait_until(Duration::from_secs(5), "the batch claimed", || async {
            db.scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
                 AND datname = current_database() AND state = 'idle in transaction'",
            ) == 1
        })
        .await;
    } else {
        // woken by the commit's notification, the relay reads and sends the rows at once
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_millis(4500)).await;
    nats.resume();

    wait_published(&db, 21, Duration::from_secs(30)).await;
    assert_eq!(
        relay_sessions(&db),
        before,
        "the relay's session was ended while it waited for acks"
    );
    assert_eq!(stream.count().await, 21);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unordered_claim_survives_acks_slower_than_the_lease() {
    session_survives_acks_slower_than_the_lease(&["--mode", "unordered", "--workers", "1"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_session_survives_acks_slower_than_the_lease() {
    session_survives_acks_slower_than_the_lease(&["--no-cleanup"]).await;
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

/// The first line's buffers of an `EXPLAIN (ANALYZE, BUFFERS)`: `shared hit` plus `read`.
fn buffers(plan: &[String]) -> u64 {
    let line = plan
        .iter()
        .find(|l| l.contains("Buffers:"))
        .unwrap_or_else(|| panic!("no Buffers line in\n{}", plan.join("\n")));
    line.split_whitespace()
        .filter_map(|w| w.strip_prefix("hit=").or_else(|| w.strip_prefix("read=")))
        .filter_map(|n| n.parse::<u64>().ok())
        .sum()
}

/// The relay's poll of the whole table (`--partitions 1`), executed in a relay's session.
async fn analyzed_poll(db: &TestDb) -> Vec<String> {
    let mut conn = db.relay_session().await;
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let all = outbox_diesel::relay::Partition::ALL;
    // where the relay goes on from: its recorded cursor
    let cursor = outbox_diesel::relay::load_cursor(&mut conn, &table, all)
        .await
        .expect("the cursor")
        .unwrap_or_else(outbox_diesel::relay::Cursor::start);
    outbox_diesel::relay::explain_batch_analyze(&mut conn, &table, all, &cursor, 500)
        .await
        .expect("explain the poll")
}

// 10. A parked hot aggregate: 20,000 rows wait behind its parked row. The relay's poll must
// not read them on every poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_costs_the_same_whatever_number_of_rows_wait_behind_a_parked_one() {
    let db = TestDb::new();
    let stream = TestStream::new();
    let insert = |aggregate: &str, n: i64| {
        diesel::sql_query(format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'order', {aggregate}, 'order.placed', \
             jsonb_build_object('n', i) FROM generate_series(1, {n}) AS i"
        ))
        .execute(&mut db.conn())
        .expect("insert rows");
    };
    // the hot aggregate's first row was rejected for good and parked
    insert("'hot'", 1);
    db.execute(
        "UPDATE outbox SET parked_at = now(), attempts = 5, last_error = 'rejected' \
         WHERE aggregate_id = 'hot'",
        "park",
    );
    insert("'hot'", 20_000);
    insert("'o-' || i", 200);
    db.execute("VACUUM ANALYZE outbox", "vacuum");

    let relay = Proc::spawn("relay", &mut relay_command(&db, &stream, &[]));
    wait_published(&db, 200, Duration::from_secs(30)).await;
    // the relay meets each held-back row once, and sets it aside
    wait_until(
        Duration::from_secs(30),
        "the hot rows held back",
        || async {
            db.scalar("SELECT count(*) FROM outbox WHERE parked_at = '-infinity'") == 20_000
        },
    )
    .await;
    drop(relay);
    // as autovacuum does after 1,000 dead index entries (the table's threshold)
    db.execute("VACUUM outbox", "vacuum");
    let plan = analyzed_poll(&db).await;
    let text = plan.join("\n");
    // the walk's scan (after the cursor's `seq`), down to the next node: it filters out no
    // row. Held-back rows are behind the cursor, so no index the planner may take for the walk
    // (`outbox_ready`, or one its stale statistics make look cheaper) meets them.
    let start = plan
        .windows(2)
        .position(|w| w[0].contains("Scan using") && w[1].contains("Index Cond: (seq > "));
    let walk: Vec<&String> = match start {
        Some(i) => std::iter::once(&plan[i])
            .chain(plan[i + 1..].iter().take_while(|l| !l.contains("->")))
            .collect(),
        None => Vec::new(),
    };
    assert!(
        !walk.is_empty() && !walk.iter().any(|l| l.contains("Rows Removed by Filter")),
        "{text}"
    );
    let held = buffers(&plan);
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL"),
        20_001,
        "the hot aggregate's rows wait, unpublished"
    );
    assert_eq!(stream.count().await, 200);

    // the same poll over the same table without held-back rows: the same cost
    db.execute(
        "DELETE FROM outbox WHERE aggregate_id = 'hot'",
        "delete the hot aggregate",
    );
    db.execute("VACUUM outbox", "vacuum");
    let empty = buffers(&analyzed_poll(&db).await);
    println!("poll buffers: {held} with 20,000 rows held back, {empty} with none");
    assert!(
        held <= empty + 10,
        "{held} buffers held, {empty} empty:\n{text}"
    );
}

/// A cursor that has read every row committed so far: the highest `seq`, the current
/// snapshot.
fn cursor_now(db: &TestDb) -> outbox_diesel::relay::Cursor {
    outbox_diesel::relay::Cursor::at(
        db.scalar("SELECT max(seq) FROM outbox"),
        db.strings("SELECT pg_current_snapshot()::text")
            .pop()
            .expect("a snapshot"),
    )
}

/// The ordered relay's batch of 500 rows at `cursor` (one partition), executed in a relay's
/// session.
async fn analyzed_batch(db: &TestDb, cursor: outbox_diesel::relay::Cursor) -> Vec<String> {
    let mut conn = db.relay_session().await;
    outbox_diesel::relay::explain_batches_analyze(
        &mut conn,
        &outbox_diesel::OutboxTable::DEFAULT,
        1,
        &[(0, cursor)],
        500,
    )
    .await
    .expect("explain the batch")
}

// 10. Few aggregates, one parked with many rows held back behind it. The statistics then say a
// row's aggregate matches a third of the table, and looking a row's waiting rows up by `seq`
// (an index of every unpublished row, stopping at the first match) looks cheaper than by its
// aggregate through the index of parked rows: it read every row kept before the row, 20 s a
// batch of 500 with 100,000 rows held back. The look-up must go by aggregate whatever the
// statistics, on a plain and on a rotated table.
#[tokio::test]
async fn a_batch_looks_up_waiting_rows_by_aggregate_whatever_the_statistics_say() {
    for rotated in [false, true] {
        let db = TestDb::new();
        if rotated {
            outbox_diesel::partition_table(
                &mut db.conn(),
                &outbox_diesel::OutboxTable::DEFAULT,
                outbox_diesel::Rotation::default().block_rows(5_000),
            )
            .expect("rotate");
        }
        let insert = |aggregates: &str, n: i64, parked: &str| {
            db.execute(
                &format!(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, \
                     parked_at) SELECT gen_random_uuid(), 'tenant', {aggregates}, \
                     'tenant.changed', jsonb_build_object('n', i), {parked} \
                     FROM generate_series(1, {n}) AS i"
                ),
                "insert rows",
            )
        };
        // rows of three tenants, read by the relay and kept for the retention
        insert("'t-' || (i % 3)", 30_000, "NULL");
        // t-0's next row was parked, and the rows after it set aside behind it
        insert("'t-0'", 1, "now()");
        insert("'t-0'", 30_000, "'-infinity'");
        let cursor = cursor_now(&db);
        // new rows of the two others
        insert("'t-' || (1 + i % 2)", 500, "NULL");
        db.execute("VACUUM ANALYZE outbox", "vacuum");

        let plan = analyzed_batch(&db, cursor).await;
        let read = buffers(&plan);
        println!("rotated: {rotated}: {read} buffers for a batch of 500 rows");
        assert!(
            plan.iter().any(|l| l.contains("rows=500 loops=1")),
            "the batch reads its 500 rows:\n{}",
            plan.join("\n")
        );
        // one look-up a row (for parked or held rows; the one for released rows runs only
        // while a row is released, and none is) through the index of parked rows, a probe per
        // partition: a few buffers a row, not a scan of the rows kept before it (637,892)
        let partitions = if rotated { 4 } else { 1 };
        assert!(
            read < 2_500 * partitions,
            "{read} buffers:\n{}",
            plan.join("\n")
        );
    }
}

// 10. Whether any row of the table waits, asked once per batch: where the statistics make
// waiting rows common (a quarter of the table here), the planner looked for one by walking
// every unpublished row by `seq` and read the whole backlog before the first parked row, in
// every batch (24 ms a batch with 100,000 rows of backlog).
#[tokio::test]
async fn a_batch_asks_whether_a_row_waits_through_the_index_of_parked_rows() {
    let db = TestDb::new();
    let insert = |aggregates: &str, n: i64, published: &str, parked: &str| {
        db.execute(
            &format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, \
                 published_at, parked_at) SELECT gen_random_uuid(), 'order', {aggregates}, \
                 'order.placed', jsonb_build_object('n', i), {published}, {parked} \
                 FROM generate_series(1, {n}) AS i"
            ),
            "insert rows",
        )
    };
    // rows marked published (by a relay of another mode), then a backlog the cursor has read
    insert(
        "'o-' || (i % 1000)",
        20_000,
        "now() - interval '1 hour'",
        "NULL",
    );
    insert("'o-' || (i % 1000)", 20_000, "NULL", "NULL");
    // a hot aggregate parked, 20,000 rows set aside behind it
    insert("'hot'", 1, "NULL", "now()");
    insert("'hot'", 20_000, "NULL", "'-infinity'");
    let cursor = cursor_now(&db);
    insert("'o-' || (i % 1000)", 500, "NULL", "NULL");
    db.execute("VACUUM ANALYZE outbox", "vacuum");

    let plan = analyzed_batch(&db, cursor).await;
    let read = buffers(&plan);
    println!("{read} buffers for a batch of 500 rows");
    assert!(
        !plan
            .iter()
            .any(|l| l.contains("Rows Removed by Filter: 20000")),
        "no walk through the backlog:\n{}",
        plan.join("\n")
    );
    assert!(read < 2_500, "{read} buffers:\n{}", plan.join("\n"));
}

// 10. A backlog written in a few large transactions: the statistics see few transaction ids,
// and the batch must still find the late rows by transaction id, not by reading every
// unpublished row and testing its id.
#[tokio::test]
async fn a_batch_finds_late_rows_by_transaction_id_behind_a_backlog_of_few_transactions() {
    let db = TestDb::new();
    let insert = |n: i64| insert_rows_over(&db, n, 100);
    // rows published long ago (marked, as by a relay of another mode), then the last ones read
    insert(300_000);
    db.execute(
        "UPDATE outbox SET published_at = now() - interval '1 hour'",
        "mark",
    );
    insert(500);
    let read_upto = db.scalar("SELECT max(seq) FROM outbox");
    insert(100_000);
    // the relay's last batch read the first 500 rows, at a snapshot taken after the backlog
    db.execute(
        &format!(
            "INSERT INTO outbox_progress (partitions, partition, upto_seq, snap) \
             VALUES (1, 0, {read_upto}, pg_current_snapshot())"
        ),
        "record a cursor",
    );
    db.execute("VACUUM ANALYZE outbox", "analyze");
    let plan = analyzed_poll(&db).await;
    let text = plan.join("\n");
    // the next rows by `outbox_ready`, the late ones by `outbox_txid`: no part reads the
    // backlog to test its rows' ids
    assert_eq!(text.matches("outbox_ready").count(), 1, "{text}");
    assert!(!text.contains("Rows Removed by Filter"), "{text}");
    let read = buffers(&plan);
    println!("batch buffers with a 100,000-row backlog of one transaction: {read}");
    assert!(read < 3_000, "{read} buffers:\n{text}");
}

/// The `seq`s of `batch`'s rows from `source`.
/// A transaction that runs `insert` and stays open until the returned function is called,
/// which commits it.
fn hold_open(db: &TestDb, insert: &str) -> impl FnOnce() {
    let insert = insert.to_owned();
    let mut open = db.conn();
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let (inserted, inserted_wait) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        open.transaction(|c| {
            diesel::sql_query(insert).execute(c)?;
            inserted.send(()).ok();
            wait.recv().ok();
            Ok::<_, diesel::result::Error>(())
        })
        .expect("the held transaction commits");
    });
    inserted_wait.recv().expect("the held rows inserted");
    move || {
        done.send(()).expect("commit the held transaction");
        holder.join().expect("the holder");
    }
}

fn seqs_of(batch: &outbox_diesel::relay::Batch, source: outbox_diesel::relay::Source) -> Vec<i64> {
    batch
        .rows
        .iter()
        .filter(|(_, s)| *s == source)
        .map(|(r, _)| r.seq)
        .collect()
}

fn seqs_where(db: &TestDb, filter: &str) -> Vec<i64> {
    #[derive(QueryableByName)]
    struct Seq {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        seq: i64,
    }
    diesel::sql_query(format!(
        "SELECT seq FROM outbox WHERE {filter} ORDER BY seq"
    ))
    .load::<Seq>(&mut db.conn())
    .expect("select seqs")
    .into_iter()
    .map(|s| s.seq)
    .collect()
}

// 10. A relay reads all its partitions in one statement, one walk through their rows, although
// their cursors differ (one was just taken over): each row is returned once, to its own
// partition, every cursor moves to the end of the walk, and a late row comes back to its own
// partition once its transaction commits.
#[tokio::test]
async fn one_statement_reads_partitions_at_different_cursors_each_row_once() {
    use outbox_diesel::relay::{Cursor, Source, fetch_batches};
    let db = TestDb::new();
    let insert = |n: i64| insert_rows_over(&db, n, 10);
    insert(100);
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let mut conn = db.relay_session().await;
    // partition 0 was read up to seq 50; partition 1 is new to this relay
    let snap = db.scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint");
    let read = Cursor::at(50, format!("{snap}:{snap}:"));
    let first = fetch_batches(
        &mut conn,
        &table,
        2,
        &[(0, read.clone()), (1, Cursor::start())],
        &[],
        1_000,
        i64::MAX,
    )
    .await
    .expect("fetch");
    assert_eq!(first.len(), 2);
    let (p0, p1) = (&first[0], &first[1]);
    assert_eq!((p0.0, p1.0), (0, 1));
    assert_eq!(
        seqs_of(&p0.1, Source::Next),
        seqs_where(&db, "aggregate_hash % 2 = 0 AND seq > 50")
    );
    assert_eq!(
        seqs_of(&p1.1, Source::Next),
        seqs_where(&db, "aggregate_hash % 2 = 1")
    );
    assert!(
        seqs_of(&p1.1, Source::Next).len() > 10,
        "both partitions have rows"
    );
    assert_eq!((p0.1.next.upto_seq, p1.1.next.upto_seq), (100, 100));
    assert_eq!(
        p0.1.next.snap, p1.1.next.snap,
        "one statement, one snapshot"
    );

    // a transaction held open across the next batch: its rows are late for their partition
    let commit = hold_open(
        &db,
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || i, 'order.placed', '{}' \
         FROM generate_series(1, 10) AS i",
    );
    insert(20);
    let cursors: Vec<(u32, Cursor)> = first.iter().map(|(p, b)| (*p, b.next.clone())).collect();
    let second = fetch_batches(&mut conn, &table, 2, &cursors, &[], 1_000, i64::MAX)
        .await
        .expect("fetch");
    let later = seqs_where(&db, "seq > 110");
    let got: Vec<i64> = second
        .iter()
        .flat_map(|(_, b)| seqs_of(b, Source::Next))
        .collect();
    let mut got_sorted = got.clone();
    got_sorted.sort_unstable();
    assert_eq!(got_sorted, later, "the committed rows after the held ones");
    commit();
    let cursors: Vec<(u32, Cursor)> = second.iter().map(|(p, b)| (*p, b.next.clone())).collect();
    let third = fetch_batches(&mut conn, &table, 2, &cursors, &[], 1_000, i64::MAX)
        .await
        .expect("fetch");
    for (p, batch) in &third {
        assert_eq!(seqs_of(batch, Source::Next), Vec::<i64>::new());
        assert_eq!(
            seqs_of(batch, Source::Late),
            seqs_where(
                &db,
                &format!("seq > 100 AND seq <= 110 AND aggregate_hash % 2 = {p}")
            ),
            "partition {p}: the held rows, late, once"
        );
    }
}

// 38. A partition with no recorded progress (a new table, or one whose relays never recorded
// it) is read from a cursor at `seq` 0 whose snapshot sees nothing: its look-up of rows of
// transactions begun after that snapshot read every row of the table by `outbox_txid` to find
// none at or below `seq` 0 (20,000 rows here; 125 ms a batch with 100,000, at every take-over
// while relays balance). The look-up now skips cursors at 0: such a batch costs what one at a
// current snapshot does.
#[tokio::test]
async fn a_partition_taken_over_with_no_progress_looks_up_no_row_of_the_table() {
    use outbox_diesel::relay::{Cursor, explain_batches_analyze};
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    insert_rows_over(&db, 20_000, 100);
    db.execute("ANALYZE outbox", "analyze");
    let x = db.scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint");
    let mut conn = db.relay_session().await;
    let plan = async |conn: &mut diesel_async::AsyncPgConnection, cursor: Cursor| {
        let plan = explain_batches_analyze(conn, &table, 1, &[(0, cursor)], 500)
            .await
            .expect("explain");
        (buffers(&plan), plan)
    };
    let (current, _) = plan(&mut conn, Cursor::at(0, format!("{x}:{x}:"))).await;
    let (start, start_plan) = plan(&mut conn, Cursor::start()).await;
    assert_no_dearer(
        "a batch at the start",
        (current, "at seq 0 with a current snapshot"),
        (start, "with the snapshot that sees nothing", &start_plan),
        10,
    );
}

/// The rows the plan's scan of `index` read and dropped by its filter (`None`: no such scan).
fn removed_by_filter(plan: &str, index: &str) -> Option<u64> {
    let mut lines = plan.lines();
    lines.find(|l| l.contains(&format!("using {index} on")))?;
    let removed = lines
        .take_while(|l| !l.contains("->"))
        .find_map(|l| l.trim().strip_prefix("Rows Removed by Filter: "))
        .map_or(0, |n| n.parse().unwrap_or(u64::MAX));
    Some(removed)
}

// 43. A partition walked by the partition index from a cursor deep into it: written with its
// equality and a row comparison (which only that index serves), the index scan started at the
// partition's first entry and read every entry up to the cursor (the equality is the scan's
// start, and a row comparison's later column starts nothing behind it): in the default mode
// the index keeps every row until cleanup, so each batch of a busy partition read more of it
// than the last (218 buffers a batch in the bench's drain of 100,000 rows, against 43). With
// the cursor's `seq` a bound of its own, the scan starts at the cursor: a batch at the end of
// the partitions costs what one at their start does.
#[tokio::test]
async fn a_partition_read_by_the_partition_index_starts_at_its_cursor() {
    use outbox_diesel::relay::{Cursor, Partitioning, explain_batches_analyze_in};
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    insert_rows_over(&db, 100_000, 1_000);
    assert!(outbox_diesel::create_partition_index(&mut db.conn(), &table, 4).expect("index"));
    db.execute("ANALYZE outbox", "analyze");
    let snap = db.strings("SELECT pg_current_snapshot()::text").remove(0);
    let mut conn = db.relay_session().await;
    let indexed = Partitioning::new(4).indexed(true);
    let at = |seq: i64| {
        [
            (1, Cursor::at(seq, snap.clone())),
            (3, Cursor::at(seq, snap.clone())),
        ]
    };
    // the session's generic plan first
    for _ in 0..6 {
        explain_batches_analyze_in(&mut conn, &table, indexed, &at(0), 200)
            .await
            .expect("explain");
    }
    let start = explain_batches_analyze_in(&mut conn, &table, indexed, &at(0), 200)
        .await
        .expect("explain");
    let deep = explain_batches_analyze_in(&mut conn, &table, indexed, &at(99_000), 200)
        .await
        .expect("explain");
    assert_no_dearer(
        "200 rows of 2 partitions of 4 by the partition index",
        (buffers(&start), "from their start"),
        (buffers(&deep), "from seq 99,000 of 100,000", &deep),
        10,
    );
}

// 42. Walked by the partition index, each partition a relay read had a fixed share of the batch
// (the row limit over the partitions read): with the traffic on one of them, batches were a
// fraction of `--batch-size` (a relay reading 4 partitions got 125 rows a batch of 500 from
// its one busy partition). The partitions' rows now come merged in `seq` order up to the row
// limit and the byte budget, whichever partition they are in.
#[tokio::test]
async fn a_busy_partition_read_by_the_partition_index_fills_the_batch() {
    use outbox_diesel::relay::{Cursor, Partitioning, Source, fetch_batches_in};
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    // every row in partition 1 of 4: one aggregate
    let busy = db.scalar(
        "SELECT min(i) FROM generate_series(0, 999) AS i \
         WHERE ('x' || substr(md5('k-' || i), 1, 7))::bit(28)::integer % 4 = 1",
    );
    diesel::sql_query(format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'k-{busy}', 'order.placed', jsonb_build_object('n', i) \
         FROM generate_series(1, 300) AS i"
    ))
    .execute(&mut db.conn())
    .expect("insert");
    assert!(outbox_diesel::create_partition_index(&mut db.conn(), &table, 4).expect("index"));
    let mut conn = db.relay_session().await;
    let indexed = Partitioning::new(4).indexed(true);
    let all = seqs_where(&db, "true");
    for owned in [vec![1, 3], vec![0, 1, 2]] {
        let mut cursors: Vec<(u32, Cursor)> = owned.iter().map(|p| (*p, Cursor::start())).collect();
        let mut got = Vec::new();
        for batch in 0..3 {
            let batches =
                fetch_batches_in(&mut conn, &table, indexed, &cursors, &[], 100, i64::MAX)
                    .await
                    .expect("fetch");
            let rows: Vec<i64> = batches
                .iter()
                .flat_map(|(_, b)| seqs_of(b, Source::Next))
                .collect();
            assert_eq!(
                rows,
                all[batch * 100..(batch + 1) * 100].to_vec(),
                "partitions {owned:?}, batch {batch}: a whole batch of the busy partition"
            );
            got.extend(rows);
            cursors = batches.into_iter().map(|(p, b)| (p, b.next)).collect();
        }
        assert_eq!(got, all, "partitions {owned:?}: each row once, in order");
    }
}

// 37. A relay that owns some of the partitions walked every partition's rows by `seq` and
// passed over the others' (each a heap fetch: two relays read every row twice). With the
// partition index of its count, it reads each partition it owns by that index from its own
// cursor: the rows of its partitions only, each once, merged in `seq` order within the row
// limit and the byte budget, late rows as before.
#[tokio::test]
async fn partitions_owned_are_read_by_the_partition_index_each_from_its_own_cursor() {
    use outbox_diesel::relay::{
        Cursor, Partitioning, Source, explain_batches_analyze_in, fetch_batches_in,
        has_partition_index,
    };
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    // a new table (no statistics) of 1,000 rows: where the `ready` index is one page (up to
    // about 400 rows), the planner may walk it and filter, at the cost of reading that page
    insert_rows_over(&db, 1_000, 40);
    let mut conn = db.relay_session().await;
    assert!(
        !has_partition_index(&mut conn, &table, 4)
            .await
            .expect("look")
    );
    assert!(outbox_diesel::create_partition_index(&mut db.conn(), &table, 4).expect("index"));
    assert!(
        !outbox_diesel::create_partition_index(&mut db.conn(), &table, 4).expect("index"),
        "made once"
    );
    assert!(
        has_partition_index(&mut conn, &table, 4)
            .await
            .expect("look")
    );
    assert!(
        !has_partition_index(&mut conn, &table, 8)
            .await
            .expect("look"),
        "one partition count's index serves no other"
    );
    let indexed = Partitioning::new(4).indexed(true);
    let mine = |p: u32| seqs_where(&db, &format!("aggregate_hash % 4 = {p}"));

    // the plan: partitions 1 and 3 by the partition index, no row of 0 and 2 read; without
    // it, the walk by `seq` passes over theirs
    let some = [(1, Cursor::start()), (3, Cursor::start())];
    let plan = explain_batches_analyze_in(&mut conn, &table, indexed, &some, 1_000)
        .await
        .expect("explain")
        .join("\n");
    assert_eq!(
        removed_by_filter(&plan, "outbox_ready_p4"),
        Some(0),
        "{plan}"
    );
    let walked = explain_batches_analyze_in(&mut conn, &table, Partitioning::new(4), &some, 1_000)
        .await
        .expect("explain")
        .join("\n");
    let others = seqs_where(&db, "aggregate_hash % 4 IN (0, 2)").len() as u64;
    assert_eq!(
        removed_by_filter(&walked, "outbox_ready"),
        Some(others),
        "{walked}"
    );

    // 8 rows a batch: the first 8 of the two partitions by `seq`, each cursor at the 8th; to
    // the end, every row of the two partitions once, in `seq` order
    let mut cursors = some.to_vec();
    let mut got: HashMap<u32, Vec<i64>> = HashMap::new();
    let ours = seqs_where(&db, "aggregate_hash % 4 IN (1, 3)");
    let mut first = true;
    loop {
        let batches = fetch_batches_in(&mut conn, &table, indexed, &cursors, &[], 8, i64::MAX)
            .await
            .expect("fetch");
        let read: usize = batches.iter().map(|(_, b)| b.rows.len()).sum();
        assert!(read <= 8, "{read} rows in a batch of 8");
        if first {
            let mut rows: Vec<i64> = batches
                .iter()
                .flat_map(|(_, b)| seqs_of(b, Source::Next))
                .collect();
            rows.sort_unstable();
            assert_eq!(
                rows,
                ours[..8].to_vec(),
                "the first 8 of the two partitions"
            );
            for (p, b) in &batches {
                assert_eq!(
                    b.next.upto_seq, ours[7],
                    "partition {p}'s cursor at the 8th"
                );
            }
        }
        for (p, b) in &batches {
            got.entry(*p).or_default().extend(seqs_of(b, Source::Next));
        }
        first = false;
        cursors = batches.into_iter().map(|(p, b)| (p, b.next)).collect();
        if read == 0 {
            break;
        }
    }
    for p in [1, 3] {
        assert_eq!(
            got[&p],
            mine(p),
            "partition {p}: its rows, each once, in order"
        );
    }

    // 10 rows in partition 1, then one in partition 3: a batch of 8 takes partition 1's first
    // 8 and moves both cursors to the 8th; a byte budget of one byte the next row alone; the
    // next batch the rest of both
    let of = |p: i64| {
        db.scalar(&format!(
            "SELECT min(i) FROM generate_series(0, 999) AS i \
             WHERE ('x' || substr(md5('k-' || i), 1, 7))::bit(28)::integer % 4 = {p}"
        ))
    };
    let (a1, a3) = (of(1), of(3));
    diesel::connection::SimpleConnection::batch_execute(
        &mut db.conn(),
        &format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'order', 'k-{a1}', 'order.placed', '{{}}' \
             FROM generate_series(1, 10); \
             INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), 'order', 'k-{a3}', 'order.placed', '{{}}')"
        ),
    )
    .expect("insert");
    let new1 = seqs_where(&db, &format!("aggregate_id = 'k-{a1}'"));
    let new3 = seqs_where(&db, &format!("aggregate_id = 'k-{a3}'"));
    let batches = fetch_batches_in(&mut conn, &table, indexed, &cursors, &[], 8, i64::MAX)
        .await
        .expect("fetch");
    let (b1, b3) = (&batches[0].1, &batches[1].1);
    assert_eq!(seqs_of(b1, Source::Next), new1[..8].to_vec());
    assert_eq!(seqs_of(b3, Source::Next), Vec::<i64>::new());
    assert_eq!((b1.next.upto_seq, b3.next.upto_seq), (new1[7], new1[7]));
    cursors = batches.into_iter().map(|(p, b)| (p, b.next)).collect();
    let batches = fetch_batches_in(&mut conn, &table, indexed, &cursors, &[], 1_000, 1)
        .await
        .expect("fetch");
    assert_eq!(seqs_of(&batches[0].1, Source::Next), vec![new1[8]]);
    assert_eq!(seqs_of(&batches[1].1, Source::Next), Vec::<i64>::new());
    cursors = batches.into_iter().map(|(p, b)| (p, b.next)).collect();
    let batches = fetch_batches_in(&mut conn, &table, indexed, &cursors, &[], 1_000, i64::MAX)
        .await
        .expect("fetch");
    assert_eq!(seqs_of(&batches[0].1, Source::Next), vec![new1[9]]);
    assert_eq!(seqs_of(&batches[1].1, Source::Next), new3);
    cursors = batches.into_iter().map(|(p, b)| (p, b.next)).collect();

    // a transaction held open across a batch: its rows come late, to their own partition,
    // once, and those of partitions 0 and 2 not at all
    let commit = hold_open(
        &db,
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'h-' || i, 'order.placed', '{}' \
         FROM generate_series(1, 40) AS i",
    );
    let held_end = db.scalar("SELECT max(seq) FROM outbox") + 40;
    insert_rows_over(&db, 40, 40);
    let batches = fetch_batches_in(&mut conn, &table, indexed, &cursors, &[], 1_000, i64::MAX)
        .await
        .expect("fetch");
    for (p, b) in &batches {
        assert_eq!(
            seqs_of(b, Source::Next),
            seqs_where(
                &db,
                &format!(
                    "aggregate_hash % 4 = {p} AND aggregate_id LIKE 'o-%' AND seq > {held_end}"
                )
            ),
            "partition {p}: the rows committed after the held ones"
        );
    }
    cursors = batches.into_iter().map(|(p, b)| (p, b.next)).collect();
    commit();
    let batches = fetch_batches_in(&mut conn, &table, indexed, &cursors, &[], 1_000, i64::MAX)
        .await
        .expect("fetch");
    for (p, b) in &batches {
        assert_eq!(seqs_of(b, Source::Next), Vec::<i64>::new());
        assert_eq!(
            seqs_of(b, Source::Late),
            seqs_where(
                &db,
                &format!("aggregate_hash % 4 = {p} AND aggregate_id LIKE 'h-%'")
            ),
            "partition {p}: the held rows, late, once"
        );
    }
}

// 22. A relay takes over a partition whose cursor is far behind those of the partitions it
// already reads (they share one walk from the lowest cursor): the walk's row limit counted the
// rows the other partitions had read before, so the new partition got a batch's worth of the
// table at a time (none of its own rows for 25 batches here). Now the limit counts only rows
// above their own partition's cursor: its rows come in the first batch.
#[tokio::test]
async fn a_partition_taken_over_far_behind_the_others_gets_its_rows_in_the_first_batch() {
    use outbox_diesel::relay::{Cursor, Source, fetch_batches};
    let db = TestDb::new();
    // 200 rows of one aggregate (one partition), then 40 over ten aggregates
    diesel::sql_query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-0', 'order.placed', '{}' \
         FROM generate_series(1, 200)",
    )
    .execute(&mut db.conn())
    .expect("insert");
    insert_rows_over(&db, 40, 10);
    let dense = db
        .scalar("SELECT (aggregate_hash % 2)::int8 FROM outbox WHERE aggregate_id = 'o-0' LIMIT 1")
        as u32;
    let other = 1 - dense;
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let mut conn = db.relay_session().await;
    // the relay has read the dense partition to the end
    let read = fetch_batches(
        &mut conn,
        &table,
        2,
        &[(dense, Cursor::start())],
        &[],
        1_000,
        i64::MAX,
    )
    .await
    .expect("fetch");
    let ahead = read[0].1.next.clone();
    assert_eq!(ahead.upto_seq, 240);
    // and takes over the other one, new to it
    let both = fetch_batches(
        &mut conn,
        &table,
        2,
        &[(dense, ahead.clone()), (other, Cursor::start())],
        &[],
        8,
        i64::MAX,
    )
    .await
    .expect("fetch");
    let theirs = seqs_where(&db, &format!("aggregate_hash % 2 = {other}"));
    assert!(theirs.len() >= 8, "{theirs:?}");
    assert_eq!(
        seqs_of(&both[1].1, Source::Next),
        theirs[..8].to_vec(),
        "the taken-over partition's first 8 rows, in its first batch"
    );
    assert_eq!(both[1].1.next.upto_seq, theirs[7]);
    assert_eq!(seqs_of(&both[0].1, Source::Next), Vec::<i64>::new());
    assert_eq!(both[0].1.next.upto_seq, 240, "a cursor never moves back");

    // the byte budget, too, counts only the rows read for their own partition
    let both = fetch_batches(
        &mut conn,
        &table,
        2,
        &[(dense, ahead), (other, Cursor::start())],
        &[],
        1_000,
        1,
    )
    .await
    .expect("fetch");
    assert_eq!(seqs_of(&both[1].1, Source::Next), theirs[..1].to_vec());
}

// 20. A transaction held open across batches and committed with more rows than a batch holds:
// its rows are all late, and the batch read them all at once (a bulk load of a million events
// was one batch, whatever `--batch-size` and `--max-batch-bytes`). Now they are read in parts
// within the batch's limits (a late pass), in `seq` order, each once; the partition's next rows
// wait for the pass and follow it, and the other partition keeps being read meanwhile.
#[tokio::test]
async fn a_late_transaction_larger_than_a_batch_is_read_in_parts_within_its_limits() {
    use outbox_diesel::relay::{Cursor, Source, fetch_batches};
    let db = TestDb::new();
    let insert = |n: i64| insert_rows_over(&db, n, 10);
    insert(20);
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let mut conn = db.relay_session().await;
    let mut cursors: Vec<(u32, Cursor)> = vec![(0, Cursor::start()), (1, Cursor::start())];
    let mut returned: Vec<(u32, i64, Source)> = Vec::new();
    let mut step = async |cursors: &mut Vec<(u32, Cursor)>, limit: i64, max_bytes: i64| {
        let batches = fetch_batches(&mut conn, &table, 2, cursors, &[], limit, max_bytes)
            .await
            .expect("fetch");
        let mut got = Vec::new();
        for ((p, batch), (_, before)) in batches.iter().zip(cursors.iter()) {
            let late = seqs_of(batch, Source::Late);
            assert!(
                late.len() as i64 <= limit,
                "partition {p}: {} late rows in one batch of {limit}",
                late.len()
            );
            if before.late.is_some() {
                assert_eq!(
                    seqs_of(batch, Source::Next),
                    Vec::<i64>::new(),
                    "partition {p}: no next row during its late pass"
                );
            }
            got.extend(batch.rows.iter().map(|(r, s)| (*p, r.seq, *s)));
        }
        *cursors = batches.into_iter().map(|(p, b)| (p, b.next)).collect();
        got
    };
    // the rows committed so far are read
    returned.extend(step(&mut cursors, 100, i64::MAX).await);
    assert_eq!(returned.len(), 20);

    // 60 rows over both partitions in a transaction held open while later rows are read
    let commit = hold_open(
        &db,
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'bulk', 'b-' || (i % 7), 'bulk.loaded', \
         jsonb_build_object('pad', repeat('x', 80)) FROM generate_series(1, 60) AS i",
    );
    insert(10);
    returned.extend(step(&mut cursors, 100, i64::MAX).await);
    assert_eq!(returned.len(), 30, "the rows after the held ones");
    commit();
    // rows after the commit: they wait for their partition's pass
    insert(10);

    // a row limit of 8: the late rows come 8 at most per partition and batch
    let mut passes = 0;
    for _ in 0..40 {
        let got = step(&mut cursors, 8, i64::MAX).await;
        passes += usize::from(cursors.iter().any(|(_, c)| c.late.is_some()));
        if got.is_empty() && cursors.iter().all(|(_, c)| c.late.is_none()) {
            break;
        }
        returned.extend(got);
    }
    assert!(
        passes >= 3,
        "the late rows were read in parts ({passes} steps in a pass)"
    );
    let all = seqs_where(&db, "true");
    let mut seqs: Vec<i64> = returned.iter().map(|(_, s, _)| *s).collect();
    seqs.sort_unstable();
    assert_eq!(seqs, all, "every row read once");
    for p in 0..2u32 {
        let late: Vec<i64> = returned
            .iter()
            .filter(|(q, _, s)| *q == p && *s == Source::Late)
            .map(|(_, s, _)| *s)
            .collect();
        assert_eq!(
            late,
            seqs_where(
                &db,
                &format!("aggregate_type = 'bulk' AND aggregate_hash % 2 = {p}")
            ),
            "partition {p}: the held rows, late, in seq order"
        );
        let order: Vec<i64> = returned
            .iter()
            .filter(|(q, _, _)| *q == p)
            .map(|(_, s, _)| *s)
            .collect();
        let last_late = late.last().copied().unwrap_or_default();
        let first_late = order
            .iter()
            .position(|s| *s == late[0])
            .expect("a late row");
        let last_late_at = order
            .iter()
            .position(|s| *s == last_late)
            .expect("a late row");
        assert!(
            order[first_late..=last_late_at]
                .iter()
                .all(|s| late.contains(s)),
            "partition {p}: nothing else between its late rows"
        );
    }

    // a byte budget of three payloads: three late rows at most per part
    let commit = hold_open(
        &db,
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'big', 'g-1', 'big.loaded', \
         jsonb_build_object('pad', repeat('y', 1000)) FROM generate_series(1, 10) AS i",
    );
    insert(4);
    let got = step(&mut cursors, 100, i64::MAX).await;
    assert_eq!(got.len(), 4);
    commit();
    let size = db.scalar(
        "SELECT octet_length(payload::text) FROM outbox WHERE aggregate_type = 'big' LIMIT 1",
    );
    let mut big = Vec::new();
    for _ in 0..20 {
        let got = step(&mut cursors, 100, 3 * size).await;
        let late: Vec<i64> = got
            .iter()
            .filter(|(_, _, s)| *s == Source::Late)
            .map(|(_, s, _)| *s)
            .collect();
        assert!(
            late.len() <= 3,
            "{} late rows of {size} bytes within three",
            late.len()
        );
        big.extend(late);
        if got.is_empty() && cursors.iter().all(|(_, c)| c.late.is_none()) {
            break;
        }
    }
    assert_eq!(
        big,
        seqs_where(&db, "aggregate_type = 'big'"),
        "in seq order, each once"
    );
}

/// The batch of the one partition of `outbox` (`--partitions 1`) at `cursor`, 8 rows at most.
async fn batch_of_8(
    conn: &mut diesel_async::AsyncPgConnection,
    cursor: outbox_diesel::relay::Cursor,
) -> outbox_diesel::relay::Batch {
    let table = outbox_diesel::OutboxTable::DEFAULT;
    outbox_diesel::relay::fetch_batches(conn, &table, 1, &[(0, cursor)], &[], 8, i64::MAX)
        .await
        .expect("fetch")
        .into_iter()
        .next()
        .expect("the partition's batch")
        .1
}

/// The plans (with their buffers) of a late pass at `late` late rows: a transaction held open
/// while 4 later rows were read, then committed. `first`: the batch that finds the late rows
/// and begins the pass; `part`: the next part, after `since` rows more were written by
/// transactions that began after the pass did. Each in a relay's session.
struct LatePassPlans {
    first: (u64, Vec<String>),
    part: (u64, Vec<String>),
}

async fn late_pass_plans(late: i64, since: i64) -> LatePassPlans {
    use outbox_diesel::relay::{Cursor, Partition, explain_batch_analyze};
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    insert_rows_over(&db, 2, 2);
    let bulk = format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'bulk', 'b-' || (i % 7), 'bulk.loaded', \
         jsonb_build_object('n', i) FROM generate_series(1, {late}) AS i"
    );
    let commit = hold_open(&db, &bulk);
    insert_rows_over(&db, 2, 2);
    let mut conn = db.relay_session().await;
    let cursor = batch_of_8(&mut conn, Cursor::start()).await.next;
    commit();
    db.execute("VACUUM ANALYZE outbox", "vacuum");
    let plan = async |conn: &mut diesel_async::AsyncPgConnection, cursor: &Cursor| {
        let plan = explain_batch_analyze(conn, &table, Partition::ALL, cursor, 8)
            .await
            .expect("explain");
        (buffers(&plan), plan)
    };
    let first = plan(&mut conn, &cursor).await;
    let cursor = batch_of_8(&mut conn, cursor).await.next;
    assert!(cursor.late.is_some(), "in a late pass");
    if since > 0 {
        insert_rows_over(&db, since, 100);
    }
    let part = plan(&mut conn, &cursor).await;
    LatePassPlans { first, part }
}

/// The cursors of all `count` partitions after reading the whole table from the start, in
/// batches of 5,000, as a relay catching up leaves them.
async fn read_to_the_end(
    conn: &mut diesel_async::AsyncPgConnection,
    count: u32,
) -> Vec<(u32, outbox_diesel::relay::Cursor)> {
    use outbox_diesel::relay::{Cursor, fetch_batches};
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let mut cursors: Vec<(u32, Cursor)> = (0..count).map(|p| (p, Cursor::start())).collect();
    loop {
        let batches = fetch_batches(conn, &table, count, &cursors, &[], 5_000, i64::MAX)
            .await
            .expect("fetch");
        let read: usize = batches.iter().map(|(_, b)| b.rows.len()).sum();
        cursors = batches.into_iter().map(|(p, b)| (p, b.next)).collect();
        if read == 0 {
            return cursors;
        }
    }
}

/// Asserts that `what` reads no more buffers in the `case` than in the `base` one, give or
/// take `slack`, showing the case's plan when it does; prints both.
fn assert_no_dearer(
    what: &str,
    (base, base_is): (u64, &str),
    (case, case_is, plan): (u64, &str, &[String]),
    slack: u64,
) {
    println!("{what}: {base} buffers {base_is}, {case} {case_is}");
    assert!(
        case <= base + slack,
        "{what}: {case} buffers {case_is}, {base} {base_is}:\n{}",
        plan.join("\n")
    );
}

#[derive(diesel::QueryableByName, Debug)]
struct Plans {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    generic_plans: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    custom_plans: i64,
}

/// How often the session planned each ordered batch statement it prepared, generic and custom.
async fn batch_statement_plans(conn: &mut diesel_async::AsyncPgConnection) -> Vec<Plans> {
    diesel_async::RunQueryDsl::load(
        diesel::sql_query(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements \
             WHERE statement LIKE '%pg_snapshot_xip%' \
             AND statement NOT LIKE '%pg_prepared_statements%' ORDER BY prepare_time",
        ),
        conn,
    )
    .await
    .expect("the session's prepared statements")
}

/// The ordered batch statement keeps its generic plan: PostgreSQL plans it once per session,
/// with 1 and with 4 partitions. A statement whose generic plan PostgreSQL judges costlier
/// than a custom one is planned again at every call (a per-transaction look-up of late rows in
/// every batch did that: 0.69 ms an empty batch against 0.11).
#[tokio::test]
async fn the_ordered_batch_statement_is_planned_once_per_session() {
    use outbox_diesel::relay::{Cursor, fetch_batches};
    let db = TestDb::new();
    insert_rows_over(&db, 20, 5);
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let mut conn = db.relay_session().await;
    for count in [1u32, 4] {
        let cursors: Vec<(u32, Cursor)> = (0..count).map(|p| (p, Cursor::start())).collect();
        for _ in 0..20 {
            fetch_batches(&mut conn, &table, count, &cursors, &[], 500, i64::MAX)
                .await
                .expect("fetch");
        }
    }
    let plans = batch_statement_plans(&mut conn).await;
    assert_eq!(
        plans.len(),
        2,
        "one statement per partition count: {plans:?}"
    );
    for p in &plans {
        assert!(
            p.generic_plans >= 14 && p.custom_plans <= 6,
            "planned at each call: {plans:?}"
        );
    }
}

/// A relay caught up keeps the generic plan too: at cursors at the end of an analyzed table of
/// 20,000 rows, with 1 partition, with 4 at one cursor and with 4 at cursors that differ. With
/// the binds' values in sight the planner found custom plans cheaper there (the walk after the
/// table's last row is empty by the statistics) and planned the statement at every call: 0.8
/// ms a batch, against 0.08 for running the generic plan.
#[tokio::test]
async fn a_relay_caught_up_keeps_the_generic_plan_of_its_batch_statement() {
    use outbox_diesel::relay::{Cursor, fetch_batches};
    let db = TestDb::new();
    for _ in 0..100 {
        insert_rows_over(&db, 200, 50);
    }
    db.execute("VACUUM ANALYZE outbox", "vacuum");
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let mut conn = db.relay_session().await;
    // each partition count's cursors, read to the end of the table
    let mut ends: Vec<(u32, Vec<(u32, Cursor)>)> = Vec::new();
    for count in [1u32, 4] {
        ends.push((count, read_to_the_end(&mut conn, count).await));
    }
    // cursors that differ: partition 0 one batch behind the others
    let (_, four) = &ends[1];
    let mut differ = four.clone();
    differ[0].1 = Cursor::at(four[0].1.upto_seq - 1_000, four[0].1.snap.clone());
    ends.push((4, differ));
    let mut conn = db.relay_session().await;
    for (count, cursors) in &ends {
        for _ in 0..20 {
            fetch_batches(&mut conn, &table, *count, cursors, &[], 500, i64::MAX)
                .await
                .expect("fetch");
        }
    }
    let plans = batch_statement_plans(&mut conn).await;
    assert_eq!(
        plans.len(),
        3,
        "one statement per partition count and walk: {plans:?}"
    );
    for p in &plans {
        assert!(
            p.generic_plans >= 14 && p.custom_plans <= 6,
            "planned at each call: {plans:?}"
        );
    }
}

/// The batch statement while a transaction of `open` rows stays open behind the cursor (it
/// began before 2 rows the cursor read and is still running), in a relay's session: its plan
/// and buffers.
async fn open_transaction_plan(open: i64) -> (u64, Vec<String>) {
    use outbox_diesel::relay::{Cursor, Partition, explain_batch_analyze};
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let bulk = format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'bulk', 'b-' || (i % 7), 'bulk.loaded', \
         jsonb_build_object('n', i) FROM generate_series(1, {open}) AS i"
    );
    let commit = hold_open(&db, &bulk);
    insert_rows_over(&db, 2, 2);
    db.execute("VACUUM ANALYZE outbox", "vacuum");
    let mut conn = db.relay_session().await;
    let cursor = batch_of_8(&mut conn, Cursor::start()).await.next;
    let plan = explain_batch_analyze(&mut conn, &table, Partition::ALL, &cursor, 8)
        .await
        .expect("explain");
    commit();
    (buffers(&plan), plan)
}

/// A transaction still open behind the cursor costs a batch nothing however many rows it has
/// written: its rows are not visible yet, and the batch does not look them up (each batch read
/// every row it had written so far, to find none visible: a bulk load held open for minutes
/// made every poll meanwhile read what it had written).
#[tokio::test]
async fn a_transaction_still_open_behind_the_cursor_costs_a_batch_nothing() {
    let (small, _) = open_transaction_plan(200).await;
    let (large, plan) = open_transaction_plan(20_000).await;
    assert_no_dearer(
        "a batch",
        (small, "with 200 rows of an open transaction"),
        (large, "with 20,000", &plan),
        10,
    );
}

/// Each part of a late pass costs what its rows do: the part after the first 8 of 20,000 late
/// rows reads no more than the same part of 200 (each part read every late row left, sorted
/// them and counted them: a pass was quadratic in its rows).
#[tokio::test]
async fn a_late_pass_reads_each_part_at_the_cost_of_the_part_not_of_the_pass() {
    let (small, _) = late_pass_plans(200, 0).await.part;
    let (large, plan) = late_pass_plans(20_000, 0).await.part;
    assert_no_dearer(
        "a pass's part",
        (small, "with 200 late rows"),
        (large, "with 20,000", &plan),
        20,
    );
}

/// A late pass begins at the cost of its first part: the batch that finds 20,000 late rows
/// reads no more than the one that finds 200 (it read, sorted and counted every late row, so
/// a bulk load of millions committed late made one batch of seconds).
#[tokio::test]
async fn a_late_pass_begins_at_the_cost_of_its_first_part() {
    let (small, _) = late_pass_plans(200, 0).await.first;
    let (large, plan) = late_pass_plans(20_000, 0).await.first;
    assert_no_dearer(
        "a pass's first batch",
        (small, "with 200 late rows"),
        (large, "with 20,000", &plan),
        20,
    );
}

/// Rows written while a late pass runs cost its parts nothing: a part after 20,000 rows were
/// written by transactions begun after the pass reads no more than one after none (each part
/// looked up every row written since the cursor's snapshot, to find the few at or below its
/// `seq`: a long pass under traffic read more at every part).
#[tokio::test]
async fn rows_written_during_a_late_pass_cost_its_parts_nothing() {
    let (quiet, _) = late_pass_plans(200, 0).await.part;
    let (busy, plan) = late_pass_plans(200, 20_000).await.part;
    assert_no_dearer(
        "a pass's part",
        (quiet, "with no rows since"),
        (busy, "with 20,000", &plan),
        20,
    );
}

/// The buffers of the batch statement of a relay reading all `count` partitions at one
/// cursor, after 8 writers' transactions of 3 rows each, open while the cursor was read past
/// later rows, have committed (their rows are late), in a relay's session.
async fn ended_writers_plan(count: u32) -> (u64, Vec<String>) {
    use outbox_diesel::relay::explain_batches_analyze;
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    insert_rows_over(&db, 2_000, 500);
    db.execute("VACUUM ANALYZE outbox", "vacuum");
    let inserts: Vec<String> = (0..8)
        .map(|w| {
            format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 SELECT gen_random_uuid(), 'order', 'w{w}-' || i, 'order.placed', '{{}}' \
                 FROM generate_series(1, 3) AS i"
            )
        })
        .collect();
    let commits: Vec<_> = inserts.iter().map(|i| hold_open(&db, i)).collect();
    insert_rows_over(&db, 2, 2);
    let mut conn = db.relay_session().await;
    let cursors = read_to_the_end(&mut conn, count).await;
    for commit in commits {
        commit();
    }
    // the plan the relay keeps: the sixth call's
    let mut plan = Vec::new();
    for _ in 0..6 {
        plan = explain_batches_analyze(&mut conn, &table, count, &cursors, 500)
            .await
            .expect("explain");
    }
    (buffers(&plan), plan)
}

/// A late row costs a relay one look-up of its transaction however many partitions it reads:
/// with 8 partitions the batch after 8 writers' transactions committed late reads no more than
/// with 1 (it looked each transaction up once per partition: 8 times the index descents).
#[tokio::test]
async fn late_rows_cost_one_look_up_however_many_partitions_a_relay_reads() {
    let (one, _) = ended_writers_plan(1).await;
    let (eight, plan) = ended_writers_plan(8).await;
    assert_no_dearer(
        "late rows of 8 writers",
        (one, "with 1 partition"),
        (eight, "with 8", &plan),
        30,
    );
}

/// A late pass recorded with its cursor: a new owner of the partition (another relay, or the
/// same one restarted) loads the pass and reads on after its last recorded part, so no row of
/// the pass is read twice; the audit view dates the rows read so far, the backlog no longer
/// counts them, and a relay of another mode taking over marks them published.
#[tokio::test]
async fn a_late_pass_recorded_goes_on_where_it_stood_under_a_new_owner() {
    use outbox_diesel::relay::{
        Cursor, Partition, Source, backlog, load_cursor, record_progress, settle_progress,
    };
    let db = TestDb::new();
    insert_rows_over(&db, 10, 10);
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let part = Partition { index: 0, count: 1 };
    let mut conn = db.relay_session().await;
    let step = async |conn: &mut diesel_async::AsyncPgConnection, cursor: &mut Cursor| {
        let batch = batch_of_8(conn, cursor.clone()).await;
        *cursor = batch.next.clone();
        batch
            .rows
            .iter()
            .map(|(r, s)| (r.seq, *s))
            .collect::<Vec<_>>()
    };
    let mut cursor = Cursor::start();
    let mut read: Vec<i64> = Vec::new();
    read.extend(step(&mut conn, &mut cursor).await.iter().map(|(s, _)| *s));
    read.extend(step(&mut conn, &mut cursor).await.iter().map(|(s, _)| *s));
    assert_eq!(read.len(), 10);
    let commit = hold_open(
        &db,
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'bulk', 'b-' || (i % 7), 'bulk.loaded', '{}' \
         FROM generate_series(1, 30) AS i",
    );
    insert_rows_over(&db, 4, 10);
    read.extend(step(&mut conn, &mut cursor).await.iter().map(|(s, _)| *s));
    assert_eq!(read.len(), 14, "the rows after the held ones");
    commit();

    // the first part of the pass: 8 of the 30 late rows, recorded with the pass
    let first = step(&mut conn, &mut cursor).await;
    assert_eq!(first.len(), 8);
    assert!(first.iter().all(|(_, s)| *s == Source::Late), "{first:?}");
    assert!(cursor.late.is_some(), "a pass: more late rows than a batch");
    read.extend(first.iter().map(|(s, _)| *s));
    record_progress(&mut conn, &table, &[(part, cursor.clone())])
        .await
        .expect("record");
    drop(conn);

    // a new owner: the pass is where it stood
    let mut conn = db.relay_session().await;
    let loaded = load_cursor(&mut conn, &table, part)
        .await
        .expect("load")
        .expect("a recorded cursor");
    assert_eq!(loaded, cursor, "the cursor with its pass");
    let dated = seqs_where(
        &db,
        "seq IN (SELECT seq FROM outbox_audit WHERE published_at IS NOT NULL)",
    );
    let mut so_far = read.clone();
    so_far.sort_unstable();
    assert_eq!(
        dated, so_far,
        "the audit view dates every row read, the pass's part too"
    );
    let waiting = backlog(&mut conn, &table)
        .await
        .expect("backlog")
        .unpublished;
    assert_eq!(waiting, 30 - 8, "the backlog: the pass's rows not read yet");

    let mut cursor = loaded;
    for _ in 0..10 {
        let got = step(&mut conn, &mut cursor).await;
        if got.is_empty() && cursor.late.is_none() {
            break;
        }
        read.extend(got.iter().map(|(s, _)| *s));
    }
    let mut seqs = read.clone();
    seqs.sort_unstable();
    seqs.dedup();
    assert_eq!(seqs.len(), read.len(), "no row read twice: {read:?}");
    assert_eq!(seqs, seqs_where(&db, "true"), "every row read");

    // recorded mid-pass, then settled by a relay of another mode: what was read is marked, the
    // pass's other rows are left to publish
    let db = recorded_mid_pass().await;
    let mut conn = db.relay_session().await;
    let marked = settle_progress(&mut conn, &table).await.expect("settle");
    assert_eq!(
        marked,
        4 + 8,
        "the rows read before the pass and its first part"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL"),
        12,
        "the pass's rows not read are left to publish"
    );

    // recorded mid-pass, then archived after the retention: each row read, dated
    let db = recorded_mid_pass().await;
    db.execute("CREATE TABLE outbox_archive (LIKE outbox)", "archive table");
    let mut conn = db.relay_session().await;
    let archive: outbox_diesel::OutboxTable = "outbox_archive".parse().expect("a name");
    let moved =
        outbox_diesel::relay::archive_read(&mut conn, &table, &archive, Duration::ZERO, 100)
            .await
            .expect("archive");
    assert_eq!(moved, 4 + 8);
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox_archive WHERE published_at IS NOT NULL"),
        12,
        "every archived row dated by the batch that read it"
    );
}

/// A table of 24 rows in one partition whose cursor is recorded in a late pass: 4 rows read,
/// then 8 of the 20 rows of a transaction committed after them.
async fn recorded_mid_pass() -> TestDb {
    use outbox_diesel::relay::{Cursor, Partition, record_progress};
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    insert_rows_over(&db, 2, 2);
    let commit = hold_open(
        &db,
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'bulk', 'b-1', 'bulk.loaded', '{}' \
         FROM generate_series(1, 20) AS i",
    );
    insert_rows_over(&db, 2, 2);
    let mut conn = db.relay_session().await;
    let first = batch_of_8(&mut conn, Cursor::start()).await;
    commit();
    let second = batch_of_8(&mut conn, first.next).await;
    assert_eq!((first.rows.len(), second.rows.len()), (4, 8));
    let cursor = second.next;
    assert!(cursor.late.is_some(), "in a pass");
    record_progress(
        &mut conn,
        &table,
        &[(Partition { index: 0, count: 1 }, cursor)],
    )
    .await
    .expect("record");
    db
}

// 10. `retry` releases the parked row and the rows held back behind it, which are published
// in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_releases_the_rows_held_back_behind_a_parked_one_in_order() {
    let db = TestDb::new();
    let stream = TestStream::new();
    record(&mut db.conn(), 1, 1);
    db.execute(
        "UPDATE outbox SET parked_at = now(), attempts = 5, last_error = 'rejected'",
        "park",
    );
    let parked_seq = db.scalar("SELECT min(seq) FROM outbox");
    record(&mut db.conn(), 30, 3); // acct-0 (behind the parked row), acct-1, acct-2
    let relay = Proc::spawn("relay", &mut relay_command(&db, &stream, &[]));
    wait_published(&db, 20, Duration::from_secs(30)).await;
    wait_until(
        Duration::from_secs(20),
        "acct-0's rows held back",
        || async { db.scalar("SELECT count(*) FROM outbox WHERE parked_at = '-infinity'") == 10 },
    )
    .await;
    let mut conn = db.async_conn().await;
    let released = outbox_diesel::relay::retry_parked(
        &mut conn,
        &outbox_diesel::OutboxTable::DEFAULT,
        Some(parked_seq),
    )
    .await
    .expect("retry");
    assert_eq!(
        released, 1,
        "one parked row released, with the 10 held back behind it"
    );
    // the relay's cursor had read past them: released (`'infinity'`), read apart
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL AND parked_at < 'infinity'"
        ),
        0
    );
    wait_published(&db, 31, Duration::from_secs(30)).await;
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL"),
        0,
        "published, the released rows are marked and no longer released"
    );
    drop(relay);
    let msgs = stream.read_all().await;
    let acct0: Vec<i64> = msgs
        .iter()
        .filter(|m| m.aggregate_id == "acct-0")
        .map(|m| m.payload["n"].as_i64().unwrap_or(-1))
        .collect();
    assert_eq!(acct0, vec![0, 0, 3, 6, 9, 12, 15, 18, 21, 24, 27]);
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

// ---------------------------------------------------------------------------------------------
// 21. `outbox-relay status` as a role that may not read the lock table (its database revoked
// `pg_lock_status` from PUBLIC, as a hardened one may): the membership and ownership queries
// failed, and status printed `relays 0` and "no relay holds a partition" while a relay held
// it. Now it says that those figures are unknown, and why (`unread` in the JSON).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_the_figures_it_cannot_read_instead_of_reporting_none() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let _relay = Relay::start(relay_command(&db, &stream, &[]));
    wait_until(
        Duration::from_secs(20),
        "the relay owns its partition",
        || async { support::partition_owners(&db).len() == 1 },
    )
    .await;
    let role = Role::relay(&db);
    db.execute(
        "REVOKE EXECUTE ON FUNCTION pg_lock_status() FROM PUBLIC",
        "revoke the lock table from PUBLIC in this database",
    );
    let status = |args: &[&str]| {
        let out = Command::new(support::relay_bin())
            .env_clear()
            .arg("status")
            .args(["--database-url", &role.url()])
            .args(args)
            .output()
            .expect("run outbox-relay status");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, text, err) = status(&[]);
    assert_eq!(code, Some(0), "the backlog is readable: {text}{err}");
    for line in ["relays           unknown: ", "owners           unknown: "] {
        assert!(text.contains(line), "{line:?} in:\n{text}");
    }
    assert!(
        text.contains("pg_lock_status"),
        "the server's reason:\n{text}"
    );
    assert!(!text.contains("relays           0"), "{text}");
    let (_, json, _) = status(&["--json"]);
    let json: serde_json::Value = serde_json::from_str(&json).expect("status --json");
    let unread: Vec<&str> = json["unread"]
        .as_array()
        .map(|a| a.iter().filter_map(|u| u["figure"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(unread, ["owners", "relays"], "{json}");
    // the table's owner reads everything: no `unread`
    let out = Command::new(support::relay_bin())
        .env_clear()
        .args(["status", "--json", "--database-url", &db.url])
        .output()
        .expect("run outbox-relay status");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json");
    assert!(json.get("unread").is_none(), "{json}");
    assert_eq!(json["relays"].as_array().map(Vec::len), Some(1), "{json}");
}

// 14. decisions on the server's state and codes, not on its words

/// Connects to `url` for the reader (diesel-async).
async fn reader_conn(url: &str) -> diesel_async::AsyncPgConnection {
    use diesel_async::AsyncConnection;
    diesel_async::AsyncPgConnection::establish(url)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_sorts_its_errors_alike_when_the_server_speaks_german() {
    use outbox_diesel::OutboxTable;
    use outbox_diesel::wal::{WalError, WalReader, pending_age_seconds};
    use support::servers::PgCluster;

    let mut cluster = PgCluster::start_german();
    let db = TestDb::on(&cluster.base_url());
    let mut admin = db.conn();
    let said = diesel::sql_query("SELECT 1/0")
        .execute(&mut admin)
        .expect_err("a division by zero")
        .to_string();
    assert!(
        said.contains("Division durch Null"),
        "the server speaks German: {said}"
    );
    // a role with the README's grants only: neither the table's owner nor REPLICATION, no
    // CREATE on the schema
    diesel::connection::SimpleConnection::batch_execute(
        &mut admin,
        &format!(
            "CREATE ROLE plain LOGIN; GRANT CONNECT ON DATABASE {} TO plain; \
             GRANT SELECT, UPDATE, DELETE ON outbox TO plain",
            db.name
        ),
    )
    .expect("a plain role");
    let plain_url = db.url.replacen("postgres@", "plain@", 1);
    let mut plain = reader_conn(&plain_url).await;
    let reader = || WalReader::new(OutboxTable::DEFAULT, "german_slot", "german_pub");

    let e = reader()
        .setup(&mut plain)
        .await
        .expect_err("no publication right");
    assert!(
        matches!(e, WalError::PublicationRight { .. }),
        "not the table's owner: {e:?}"
    );
    diesel::sql_query(
        "CREATE PUBLICATION german_pub FOR TABLE outbox WITH (publish = 'insert, update')",
    )
    .execute(&mut admin)
    .expect("the publication, made by the owner");
    let e = reader()
        .setup(&mut plain)
        .await
        .expect_err("no record right");
    assert!(
        matches!(e, WalError::RecordRight { .. }),
        "no CREATE on the schema: {e:?}"
    );
    // the owner's reader makes the record and the slot; the plain role may write the record
    let mut owner = reader_conn(&db.url).await;
    reader()
        .setup(&mut owner)
        .await
        .expect("the owner's set-up");
    diesel::sql_query("GRANT SELECT, INSERT, UPDATE ON outbox_relay_slots TO plain")
        .execute(&mut admin)
        .expect("grant the record");
    let e = WalReader::new(OutboxTable::DEFAULT, "german_other_slot", "german_pub")
        .setup(&mut plain)
        .await
        .expect_err("no replication right");
    assert!(
        matches!(e, WalError::ReplicationRight { .. }),
        "a role without REPLICATION makes a slot: {e:?}"
    );

    // the slot held by another session (as by a running reader) is busy, not a failure
    let mut holder = support::Proc::spawn(
        "pg_recvlogical",
        Command::new("pg_recvlogical")
            .args([
                "-d",
                &db.url,
                "--slot",
                "german_slot",
                "--start",
                "-f",
                "/dev/null",
            ])
            .args([
                "-o",
                "proto_version=1",
                "-o",
                "publication_names=german_pub",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    wait_until(Duration::from_secs(10), "the slot to be active", || async {
        db.scalar(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'german_slot' AND active",
        ) == 1
    })
    .await;
    let e = pending_age_seconds(&mut owner, "german_slot", "german_pub")
        .await
        .expect_err("the slot is in use");
    assert!(matches!(e, WalError::SlotBusy { .. }), "a busy slot: {e:?}");
    holder.kill();
    wait_until(Duration::from_secs(10), "the slot to be let go", || async {
        db.scalar("SELECT count(*) FROM pg_replication_slots WHERE active") == 0
    })
    .await;

    // wal_level below logical: the level, whatever the words (logical slots must go first)
    drop((plain, owner));
    diesel::sql_query("SELECT pg_drop_replication_slot('german_slot')")
        .execute(&mut admin)
        .expect("drop the slot");
    drop(admin);
    cluster.settings.push("wal_level=replica".into());
    cluster.restart();
    let mut owner = reader_conn(&db.url).await;
    let e = WalReader::new(OutboxTable::DEFAULT, "german_third_slot", "german_pub")
        .setup(&mut owner)
        .await
        .expect_err("wal_level replica");
    assert!(matches!(e, WalError::WalLevel(_)), "wal_level: {e:?}");
    drop(owner);
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
