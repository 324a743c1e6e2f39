//! Scale-out: partitioned ordered relays, competing unordered workers, rows that commit out
//! of `seq` order, and poison rows. Relays run as real `outbox-relay` processes.

mod support;

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::time::Duration;

use diesel::prelude::*;
use outbox_diesel::OutboxExt;
use support::events::{Changed, changed};
use support::{
    Proc, TestDb, TestStream, by_aggregate, relay_bin, relay_command, wait_published, wait_until,
};

fn relay(name: &str, db: &TestDb, stream: &TestStream, args: &[&str]) -> Proc {
    Proc::spawn(name, &mut relay_command(db, stream, args))
}

/// Message ids per aggregate in `seq` order: commit order when each aggregate's writers are
/// serialised, as the writers here are.
fn expected_order(db: &TestDb) -> HashMap<String, Vec<String>> {
    use outbox_diesel::schema::outbox::dsl::*;
    let rows: Vec<(uuid::Uuid, String)> = outbox
        .select((id, aggregate_id))
        .order(seq)
        .load(&mut db.conn())
        .expect("rows");
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    for (i, a) in rows {
        out.entry(a).or_default().push(i.to_string());
    }
    out
}

/// Starts `writers` threads, each committing `per_writer` transactions of `batch` events of
/// one aggregate, locking the aggregate first (the documented ordering rule).
fn start_writers(
    db: &TestDb,
    writers: usize,
    per_writer: usize,
    batch: usize,
    aggregates: usize,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..writers)
        .map(|w| {
            let url = db.url.clone();
            std::thread::spawn(move || {
                let mut conn = PgConnection::establish(&url).expect("connect");
                for i in 0..per_writer {
                    let n = (w * per_writer + i) as i64;
                    let agg = format!("acct-{}", (n as usize * 7919 + w) % aggregates);
                    let events: Vec<Changed> = (0..batch)
                        .map(|k| changed(&agg, n * 100 + k as i64))
                        .collect();
                    conn.transaction(|conn| {
                        diesel::sql_query("SELECT pg_advisory_xact_lock(hashtext($1))")
                            .bind::<diesel::sql_types::Text, _>(&agg)
                            .execute(conn)?;
                        conn.record_events(&events)
                    })
                    .expect("commit");
                }
            })
        })
        .collect()
}

/// How often PostgreSQL's statistics say `index` was scanned (flushed by the sessions that
/// scanned it, at most a second after).
async fn index_scans(db: &TestDb, index: &str) -> i64 {
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    db.scalar(&format!(
        "SELECT COALESCE((SELECT idx_scan FROM pg_stat_user_indexes \
         WHERE indexrelname = '{index}'), -1)"
    ))
}

/// The relays read their partitions by the partition index of 16 (`outbox-relay index`):
/// each reads only its own partitions' rows, each partition from its own cursor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_sixteen_partitions_keep_commit_order_per_aggregate_through_a_kill() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let (code, out, err) = cli(&db, &["index", "--partitions", "16"]);
    assert_eq!(code, 0, "{out}{err}");
    let args = ["--partitions", "16", "--batch-size", "200"];
    let mut relays: Vec<Proc> = (0..3)
        .map(|i| relay(&format!("relay-{i}"), &db, &stream, &args))
        .collect();

    // the three relays share the 16 partitions: 5 or 6 each, one owner per partition
    wait_until(
        Duration::from_secs(20),
        "16 partitions spread over 3 relays",
        || async {
            let o = support::partition_owners(&db);
            let mut per_pid: HashMap<i32, usize> = HashMap::new();
            for (_, pid) in &o {
                *per_pid.entry(*pid).or_default() += 1;
            }
            o.len() == 16 && per_pid.len() == 3 && per_pid.values().all(|&n| (5..=6).contains(&n))
        },
    )
    .await;

    // 8 writers, 1,000 aggregates, 50,000 events (5 per transaction)
    let writers = start_writers(&db, 8, 1250, 5, 1000);
    wait_published(&db, 5_000, Duration::from_secs(120)).await;
    relays[1].kill(); // kill -9 mid-run
    let partitions: HashSet<i32> = support::partition_owners(&db)
        .iter()
        .map(|(p, _)| *p)
        .collect();
    assert!(partitions.len() <= 16);
    tokio::time::sleep(Duration::from_millis(500)).await;
    relays[1] = relay("relay-1b", &db, &stream, &args);
    for w in writers {
        w.join().expect("writer");
    }
    wait_published(&db, 50_000, Duration::from_secs(300)).await;
    // each partition has exactly one owner, never two
    let o = support::partition_owners(&db);
    let unique: HashSet<i32> = o.iter().map(|(p, _)| *p).collect();
    assert_eq!(unique.len(), o.len(), "a partition with two owners: {o:?}");
    drop(relays);

    assert!(
        index_scans(&db, "outbox_ready_p16").await > 0,
        "the relays read by the partition index"
    );

    let got = stream.read_all().await;
    let ids: HashSet<&str> = got.iter().map(|m| m.msg_id.as_str()).collect();
    assert_eq!(ids.len(), 50_000, "every event is in the stream");
    assert_eq!(got.len(), 50_000, "and only once");
    let expected = expected_order(&db);
    let seen = by_aggregate(&got);
    assert_eq!(seen.len(), expected.len());
    for (agg, order) in &expected {
        assert_eq!(seen.get(agg), Some(order), "per-aggregate order of {agg}");
    }
}

