//! A rotated outbox table (`partition_table`): the conversion keeps every row and what reads
//! it, relays of every mode go on, and cleanup empties a partition past the retention with one
//! `TRUNCATE`, never one that holds a row not yet published, parked, or still written.

mod support;

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::time::Duration;

use diesel::prelude::*;
use outbox_diesel::{OutboxExt, OutboxTable, Rotation, partition_table};
use support::events::{Changed, changed};
use support::slot::Slot;
use support::{
    Proc, Relay, TestDb, TestStream, by_aggregate, relay_bin, relay_command, wait_published,
    wait_until,
};

const BLOCK: i64 = 1000;

/// `n` events in one transaction, over `aggregates` accounts named `{tag}-k`.
fn record(db: &TestDb, n: usize, aggregates: usize, tag: &str) -> Vec<String> {
    let events: Vec<Changed> = (0..n)
        .map(|i| changed(&format!("{tag}-{}", i % aggregates.max(1)), i as i64))
        .collect();
    db.conn()
        .transaction(|c| c.record_events(&events))
        .expect("record events")
        .into_iter()
        .map(|id| id.to_string())
        .collect()
}

/// Waits until `stream` holds `n` messages (or more: the test then finds them too many).
async fn wait_events(stream: &TestStream, n: u64) {
    wait_until(
        Duration::from_secs(60),
        &format!("{n} events in the stream"),
        || async { stream.count().await >= n },
    )
    .await;
}

fn rotate(db: &TestDb) -> bool {
    partition_table(
        &mut db.conn(),
        &OutboxTable::DEFAULT,
        Rotation::default().block_rows(BLOCK),
    )
    .expect("partition the outbox")
}

/// Rows per partition of the ring, `outbox_r0` first.
fn rows_per_partition(db: &TestDb) -> Vec<i64> {
    (0..4)
        .map(|k| db.scalar(&format!("SELECT count(*) FROM outbox_r{k}")))
        .collect()
}

/// Every message of the stream once, and per aggregate in the order of `ids` (recorded in
/// that order).
async fn assert_each_once_in_order(
    stream: &TestStream,
    ids: &[String],
    tag: &str,
    aggregates: usize,
) {
    let aggregates: Vec<String> = (0..aggregates).map(|k| format!("{tag}-{k}")).collect();
    let got = stream.read_all().await;
    let distinct: HashSet<&str> = got.iter().map(|m| m.msg_id.as_str()).collect();
    assert_eq!(distinct.len(), ids.len(), "every event is in the stream");
    assert_eq!(got.len(), ids.len(), "and only once");
    let order: HashMap<&str, usize> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_str(), i))
        .collect();
    for (agg, seen) in by_aggregate(&got) {
        let positions: Vec<usize> = seen.iter().map(|id| order[id.as_str()]).collect();
        assert!(
            positions.windows(2).all(|w| w[0] < w[1]),
            "aggregate {agg} out of order"
        );
        assert!(
            aggregates.contains(&agg),
            "an aggregate of this test: {agg}"
        );
    }
}

