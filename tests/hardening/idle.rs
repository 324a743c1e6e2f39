//! What an idle relay asks PostgreSQL.

use super::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The ordered relay's batch statement.
const BATCH: &str = "WITH cur AS MATERIALIZED%";
/// The unordered workers' claim.
const CLAIM: &str = "%FOR UPDATE SKIP LOCKED%";
/// The idle poll's question, its first statement.
const QUESTION: &str = "SELECT pg_current_snapshot()::text AS snap";
/// How many times a relay polling every 50 ms may ask it in 3 s: once a poll, whatever its
/// workers.
const QUESTIONS: i64 = 75;
/// The ordered relay's looks at the shares, once a second: the relays of the table, and the
/// partition index (as `pg_stat_statements` writes them, each constant a `$n`).
const LOOKS: [&str; 2] = [
    "SELECT t.pid, (c.objid::bigint%",
    "SELECT EXISTS (SELECT $% FROM pg_index%",
];

/// Writes another table of `db` every 10 ms until `stop`: transactions that end, and move the
/// snapshot, without an outbox row.
fn other_writes(db: &TestDb, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    db.execute("CREATE TABLE busy (n int8 NOT NULL)", "the other table");
    db.execute("INSERT INTO busy VALUES (0)", "its row");
    let mut conn = db.conn();
    std::thread::spawn(move || {
        // until stopped, or the cluster is gone (a test that failed)
        while !stop.load(Ordering::Relaxed)
            && diesel::sql_query("UPDATE busy SET n = n + 1")
                .execute(&mut conn)
                .is_ok()
        {
            std::thread::sleep(Duration::from_millis(10));
        }
    })
}

/// A relay with `args` idles for 3 s (polling every 50 ms) on a cluster of its own: its read
/// (`read`, a `LIKE` pattern) may run at most 10 times, its question at most `QUESTIONS`
/// times, and with `looks`, each look at the shares runs on its cached plan. Then a
/// transaction held open through the idle polls commits, and a writer that does not notify
/// inserts a row: each is published within 2 s. Then it idles 3 s more while another table is
/// written every 10 ms: its read may run at most `beside` times, its question at most
/// `QUESTIONS` times. A row that carries an earlier transaction's id (a copy) is published
/// within 2 s all the same.
async fn idle_relay_reads(args: &[&str], read: &str, looks: &[&str], beside: i64) {
    let (_cluster, db) = TestDb::counting_statements();
    let stream = TestStream::new();
    // the backlog figures' reading (a NOTIFY, which ends a transaction) out of the way
    let mut args = args.to_vec();
    args.extend(["--stats-interval", "2m"]);
    let relay = Relay::start(relay_command(&db, &stream, &args));
    insert_rows(&db, 10);
    wait_published(&db, 10, Duration::from_secs(30)).await;
    // a writer's transaction in progress through the idle polls
    let mut open = db.conn();
    diesel::sql_query("BEGIN")
        .execute(&mut open)
        .expect("begin");
    diesel::sql_query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'order', 'late', 'order.placed', '{}')",
    )
    .execute(&mut open)
    .expect("insert in the open transaction");
    // the relay's first looks at the shares (every 100 ms while they may move) are over
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = db.calls_and_plans(read).0;
    let asked_before = db.calls_and_plans(QUESTION).0;
    let looks_before: Vec<(i64, i64)> = looks.iter().map(|l| db.calls_and_plans(l)).collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = db.calls_and_plans(read).0 - before;
    assert!(
        idle <= 10,
        "the relay read {idle} times in 3 s of idleness, polling every 50 ms"
    );
    let asked = db.calls_and_plans(QUESTION).0 - asked_before;
    assert!(
        asked <= QUESTIONS,
        "the relay asked {asked} times in 3 s of idleness, polling every 50 ms"
    );
    // the looks are prepared once per session, and run on their cached plans
    for (look, (calls, plans)) in looks.iter().zip(looks_before) {
        let (calls, plans) = {
            let (c, p) = db.calls_and_plans(look);
            (c - calls, p - plans)
        };
        assert!(
            calls >= 2 && plans == 0,
            "{look}: {calls} calls, {plans} plans in 3 s"
        );
    }
    // the open transaction commits: its row is read at the next poll
    diesel::sql_query("COMMIT")
        .execute(&mut open)
        .expect("commit");
    wait_published(&db, 11, Duration::from_secs(2)).await;
    // and a writer that does not notify, after a while of idleness again
    tokio::time::sleep(Duration::from_millis(500)).await;
    insert_rows(&db, 1);
    wait_published(&db, 12, Duration::from_secs(2)).await;
    // other transactions end all the time, none of them writing the outbox
    let stop = Arc::new(AtomicBool::new(false));
    let writer = other_writes(&db, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = db.calls_and_plans(read).0;
    let asked_before = db.calls_and_plans(QUESTION).0;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = db.calls_and_plans(read).0 - before;
    assert!(
        idle <= beside,
        "the relay read {idle} times in 3 s beside other writes, polling every 50 ms"
    );
    let asked = db.calls_and_plans(QUESTION).0 - asked_before;
    assert!(
        asked <= QUESTIONS,
        "the relay asked {asked} times in 3 s beside other writes, polling every 50 ms"
    );
    // a row whose transaction id is an earlier transaction's: the question by transaction id
    // does not see it come, the relay's read at least once a second does
    db.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, txid) \
         SELECT gen_random_uuid(), 'order', 'copied', 'order.placed', '{}', txid \
         FROM outbox ORDER BY seq LIMIT 1",
        "a row with an earlier transaction's id",
    );
    wait_published(&db, 13, Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("the other writes");
    assert_eq!(stream.read_all().await.len(), 13);
    drop(relay);
}

// 51 and 54. An idle ordered relay polls every `--poll-interval`. Its poll was the batch
// statement, whose plan over every partition it owns PostgreSQL starts and runs at each call:
// about 10 ms of CPU a second for one relay with the default 100 ms. While no row comes to its
// table, nothing new can be read: the poll asks only whether a transaction ended since its
// last read, and if one did, whether the table holds a row that read did not see.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relay_reads_its_partitions_again_only_after_a_transaction_ended() {
    idle_relay_reads(&["--partitions", "4"], BATCH, &LOOKS, 10).await;
}

// 53 and 54. An idle unordered worker's poll was a transaction of three statements (BEGIN,
// the claim, COMMIT), each worker's every `--poll-interval`; it asks the same question first.
// 56. Each worker asked it at each of its polls (two workers: about 120 questions in 3 s); the
// workers of a relay now share it, and one asks per poll interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_unordered_workers_claim_again_only_after_a_transaction_ended() {
    idle_relay_reads(&["--mode", "unordered", "--workers", "2"], CLAIM, &[], 14).await;
}
