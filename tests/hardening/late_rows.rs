//! Late rows: transactions held open across batches, read in parts (late passes).

use super::*;

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
