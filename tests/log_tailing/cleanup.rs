//! Captured rows deleted from the table: at once, on schedule, and those the first start
//! published.

use super::*;

#[tokio::test]
async fn insert_then_delete_leaves_the_table_empty_and_delivers_every_event() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;

    let outbox = Outbox::default().delete_after_insert(true);
    let ledger = Ledger::default();
    join_all(start_writers(&db, &outbox, 2, 250, 3, &ledger));
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox"),
        0,
        "the table stays empty"
    );
    wait_count(&stream, 1_500, Duration::from_secs(180)).await;
    assert_stream_holds(&stream, &ledger).await;
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 0);
}

/// Captured rows deleted at the first cleanup after they are captured, every 200 ms.
const DELETE_CAPTURED_AT_ONCE: &[&str] = &[
    "--captured-retention",
    "0s",
    "--captured-cleanup-interval",
    "200ms",
];

#[tokio::test]
async fn captured_rows_are_deleted_on_schedule_without_losing_events() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, DELETE_CAPTURED_AT_ONCE);
    wait_reader(&db, &slot).await;
    let ledger = Ledger::default();
    join_all(start_writers(&db, &Outbox::default(), 2, 100, 2, &ledger));
    wait_count(&stream, 400, Duration::from_secs(30)).await;
    wait_until(Duration::from_secs(30), "captured rows deleted", || async {
        db.scalar("SELECT count(*) FROM outbox") == 0
    })
    .await;
    assert_stream_holds(&stream, &ledger).await;
}

/// Rows recorded before the relay's first start are published from the slot's snapshot, and
/// deleted on the same schedule as the rows read from the slot, without waiting for a later
/// event to be confirmed.
#[tokio::test]
async fn rows_published_by_the_first_start_are_deleted_on_schedule() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let ledger = Ledger::default();
    join_all(start_writers(&db, &Outbox::default(), 2, 50, 2, &ledger));
    let _relay = relay("relay", &db, &stream, &slot, DELETE_CAPTURED_AT_ONCE);
    wait_count(&stream, 200, Duration::from_secs(30)).await;
    wait_until(
        Duration::from_secs(10),
        "the first start's rows deleted",
        || async { db.scalar("SELECT count(*) FROM outbox") == 0 },
    )
    .await;
    assert_stream_holds(&stream, &ledger).await;
}