#[tokio::test]
async fn a_table_turned_into_a_ring_keeps_its_rows_and_what_reads_them() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let role = format!("{}_reader", db.name);
    db.execute(&format!("CREATE ROLE {role}"), "a role");
    db.execute(&format!("GRANT SELECT ON outbox TO {role}"), "a grant");
    db.execute(
        "CREATE INDEX outbox_by_type ON outbox (event_type)",
        "an index of the user's",
    );

    // published rows, then rows not published yet, both in the plain table
    let mut ids = record(&db, 300, 6, "a");
    let mut relay = Relay::start(relay_command(&db, &stream, &["--no-cleanup"]));
    wait_events(&stream, 300).await;
    // the acks are in the stream before the relay records them: the record too, then the kill
    wait_published(&db, 300, Duration::from_secs(30)).await;
    relay.proc.kill();
    ids.extend(record(&db, 900, 6, "a"));
    let last_seq = db.scalar("SELECT max(seq) FROM outbox");

    assert!(rotate(&db), "a plain table is converted");
    assert!(!rotate(&db), "a partitioned one is left as it is");
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox"),
        1200,
        "every row is kept"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NOT NULL"),
        300,
        "the audit view dates the rows published before"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM pg_partitioned_table WHERE partrelid = 'outbox'::regclass"),
        1
    );
    assert_eq!(rows_per_partition(&db).iter().sum::<i64>(), 1200);
    assert!(
        rows_per_partition(&db)[1] > 0,
        "seq 1000 on goes to outbox_r1"
    );
    for index in [
        "outbox_ready",
        "outbox_txid",
        "outbox_released",
        "outbox_by_type",
    ] {
        assert_eq!(
            db.scalar(&format!(
                "SELECT count(*) FROM pg_class WHERE relname = '{index}' AND relkind = 'I'"
            )),
            1,
            "{index} is made again on the partitioned table"
        );
    }
    assert_eq!(
        db.scalar(&format!(
            "SELECT has_table_privilege('{role}', 'outbox', 'SELECT')::int"
        )),
        1,
        "grants are made again"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM pg_class WHERE relname = 'outbox_seq_seq'"),
        1,
        "the identity's sequence keeps its name"
    );

    // the vacuum figures are the partitions'
    let stats =
        outbox_diesel::relay::table_stats(&mut db.async_conn().await, &OutboxTable::DEFAULT)
            .await
            .expect("table stats")
            .expect("a rotated table has vacuum figures");
    assert!(stats.total_bytes > 0, "{stats:?}");

    // the identity goes on after the last seq, and the relay goes on where it stood
    ids.extend(record(&db, 100, 6, "a"));
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) FROM outbox WHERE seq > {last_seq}"
        )),
        100
    );
    let _relay = Relay::start(relay_command(&db, &stream, &["--no-cleanup"]));
    wait_events(&stream, 1300).await;
    // no more than that arrives
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_each_once_in_order(&stream, &ids, "a", 6).await;
    db.execute(&format!("DROP OWNED BY {role}"), "drop the role's grants");
    db.execute(&format!("DROP ROLE {role}"), "drop the role");
}

#[test]
fn a_rotation_too_small_is_refused_with_its_reason() {
    let db = TestDb::new();
    let err = partition_table(
        &mut db.conn(),
        &OutboxTable::DEFAULT,
        Rotation::default().partitions(1),
    )
    .expect_err("one partition is no ring");
    assert!(err.to_string().contains("at least 2 partitions"), "{err}");
    // a trigger of the user's would be lost by the copy: refused, the table as it was
    db.execute(
        "CREATE FUNCTION audit_outbox() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RETURN NEW; END $$",
        "a trigger function",
    );
    db.execute(
        "CREATE TRIGGER outbox_audit_trigger BEFORE INSERT ON outbox \
         FOR EACH ROW EXECUTE FUNCTION audit_outbox()",
        "a trigger",
    );
    let err = partition_table(&mut db.conn(), &OutboxTable::DEFAULT, Rotation::default())
        .expect_err("a trigger is refused");
    assert!(err.to_string().contains("triggers"), "{err}");
    assert_eq!(
        db.scalar("SELECT count(*) FROM pg_partitioned_table"),
        0,
        "the table is left as it was"
    );
}