#[tokio::test]
async fn unordered_workers_deliver_every_event_exactly_once() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let writers = start_writers(&db, 4, 500, 4, 100);
    let _a = relay(
        "unordered-a",
        &db,
        &stream,
        &[
            "--mode",
            "unordered",
            "--workers",
            "4",
            "--batch-size",
            "50",
        ],
    );
    let _b = relay(
        "unordered-b",
        &db,
        &stream,
        &[
            "--mode",
            "unordered",
            "--workers",
            "2",
            "--batch-size",
            "50",
        ],
    );
    for w in writers {
        w.join().expect("writer");
    }
    wait_published(&db, 8_000, Duration::from_secs(120)).await;
    let got = stream.read_all().await;
    let ids: HashSet<&str> = got.iter().map(|m| m.msg_id.as_str()).collect();
    assert_eq!(got.len(), 8_000);
    assert_eq!(ids.len(), 8_000);
}

/// A transaction that inserted an earlier `seq` and commits after later ones is not skipped,
/// and within one aggregate the stream keeps commit order.
async fn held_open_transactions(mode_args: &[&str]) {
    let (db, stream) = (TestDb::new(), TestStream::new());
    db.execute(
        "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL)",
        "accounts",
    );
    db.execute("INSERT INTO accounts VALUES ('A', 0), ('B', 0)", "seed");
    let _relay = relay("relay", &db, &stream, mode_args);

    // T1 locks A, records a1 (the lower seq) and stays open
    let mut t1 = db.conn();
    diesel::sql_query("BEGIN").execute(&mut t1).expect("begin");
    diesel::sql_query("UPDATE accounts SET balance = balance + 1 WHERE id = 'A'")
        .execute(&mut t1)
        .expect("lock A");
    let row = outbox_diesel::Outbox::default();
    // raw BEGIN is invisible to Diesel's transaction manager: record with plain SQL here
    diesel::sql_query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('01900000-0000-7000-8000-0000000000a1', 'account', 'A', 'account.changed', '{\"n\": 1}')",
    )
    .execute(&mut t1)
    .expect("a1");
    let _ = row;

    // T2 writes B and commits: published while T1 is still open
    db.conn()
        .transaction(|c| {
            diesel::sql_query("UPDATE accounts SET balance = balance + 1 WHERE id = 'B'")
                .execute(c)?;
            c.record_event(&changed("B", 1))
        })
        .expect("b1");
    wait_until(Duration::from_secs(20), "b1 in the stream", || async {
        stream.count().await == 1
    })
    .await;

    // T3 wants A too: it waits for T1's row lock, then records a2
    let url = db.url.clone();
    let t3 = std::thread::spawn(move || {
        let mut c = PgConnection::establish(&url).expect("connect");
        c.transaction(|c| {
            diesel::sql_query("UPDATE accounts SET balance = balance + 1 WHERE id = 'A'")
                .execute(c)?;
            c.record_event(&changed("A", 2))
        })
        .expect("a2");
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!t3.is_finished(), "T3 waits for T1's lock on A");
    diesel::sql_query("COMMIT")
        .execute(&mut t1)
        .expect("commit T1");
    t3.join().expect("T3");

    wait_until(Duration::from_secs(20), "3 messages", || async {
        stream.count().await == 3
    })
    .await;
    let got = stream.read_all().await;
    let order: Vec<(String, String)> = got
        .iter()
        .map(|m| (m.aggregate_id.clone(), m.payload["n"].to_string()))
        .collect();
    assert_eq!(
        order,
        [
            ("B".into(), "1".into()),
            ("A".into(), "1".into()),
            ("A".into(), "2".into())
        ],
        "the held-open row is published when it commits, before the later write of its aggregate"
    );
}

