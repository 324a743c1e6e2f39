//! Reading partitions: one statement for cursors that differ, the partition index, take-overs.

use super::*;

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

// 45. A relay that owns one partition of several, with the partition index: its statement
// was the one walk of that partition inside parentheses with its own `ORDER BY`, followed by
// the merge's `ORDER BY seq LIMIT`, which PostgreSQL refuses ("multiple ORDER BY clauses not
// allowed"): the relay lost its session at every batch and never read the partition (four
// relays on eight partitions, one of them holding one partition for a while, did so five
// times in a second). Each partition read alone comes whole, in `seq` order, by the index.
#[tokio::test]
async fn a_relay_that_owns_one_partition_of_several_reads_it_by_the_partition_index() {
    use outbox_diesel::relay::{
        Cursor, Partitioning, Source, explain_batches_analyze_in, fetch_batches_in,
    };
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    insert_rows_over(&db, 1_000, 40);
    assert!(outbox_diesel::create_partition_index(&mut db.conn(), &table, 4).expect("index"));
    let indexed = Partitioning::new(4).indexed(true);
    let mut conn = db.relay_session().await;
    for p in 0..4u32 {
        let plan =
            explain_batches_analyze_in(&mut conn, &table, indexed, &[(p, Cursor::start())], 100)
                .await
                .unwrap_or_else(|e| panic!("explain the batch of partition {p} alone: {e}"))
                .join("\n");
        assert_eq!(
            removed_by_filter(&plan, "outbox_ready_p4"),
            Some(0),
            "partition {p} by the index:\n{plan}"
        );
        let mut cursors = vec![(p, Cursor::start())];
        let mut got = Vec::new();
        loop {
            let batches =
                fetch_batches_in(&mut conn, &table, indexed, &cursors, &[], 100, i64::MAX)
                    .await
                    .unwrap_or_else(|e| panic!("read partition {p} alone: {e}"));
            let read: Vec<i64> = batches
                .iter()
                .flat_map(|(_, b)| seqs_of(b, Source::Next))
                .collect();
            assert!(read.len() <= 100, "{} rows in a batch of 100", read.len());
            cursors = batches.into_iter().map(|(p, b)| (p, b.next)).collect();
            if read.is_empty() {
                break;
            }
            got.extend(read);
        }
        assert_eq!(
            got,
            seqs_where(&db, &format!("aggregate_hash % 4 = {p}")),
            "partition {p}"
        );
    }
}