/// `outbox-relay rotate` with `args`: its exit code, stdout and stderr.
fn rotate_command(db: &TestDb, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(relay_bin())
        .env_clear()
        .env("DATABASE_URL", &db.url)
        .arg("rotate")
        .args(args)
        .output()
        .expect("run outbox-relay rotate");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn outbox_relay_rotate_turns_the_table_into_a_ring_once_and_refuses_a_bad_size() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let ids = record(&db, 1500, 10, "cli");
    // a ring too small: refused with the reason, nothing changed
    let (code, _, err) = rotate_command(&db, &["--partitions", "1"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("at least 2 partitions"), "{err}");
    assert_eq!(db.scalar("SELECT count(*) FROM pg_partitioned_table"), 0);

    let (code, out, err) = rotate_command(&db, &["--block-rows", "1000"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("outbox_r0 to outbox_r3"), "{out}");
    assert_eq!(rows_per_partition(&db), vec![999, 501, 0, 0]);
    // a second run leaves the ring as it is, and says so
    let (code, out, err) = rotate_command(&db, &["--block-rows", "5000"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("already"), "{out}");
    assert_eq!(rows_per_partition(&db), vec![999, 501, 0, 0]);

    let _relay = Proc::spawn("outbox-relay", &mut relay_command(&db, &stream, &[]));
    wait_events(&stream, 1500).await;
    assert_each_once_in_order(&stream, &ids, "cli", 10).await;
}

/// `outbox-relay cleanup --retention 0s` once; panics when it fails.
fn cleanup_once(db: &TestDb) {
    let out = Command::new(relay_bin())
        .env_clear()
        .env("DATABASE_URL", &db.url)
        .args(["cleanup", "--retention", "0s"])
        .output()
        .expect("run outbox-relay cleanup");
    assert!(
        out.status.success(),
        "cleanup failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Rows deleted one by one from each partition since the database was made (a `TRUNCATE`
/// deletes none).
fn deleted_per_partition(db: &TestDb) -> Vec<i64> {
    (0..4)
        .map(|k| {
            db.scalar(&format!(
                "SELECT n_tup_del FROM pg_stat_user_tables WHERE relname = 'outbox_r{k}'"
            ))
        })
        .collect()
}

async fn wait_stats_flushed() {
    // the statistics of a session's deletes reach pg_stat_user_tables when it ends
    tokio::time::sleep(Duration::from_millis(700)).await;
}

#[tokio::test]
async fn cleanup_empties_a_partition_past_the_retention_with_one_truncate() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    assert!(rotate(&db));
    // blocks 0, 1 and 2 whole, and 500 rows of block 3 (seq 1 to 3500)
    let mut ids = Vec::new();
    for _ in 0..7 {
        ids.extend(record(&db, 500, 8, "c"));
    }
    assert_eq!(rows_per_partition(&db), vec![999, 1000, 1000, 501]);
    let relay = Relay::start(relay_command(&db, &stream, &["--no-cleanup"]));
    wait_events(&stream, 3500).await;
    // a relay records its cursor after the acks: wait until every row is covered
    wait_until(Duration::from_secs(30), "every row covered", || async {
        db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL") == 0
    })
    .await;
    drop(relay);

    cleanup_once(&db);
    wait_stats_flushed().await;
    assert_eq!(
        rows_per_partition(&db),
        vec![0, 0, 0, 0],
        "the full partitions are emptied and the current one cleaned row by row"
    );
    assert_eq!(
        deleted_per_partition(&db),
        vec![0, 0, 0, 501],
        "the partitions not being filled went whole, by TRUNCATE"
    );
    assert_each_once_in_order(&stream, &ids, "c", 8).await;
}

#[tokio::test]
async fn a_partition_keeps_its_rows_while_one_is_unpublished_parked_or_still_written() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    assert!(rotate(&db));
    // block 0 with a transaction held open, its row at seq 1
    let (recorded, held) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
    let url = db.url.clone();
    let writer = std::thread::spawn(move || {
        let mut conn = PgConnection::establish(&url).expect("connect");
        conn.transaction(|c| {
            c.record_event(&changed("held", 0))?;
            let _ = recorded.0.send(());
            let _ = held.1.recv();
            Ok::<_, diesel::result::Error>(())
        })
        .expect("the held transaction");
    });
    recorded.1.recv().expect("the held row recorded");
    // blocks 0 to 2, and two rows of block 3
    record(&db, 998, 4, "k");
    record(&db, 2002, 4, "k");
    let mut relay = Relay::start(relay_command(&db, &stream, &["--no-cleanup"]));
    wait_events(&stream, 3000).await;
    wait_until(
        Duration::from_secs(30),
        "the committed rows covered",
        || async { db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL") == 0 },
    )
    .await;
    relay.proc.kill();
    // a parked row in block 1
    db.execute(
        "UPDATE outbox SET parked_at = now(), last_error = 'test' WHERE seq = 1500",
        "park a row",
    );

    cleanup_once(&db);
    let rows = rows_per_partition(&db);
    assert_eq!(
        rows[0], 998,
        "a transaction still writes outbox_r0: {rows:?}"
    );
    assert_eq!(rows[1], 1000, "outbox_r1 holds a parked row: {rows:?}");
    assert_eq!(rows[2], 0, "outbox_r2 is past the retention: {rows:?}");

    // committed, the held row is not published yet: its partition waits for it
    held.0.send(()).expect("commit the held row");
    writer.join().expect("the held transaction committed");
    cleanup_once(&db);
    assert_eq!(
        rows_per_partition(&db)[0],
        999,
        "a committed row not yet published keeps outbox_r0"
    );
    let relay = Relay::start(relay_command(&db, &stream, &["--no-cleanup"]));
    wait_until(
        Duration::from_secs(60),
        "the late row in the stream",
        || async { stream.count().await == 3001 },
    )
    .await;
    wait_until(Duration::from_secs(30), "the late row covered", || async {
        db.scalar(
            "SELECT count(*) FROM outbox_audit WHERE published_at IS NULL AND parked_at IS NULL",
        ) == 0
    })
    .await;
    drop(relay);
    cleanup_once(&db);
    let rows = rows_per_partition(&db);
    assert_eq!(rows[0], 0, "published, outbox_r0 goes: {rows:?}");
    assert_eq!(
        rows[1], 1000,
        "the parked row still keeps outbox_r1: {rows:?}"
    );
}

#[tokio::test]
async fn log_tailing_goes_on_through_the_conversion_and_reads_the_ring() {
    let db = TestDb::new();
    let stream = TestStream::new();
    let slot = Slot::new(&db);
    let _relay = Proc::spawn(
        "outbox-relay",
        &mut relay_command(
            &db,
            &stream,
            &["--mode", "log-tailing", "--slot", &slot.name],
        ),
    );
    wait_until(
        Duration::from_secs(30),
        "a relay reading the slot",
        || async { slot.exists(&db) && slot.streaming(&db) },
    )
    .await;
    let mut ids = record(&db, 50, 5, "w");
    wait_events(&stream, 50).await;

    // the table is made again under the reader: its new rows come under a new OID
    assert!(rotate(&db));
    assert_eq!(
        db.scalar("SELECT pubviaroot::int FROM pg_publication WHERE pubname = 'outbox_pub'"),
        1,
        "the publication sends the partitions' rows as the table's"
    );
    for _ in 0..3 {
        ids.extend(record(&db, 500, 5, "w"));
    }
    wait_events(&stream, 1550).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // the copy's inserts carry the ids published before: JetStream drops them
    assert_each_once_in_order(&stream, &ids, "w", 5).await;
}

#[tokio::test]
async fn the_unordered_and_the_deleting_relays_publish_a_rotated_table() {
    for (tag, args) in [
        ("u", &["--mode", "unordered", "--workers", "4"][..]),
        ("d", &["--delete-published"][..]),
    ] {
        let (db, stream) = (TestDb::new(), TestStream::new());
        assert!(rotate(&db));
        let mut ids = Vec::new();
        for _ in 0..5 {
            ids.extend(record(&db, 500, 10, tag));
        }
        let mut all = vec!["--retention", "0s", "--cleanup-interval", "200ms"];
        all.extend_from_slice(args);
        let _relay = Relay::start(relay_command(&db, &stream, &all));
        wait_events(&stream, 2500).await;
        wait_until(
            Duration::from_secs(30),
            "the published rows gone",
            || async { db.scalar("SELECT count(*) FROM outbox") == 0 },
        )
        .await;
        let got = stream.read_all().await;
        let distinct: HashSet<&str> = got.iter().map(|m| m.msg_id.as_str()).collect();
        assert_eq!(distinct.len(), 2500, "{args:?}: every event");
        assert_eq!(got.len(), 2500, "{args:?}: once");
        if tag == "d" {
            assert_each_once_in_order(&stream, &ids, "d", 10).await;
        }
    }
}

/// The plan lines of the ordered batch over `db`'s rows, at a cursor that has read nothing.
async fn batch_plan(db: &TestDb) -> Vec<String> {
    let mut conn = db.relay_session().await;
    let cursor =
        outbox_diesel::relay::Cursor::at(0, &db.strings("SELECT pg_current_snapshot()")[0]);
    let partition = outbox_diesel::relay::Partition { index: 0, count: 1 };
    outbox_diesel::relay::explain_batch_analyze(
        &mut conn,
        &OutboxTable::DEFAULT,
        partition,
        &cursor,
        500,
    )
    .await
    .expect("explain the batch")
}

/// The largest `loops=` of the plan's index scans: how often one ran per batch.
fn most_loops(plan: &[String]) -> u64 {
    plan.iter()
        .filter(|l| l.contains("Index Scan") || l.contains("Index Only Scan"))
        .filter_map(|l| l.split("loops=").nth(1)?.trim_end_matches(')').parse().ok())
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn a_batch_looks_for_waiting_rows_of_each_aggregate_only_while_a_row_waits() {
    for rotated in [false, true] {
        let db = TestDb::new();
        if rotated {
            assert!(rotate(&db));
        }
        record(&db, 600, 50, "b");
        db.execute("VACUUM ANALYZE outbox", "vacuum");
        let plan = batch_plan(&db).await;
        assert!(
            most_loops(&plan) <= 1,
            "rotated: {rotated}; no row waits, yet a row's look-up ran per row:\n{}",
            plan.join("\n")
        );
        // a parked row: the rows after it look their aggregate up, one look-up each
        db.execute(
            "UPDATE outbox SET parked_at = now(), last_error = 'test' WHERE seq = 1",
            "park a row",
        );
        let plan = batch_plan(&db).await;
        assert!(
            most_loops(&plan) >= 100,
            "rotated: {rotated}; a row waits and the rows were not looked up:\n{}",
            plan.join("\n")
        );
    }
}

#[tokio::test]
async fn a_relay_with_the_readme_grants_empties_the_partitions_of_a_table_rotated_after() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let role = format!("{}_relay", db.name);
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA public TO {role}"),
        format!("GRANT SELECT, UPDATE, DELETE ON outbox TO {role}"),
        format!("GRANT SELECT, INSERT, DELETE ON outbox_progress TO {role}"),
    ] {
        db.execute(&sql, "the relay's role");
    }
    assert!(rotate(&db));
    for _ in 0..7 {
        record(&db, 500, 8, "g");
    }
    let base = support::pg_base();
    let host = base.rsplit('@').next().unwrap_or("127.0.0.1:5432");
    let url = format!("postgres://{role}@{host}/{}", db.name);
    let mut cmd = relay_command(
        &db,
        &stream,
        &["--retention", "0s", "--cleanup-interval", "200ms"],
    );
    cmd.env("DATABASE_URL", &url);
    let relay = Relay::start(cmd);
    wait_events(&stream, 3500).await;
    let started = std::time::Instant::now();
    while db.scalar("SELECT count(*) FROM outbox") > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the outbox not emptied: {:?} rows per partition; logs:\n{}",
            rows_per_partition(&db),
            relay.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let logs = relay.logs();
    drop(relay);
    wait_stats_flushed().await;
    assert_eq!(
        deleted_per_partition(&db),
        vec![0, 0, 0, 501],
        "the role emptied the full partitions by TRUNCATE; logs:\n{logs}"
    );
    db.execute(
        &format!("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"),
        "end the role's sessions",
    );
    db.execute(&format!("DROP OWNED BY {role}"), "drop the role's grants");
    db.execute(&format!("DROP ROLE {role}"), "drop the role");
}