#[tokio::test]
async fn held_open_transaction_is_not_skipped_and_keeps_commit_order_ordered() {
    held_open_transactions(&[]).await;
}

#[tokio::test]
async fn held_open_transaction_is_not_skipped_and_keeps_commit_order_unordered() {
    held_open_transactions(&["--mode", "unordered", "--workers", "1"]).await;
}

/// A transaction held open while later rows are published commits 500 rows, twenty-five
/// batches of `--batch-size 20`: the relay reads them in parts (a late pass) and publishes each
/// once, in `seq` order within each aggregate, before what its aggregates record after it.
#[tokio::test]
async fn a_late_transaction_of_many_batches_is_published_once_and_in_order() {
    late_transaction_of_many_batches(&[]).await;
}

/// The same with `--delete-published`: the pass's rows are deleted as they are acked, and the
/// pass goes on past them.
#[tokio::test]
async fn a_late_transaction_of_many_batches_is_published_once_and_in_order_deleting() {
    late_transaction_of_many_batches(&["--delete-published"]).await;
}

/// A relay killed (SIGKILL) in the middle of a late pass of 50,000 rows read in parts of 20
/// (once it has sent 5,000 of them),
/// and another started in its place: the stream holds each row once, and the second relay goes
/// on where the pass's last recorded part stood, so what the first published is not sent again
/// (a plain NATS subscriber sees every publish, those JetStream drops as duplicates included).
/// Before passes were recorded, the second relay sent the pass again from its start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_in_a_late_pass_is_followed_by_one_that_goes_on_where_it_stood() {
    use futures_util::StreamExt;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    const BULK: i64 = 50_000;
    let (db, stream) = (TestDb::new(), TestStream::new());
    let args = ["--batch-size", "20", "--max-in-flight", "40"];
    // every publish of a bulk row, counted as it passes
    let nats = async_nats::connect(&stream.nats_url)
        .await
        .expect("connect to NATS");
    let mut sub = nats
        .subscribe(format!("{}.bulk.>", stream.prefix))
        .await
        .expect("subscribe");
    nats.flush().await.expect("flush");
    let sent = Arc::new(AtomicU64::new(0));
    let counter = {
        let sent = sent.clone();
        tokio::spawn(async move {
            while sub.next().await.is_some() {
                sent.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let mut first = relay("first relay", &db, &stream, &args);
    let mut t1 = db.conn();
    diesel::sql_query("BEGIN").execute(&mut t1).expect("begin");
    diesel::sql_query(format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'bulk', 'b-' || (i % 5), 'bulk.loaded', \
         jsonb_build_object('n', i) FROM generate_series(1, {BULK}) AS i"
    ))
    .execute(&mut t1)
    .expect("the held rows");
    db.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'order', 'o-1', 'order.placed', '{}')",
        "a later row",
    );
    wait_until(
        Duration::from_secs(20),
        "the later row published",
        || async { stream.count().await == 1 },
    )
    .await;
    diesel::sql_query("COMMIT")
        .execute(&mut t1)
        .expect("commit the held rows");
    // killed once it has sent 5,000 rows of the pass, while it goes on
    let started = std::time::Instant::now();
    while sent.load(Ordering::Relaxed) < 5_000 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "5,000 rows of the pass not sent in a minute"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.kill();
    let sent_by_first = sent.load(Ordering::Relaxed);
    assert!(sent_by_first < BULK as u64 / 2, "killed during the pass");
    let recorded = db.scalar("SELECT COALESCE(max(late_after_seq), 0) FROM outbox_progress");

    let _second = relay("second relay", &db, &stream, &args);
    wait_until(
        Duration::from_secs(180),
        "every row in the stream",
        || async { stream.count().await > BULK as u64 },
    )
    .await;
    wait_until(
        Duration::from_secs(20),
        "the subscriber caught up",
        || async { sent.load(Ordering::Relaxed) >= BULK as u64 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    counter.abort();
    let sent = sent.load(Ordering::Relaxed);
    let again = sent - BULK as u64;
    println!(
        "killed with {recorded} rows of the pass recorded and {sent_by_first} sent; \
         {sent} sends in all: {again} sent again"
    );
    let got = stream.read_all().await;
    let ids: HashSet<&str> = got.iter().map(|m| m.msg_id.as_str()).collect();
    assert_eq!(
        (got.len(), ids.len()),
        (BULK as usize + 1, BULK as usize + 1),
        "each row once in the stream"
    );
    assert!(
        again < 1_000,
        "{again} rows sent again after the kill, with {recorded} of the pass recorded"
    );
}

async fn late_transaction_of_many_batches(extra: &[&str]) {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let mut args = vec!["--partitions", "2", "--batch-size", "20"];
    args.extend_from_slice(extra);
    let (_relay, metrics) = support::relay_with_metrics(&db, &stream, &args);
    let bulk = |from: i64, to: i64| {
        format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'bulk', 'b-' || (i % 5), 'bulk.loaded', \
             jsonb_build_object('n', i) FROM generate_series({from}, {to}) AS i"
        )
    };
    let mut t1 = db.conn();
    diesel::sql_query("BEGIN").execute(&mut t1).expect("begin");
    diesel::sql_query(bulk(1, 500))
        .execute(&mut t1)
        .expect("the held rows");
    // other aggregates commit meanwhile and are published
    db.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || i, 'order.placed', '{}' \
         FROM generate_series(1, 50) AS i",
        "later rows",
    );
    wait_until(
        Duration::from_secs(20),
        "the later rows published",
        || async { stream.count().await == 50 },
    )
    .await;
    diesel::sql_query("COMMIT")
        .execute(&mut t1)
        .expect("commit the held rows");
    // each bulk aggregate records once more after the commit
    db.execute(&bulk(501, 505), "after the commit");
    wait_until(Duration::from_secs(60), "555 messages", || async {
        stream.count().await >= 555
    })
    .await;
    if extra.contains(&"--delete-published") {
        wait_until(Duration::from_secs(20), "the rows deleted", || async {
            db.scalar("SELECT count(*) FROM outbox") == 0
        })
        .await;
    } else {
        wait_published(&db, 555, Duration::from_secs(20)).await;
    }
    let got = stream.read_all().await;
    let ids: HashSet<&str> = got.iter().map(|m| m.msg_id.as_str()).collect();
    assert_eq!((got.len(), ids.len()), (555, 555), "each row once");
    let (_, body) = support::http_get(&metrics, "/metrics")
        .await
        .expect("the relay's metrics");
    let passes: f64 = body
        .lines()
        .find_map(|l| l.strip_prefix("outbox_late_passes_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    assert!(passes >= 1.0, "a late pass counted:\n{body}");
    assert!(
        db.scalar("SELECT count(*) FROM outbox_progress WHERE late_after_seq IS NOT NULL") >= 1,
        "the pass's parts recorded with their cursor"
    );
    let mut per_aggregate: HashMap<&str, Vec<i64>> = HashMap::new();
    for m in got.iter().filter(|m| m.aggregate_id.starts_with("b-")) {
        per_aggregate
            .entry(m.aggregate_id.as_str())
            .or_default()
            .push(m.payload["n"].as_i64().expect("n"));
    }
    assert_eq!(per_aggregate.len(), 5);
    for (aggregate, ns) in per_aggregate {
        assert_eq!(ns.len(), 101, "{aggregate}");
        assert!(
            ns.windows(2).all(|w| w[0] < w[1]),
            "{aggregate}: in seq order, the row after the commit last: {ns:?}"
        );
        assert!(ns[100] > 500, "{aggregate}: {ns:?}");
    }
}

/// A relay owning four partitions, with rows in one of them only: every step moves all four
/// cursors to the walk's end, but the three without rows of their own are recorded once a
/// second at most, not once a step (the progress table grew by a row per owned partition and
/// step).
#[tokio::test]
async fn cursors_that_move_only_with_the_walk_are_recorded_once_a_second_at_most() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let _relay = relay("relay", &db, &stream, &["--partitions", "4"]);
    // an aggregate of partition 0
    let i = db.scalar(
        "SELECT min(i) FROM generate_series(1, 100) AS i \
         WHERE ('x' || substr(md5('a-' || i), 1, 7))::bit(28)::integer % 4 = 0",
    );
    let started = std::time::Instant::now();
    for n in 0..40 {
        db.execute(
            &format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES (gen_random_uuid(), 'account', 'a-{i}', 'account.changed', '{{\"n\": {n}}}')"
            ),
            "a row of partition 0",
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    wait_published(&db, 40, Duration::from_secs(20)).await;
    // the last move of each cursor is recorded within a second
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let seconds = started.elapsed().as_secs_f64().ceil() as i64;
    let rows = |p: i64| {
        db.scalar(&format!(
            "SELECT count(*) FROM outbox_progress WHERE partitions = 4 AND partition = {p}"
        ))
    };
    let hot = rows(0);
    let cold: Vec<i64> = (1..4).map(rows).collect();
    eprintln!("progress rows in {seconds} s: partition 0 {hot}, the others {cold:?}");
    assert!(
        hot >= 10,
        "partition 0's cursor is recorded as its rows are acked: {hot}"
    );
    for p in 1..4 {
        let cold = rows(p);
        assert!(
            (1..=seconds + 2).contains(&cold),
            "partition {p}: {cold} progress rows in {seconds} s (partition 0: {hot})"
        );
    }
}

/// A row in doubt and older than the duplicate window whose aggregate has a later row in the
/// stream is not proof that it was published: a transaction that committed after the later
/// row's was published (a late commit) has never been sent. The relay decides by the row's
/// message id alone, so the late row is published, once.
#[tokio::test]
async fn a_late_commit_older_than_the_duplicate_window_is_published_not_reconciled_away() {
    use async_nats::jetstream::stream::Config;
    let (db, stream) = (TestDb::new(), TestStream::new());
    let window = Duration::from_secs(1);
    stream
        .js()
        .await
        .create_stream(Config {
            duplicate_window: window,
            ..stream.config()
        })
        .await
        .expect("a stream with a 1 s duplicate window");
    let _relay = relay("relay", &db, &stream, &[]);

    // T1 records a1 (the earlier id and seq) and stays open; its publishing was tried before
    // (attempts = 1): the row is in doubt once it commits
    let late = "01900000-0000-7000-8000-0000000000a1";
    let mut t1 = db.conn();
    diesel::sql_query("BEGIN").execute(&mut t1).expect("begin");
    diesel::sql_query(format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, attempts) \
         VALUES ('{late}', 'account', 'A', 'account.changed', '{{\"n\": 1}}', 1)"
    ))
    .execute(&mut t1)
    .expect("a1");
    // a later row of the same aggregate commits and is published meanwhile
    db.conn()
        .transaction(|c| c.record_event(&changed("A", 2)))
        .expect("a2");
    wait_until(Duration::from_secs(20), "a2 in the stream", || async {
        stream.count().await == 1
    })
    .await;
    // T1 commits after the window has passed since a1 was recorded (the scenario itself)
    tokio::time::sleep(window * 2).await;
    diesel::sql_query("COMMIT")
        .execute(&mut t1)
        .expect("commit T1");

    wait_published(&db, 2, Duration::from_secs(20)).await;
    let got = stream.read_all().await;
    let ids: Vec<&str> = got.iter().map(|m| m.msg_id.as_str()).collect();
    assert_eq!(
        ids.iter().filter(|&&i| i == late).count(),
        1,
        "the late row is in the stream exactly once: {ids:?}"
    );
    assert_eq!(got.len(), 2, "{ids:?}");
}

