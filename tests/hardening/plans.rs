//! What a poll and a batch cost: parked rows, statistics, late rows, the generic plan.

use super::*;

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
/// every batch did that: 0.69 ms an empty batch against 0.11). And it is planned once: a
/// relay's session plans no custom plan first (PostgreSQL plans five before it compares; four
/// relays sharing 8 partitions spent 125-148 ms of a 100,000-event drain planning their batch
/// statements, 25-41 ms with the generic plan alone).
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
            p.generic_plans == 20 && p.custom_plans == 0,
            "planned more than once: {plans:?}"
        );
    }
}

/// The statements a relay runs after every batch are prepared once per session and keep their
/// plan, whatever the rows or partitions they name: the progress record (the ordered relay's
/// default), the delete of the acked rows (`--delete-published`) and their mark (`unordered`).
/// The first two were parsed, prepared and planned again at every batch (statements of
/// `sql_query`, which Diesel never caches): a round trip and about 0.4 ms of PostgreSQL a
/// batch.
#[tokio::test]
async fn the_statements_after_every_batch_are_prepared_once_per_session() {
    use outbox_diesel::relay::{Cursor, Partition, delete_acked, mark_published, record_progress};
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let mut conn = db.relay_session().await;
    for count in [1u32, 4] {
        for n in 1..=10 {
            let cursors: Vec<(Partition, Cursor)> = (0..count)
                .map(|index| (Partition { index, count }, Cursor::at(n, "1:1:")))
                .collect();
            record_progress(&mut conn, &table, &cursors)
                .await
                .expect("record");
            let seqs: Vec<i64> = (0..n * i64::from(count)).collect();
            delete_acked(&mut conn, &table, &seqs)
                .await
                .expect("delete");
            mark_published(&mut conn, &table, &seqs)
                .await
                .expect("mark");
        }
    }
    for (what, pattern) in [
        ("the progress record", "INSERT INTO \"outbox_progress\"%"),
        ("the delete", "DELETE FROM \"outbox\"%"),
        ("the mark", "UPDATE \"outbox\" SET published_at%"),
    ] {
        let plans: Vec<Plans> = diesel_async::RunQueryDsl::load(
            diesel::sql_query(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements \
                 WHERE statement LIKE $1",
            )
            .bind::<diesel::sql_types::Text, _>(pattern),
            &mut conn,
        )
        .await
        .expect("the session's prepared statements");
        assert_eq!(plans.len(), 1, "{what}: one prepared statement: {plans:?}");
        assert_eq!(
            plans[0].generic_plans + plans[0].custom_plans,
            20,
            "{what}: each call ran it: {plans:?}"
        );
        assert_eq!(plans[0].custom_plans, 0, "{what}: planned once: {plans:?}");
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

// 44. The backlog's figures (every relay's statistics, `status`) read every unpublished row
// and tested each against every cursor of the table (whether a cursor had read it: a look at
// each of the N cursors per row), also the rows past the highest cursor, which no cursor has
// read: on a backlog of 100,000 rows and 8 cursors, one reading took 317 ms of the database in
// the bench's drain, where a batch of 500 takes 3. Rows past every cursor are counted untested.
#[tokio::test]
async fn the_backlog_tests_only_rows_a_cursor_may_have_read() {
    use outbox_diesel::relay::{
        Cursor, Partition, backlogs, explain_backlogs_analyze, record_progress,
    };
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    insert_rows_over(&db, 1_000, 500);
    // half the partitions read up to `seq` 1,000, the other half up to 500, at a snapshot that
    // sees every row so far
    let snap = db
        .strings("SELECT pg_current_snapshot()::text")
        .pop()
        .expect("a snapshot");
    let cursors: Vec<(Partition, Cursor)> = (0..8)
        .map(|p| {
            let upto = if p < 4 { 1_000 } else { 500 };
            (
                Partition { index: p, count: 8 },
                Cursor::at(upto, snap.clone()),
            )
        })
        .collect();
    let mut conn = db.relay_session().await;
    record_progress(&mut conn, &table, &cursors)
        .await
        .expect("record the cursors");
    insert_rows_over(&db, 20_000, 5_000);
    db.execute("VACUUM ANALYZE outbox", "vacuum");
    let expected = db.scalar(
        "SELECT count(*) FROM outbox WHERE seq > 1000 OR (seq > 500 AND aggregate_hash % 8 >= 4)",
    );
    // the quickest of three readings, the last one checked
    let mut took = std::time::Duration::MAX;
    let mut read = None;
    for _ in 0..3 {
        let started = std::time::Instant::now();
        read = Some(backlogs(&mut conn, &table, 8).await.expect("the backlog"));
        took = took.min(started.elapsed());
    }
    println!("the backlog of {expected} rows read in {took:?}");
    let (total, parts) = read.expect("three readings");
    assert_eq!(total.unpublished, expected);
    for part in &parts {
        let p = part.partition;
        assert_eq!(
            part.unpublished,
            db.scalar(&format!(
                "SELECT count(*) FROM outbox WHERE aggregate_hash % 8 = {p} \
                 AND seq > CASE WHEN {p} < 4 THEN 1000 ELSE 500 END"
            )),
            "partition {p}"
        );
    }
    let plan = explain_backlogs_analyze(&mut conn, &table, 8)
        .await
        .expect("explain the backlog");
    // the look at the cursors, once per row tested
    let tested: u64 = plan
        .iter()
        .filter(|l| l.contains("CTE Scan on c"))
        .filter_map(|l| l.split("loops=").nth(1))
        .filter_map(|n| n.trim_end_matches(')').parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    let took = plan
        .iter()
        .find(|l| l.starts_with("Execution Time"))
        .map_or("", String::as_str);
    println!("rows tested against the cursors: {tested}; {took}");
    assert!(
        tested <= 1_000,
        "{tested} rows tested against the cursors, of which 500 may have been read:\n{}",
        plan.join("\n")
    );
}

/// The bytes PostgreSQL sends for a batch of the one partition of `outbox` read from its
/// start (500 rows at most), through `proxy`; and the rows the batch holds.
async fn bytes_of_a_batch(
    conn: &mut diesel_async::AsyncPgConnection,
    proxy: &support::proxy::NatsProxy,
) -> (u64, usize) {
    use outbox_diesel::relay::{Cursor, fetch_batches};
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let before = proxy.bytes_from_server();
    let batches = fetch_batches(conn, &table, 1, &[(0, Cursor::start())], &[], 500, i64::MAX)
        .await
        .expect("fetch");
    let rows = batches.first().map_or(0, |(_, b)| b.rows.len());
    (proxy.bytes_from_server() - before, rows)
}

// 47. A batch's statement returned the snapshot it read at (`pg_current_snapshot()`, which
// lists every transaction in progress) on every row: with 30 transactions in progress a batch
// of 500 rows carried that list 500 times.
#[tokio::test]
async fn a_batch_sends_its_snapshot_once() {
    use diesel_async::AsyncConnection;
    let db = TestDb::new();
    insert_rows(&db, 500);
    let server = db
        .url
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .expect("host:port in the test database's URL");
    let proxy = support::proxy::NatsProxy::start(server);
    let url = db.url.replacen(server, &proxy.addr(), 1);
    let mut conn = diesel_async::AsyncPgConnection::establish(&url)
        .await
        .expect("connect through the proxy");
    // the first call prepares the statement
    bytes_of_a_batch(&mut conn, &proxy).await;
    let (quiet, rows) = bytes_of_a_batch(&mut conn, &proxy).await;
    assert_eq!(rows, 500);

    let open: Vec<PgConnection> = (0..30)
        .map(|_| {
            let mut c = db.conn();
            for sql in ["BEGIN", "SELECT pg_current_xact_id()"] {
                diesel::connection::SimpleConnection::batch_execute(&mut c, sql)
                    .expect("a transaction in progress");
            }
            c
        })
        .collect();
    // a transaction that ends after them: a snapshot lists those in progress below the last
    // one ended
    db.scalar("SELECT pg_current_xact_id()::text::int8");
    let snapshot = db.scalar("SELECT length(pg_current_snapshot()::text)::int8");
    assert!(
        snapshot > 100,
        "the snapshot lists the 30: {snapshot} bytes ({} idle in transaction)",
        db.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' \
             AND datname = current_database()"
        )
    );
    let (busy, rows) = bytes_of_a_batch(&mut conn, &proxy).await;
    assert_eq!(rows, 500, "the rows committed before the 30 began are read");
    drop(open);
    println!(
        "a batch of 500 rows: {quiet} bytes, {busy} with 30 transactions in progress \
         (a snapshot of {snapshot} bytes)"
    );
    assert!(
        busy < quiet + 2 * snapshot as u64,
        "the batch sent {busy} bytes with 30 transactions in progress, {quiet} with none: \
         its snapshot of {snapshot} bytes more than once"
    );
}