fn cli(db: &TestDb, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(relay_bin())
        .env("DATABASE_URL", &db.url)
        .args(args)
        .output()
        .expect("run outbox-relay");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A stream that refuses messages over 1,000 bytes, as a server's limits can.
async fn small_stream(stream: &TestStream) {
    use async_nats::jetstream::stream::Config;
    stream
        .js()
        .await
        .create_stream(Config {
            max_message_size: 1000,
            ..stream.config()
        })
        .await
        .expect("create stream");
}

async fn allow_big_messages(stream: &TestStream) {
    use async_nats::jetstream::stream::Config;
    stream
        .js()
        .await
        .update_stream(Config {
            max_message_size: -1,
            ..stream.config()
        })
        .await
        .expect("update stream");
}

/// A stream that refuses messages over 1,000 bytes, and aggregate P's two events: the first
/// too large for it (the poison row), the second behind it. The connection that recorded them.
async fn poison_row(db: &TestDb, stream: &TestStream) -> PgConnection {
    small_stream(stream).await;
    let mut conn = db.conn();
    let big = Changed {
        account: "P".into(),
        n: 1,
        blob: Some("x".repeat(2000)),
    };
    conn.transaction(|c| c.record_event(&big)).expect("p1");
    conn.transaction(|c| c.record_event(&changed("P", 2)))
        .expect("p2");
    conn
}

#[tokio::test]
async fn a_poison_row_parks_without_stopping_other_aggregates_and_is_retried_from_the_cli() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let mut conn = poison_row(&db, &stream).await;
    for n in 0..5 {
        conn.transaction(|c| c.record_event(&changed("Q", n)))
            .expect("q");
    }
    let _relay = relay("relay", &db, &stream, &["--max-attempts", "2"]);
    wait_published(&db, 5, Duration::from_secs(30)).await;
    wait_until(
        Duration::from_secs(30),
        "P's first event parked",
        // a held-back row is set aside with parked_at = '-infinity'
        || async { db.scalar("SELECT count(*) FROM outbox WHERE parked_at > '-infinity'") == 1 },
    )
    .await;
    // P's second event is held back behind the parked one; Q flowed
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL"),
        2
    );
    let got = stream.read_all().await;
    assert!(
        got.iter().all(|m| m.aggregate_id == "Q"),
        "only Q's events: {got:?}"
    );

    let (code, out, err) = cli(&db, &["parked", "--json"]);
    assert_eq!(code, 0, "{err}");
    let parked: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(parked.as_array().map(Vec::len), Some(1), "{out}");
    assert_eq!(parked[0]["aggregate_id"], "P");
    assert_eq!(parked[0]["held_back"], 1);
    assert!(
        parked[0]["last_error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "{out}"
    );
    let (code, out, _) = cli(&db, &["parked"]);
    assert_eq!(code, 0);
    assert!(out.contains("retry"), "{out}");
    let (code, _, err) = cli(&db, &["retry", "--seq", "999999"]);
    assert_ne!(code, 0, "retrying an unknown row is an error");
    assert!(err.contains("no parked row"), "{err}");

    allow_big_messages(&stream).await;
    let (code, out, err) = cli(&db, &["retry", "--all"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("released 1"), "{out}");
    wait_published(&db, 7, Duration::from_secs(30)).await;
    let got = stream.read_all().await;
    let p: Vec<i64> = got
        .iter()
        .filter(|m| m.aggregate_id == "P")
        .filter_map(|m| m.payload["n"].as_i64())
        .collect();
    assert_eq!(p, [1, 2], "P's events in order once retried");
}

#[tokio::test]
async fn a_poison_row_is_skipped_in_unordered_mode() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let mut conn = poison_row(&db, &stream).await;
    conn.transaction(|c| c.record_event(&changed("Q", 1)))
        .expect("q");
    let _relay = relay(
        "relay",
        &db,
        &stream,
        &[
            "--mode",
            "unordered",
            "--workers",
            "2",
            "--max-attempts",
            "2",
        ],
    );
    wait_published(&db, 2, Duration::from_secs(30)).await;
    wait_until(Duration::from_secs(30), "parked", || async {
        db.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL") == 1
    })
    .await;
    assert_eq!(stream.count().await, 2);
}

#[tokio::test]
async fn a_relay_with_another_partition_count_waits_for_the_old_ones() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let mut old = relay("old", &db, &stream, &["--partitions", "4"]);
    wait_until(Duration::from_secs(20), "old relay owns 4", || async {
        support::partition_owners(&db).len() == 4
    })
    .await;
    let _new = relay("new", &db, &stream, &["--partitions", "8"]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let o = support::partition_owners(&db);
    assert_eq!(
        o.len(),
        4,
        "the new relay takes nothing while the old one runs: {o:?}"
    );
    assert!(o.iter().all(|(_, pid)| *pid == o[0].1));
    old.signal("TERM");
    assert_eq!(
        old.wait_exit(Duration::from_secs(10)),
        Some(0),
        "clean exit on SIGTERM"
    );
    wait_until(Duration::from_secs(20), "the new relay owns 8", || async {
        support::partition_owners(&db).len() == 8
    })
    .await;
    // and events flow with the new count
    db.conn()
        .transaction(|c| c.record_event(&changed("Z", 1)))
        .expect("z");
    wait_published(&db, 1, Duration::from_secs(20)).await;
}

/// `outbox-relay index` makes the partition index once, refuses a count it does not serve and
/// a table that is not there; relays running without it say what it would spare them, and
/// read by it once it is made, publishing on in order.
#[tokio::test]
async fn relays_find_the_partition_index_made_while_they_run() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    for (args, says) in [
        (&["index", "--partitions", "1"][..], "--partitions"),
        (&["index", "--partitions", "1025"][..], "--partitions"),
        (&["index"][..], "--partitions"),
        (
            &["index", "--partitions", "4", "--table", "nope"][..],
            "does not exist",
        ),
    ] {
        let (code, out, err) = cli(&db, args);
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let mut relays: Vec<support::Relay> = (0..2)
        .map(|_| {
            let mut cmd = relay_command(&db, &stream, &["--partitions", "4"]);
            cmd.env("RUST_LOG", "info");
            support::Relay::start(cmd)
        })
        .collect();
    wait_until(
        Duration::from_secs(20),
        "4 partitions over 2 relays",
        || async {
            let o = support::partition_owners(&db);
            o.len() == 4 && o.iter().filter(|(_, pid)| *pid == o[0].1).count() == 2
        },
    )
    .await;
    let record = |from: i64| {
        let mut conn = db.conn();
        for i in from..from + 100 {
            conn.transaction(|c| c.record_event(&changed(&format!("a-{}", i % 10), i)))
                .expect("record");
        }
    };
    record(0);
    wait_published(&db, 100, Duration::from_secs(30)).await;
    wait_until(
        Duration::from_secs(10),
        "each relay says what the index would spare it",
        || async {
            relays
                .iter()
                .all(|r| r.logs().contains("outbox-relay index --partitions 4"))
        },
    )
    .await;

    let (code, out, err) = cli(&db, &["index", "--partitions", "4"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("made"), "{out}");
    let (code, out, err) = cli(&db, &["index", "--partitions", "4"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("already"), "made once: {out}");
    wait_until(
        Duration::from_secs(20),
        "both relays find the index",
        || async {
            relays
                .iter()
                .all(|r| r.logs().contains("the table has the partition index"))
        },
    )
    .await;
    record(100);
    wait_published(&db, 200, Duration::from_secs(30)).await;
    assert!(
        index_scans(&db, "outbox_ready_p4").await > 0,
        "the relays read by the partition index"
    );
    // two relays more: each of the four reads one partition by the index (a statement of one
    // walk, which PostgreSQL once refused at every batch)
    relays.extend((0..2).map(|_| {
        let mut cmd = relay_command(&db, &stream, &["--partitions", "4"]);
        cmd.env("RUST_LOG", "info");
        support::Relay::start(cmd)
    }));
    wait_until(
        Duration::from_secs(20),
        "4 partitions over 4 relays",
        || async {
            let o = support::partition_owners(&db);
            let mut pids: Vec<_> = o.iter().map(|(_, pid)| *pid).collect();
            pids.sort_unstable();
            pids.dedup();
            o.len() == 4 && pids.len() == 4
        },
    )
    .await;
    record(200);
    wait_published(&db, 300, Duration::from_secs(30)).await;
    for r in &relays {
        assert!(
            !r.logs().contains("session lost"),
            "a relay lost its session:\n{}",
            r.logs()
        );
    }
    drop(relays);
    let got = stream.read_all().await;
    assert_eq!(got.len(), 300, "each event once");
    assert_eq!(
        by_aggregate(&got),
        expected_order(&db),
        "in each aggregate's order"
    );
}
