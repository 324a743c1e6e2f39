//! Upgrades: tables made by the migrations of earlier versions are refused by the ordered relay
//! until upgraded, then relayed from where they stood.

use std::time::Duration;

use diesel::prelude::*;
use outbox_diesel::{OutboxExt, OutboxTable};
use outbox_nats::Relay;

use crate::support::{TestDb, TestStream, wait_published};
use crate::{InProcessRelay, OrderPlaced, config};

/// An ordered relay started on `db`'s table fails at start, saying `why`.
async fn assert_refused(db: &TestDb, stream: &TestStream, why: &str) {
    let nats = async_nats::connect(&stream.nats_url)
        .await
        .expect("connect to NATS");
    let refused = Relay::new(config(db, stream), nats)
        .run(tokio_util::sync::CancellationToken::new())
        .await
        .expect_err("the relay refuses the table");
    assert!(refused.to_string().contains(why), "{refused}");
}

/// The aggregate of each message of the stream, in stream order.
async fn aggregates_in(stream: &TestStream) -> Vec<String> {
    stream
        .read_all()
        .await
        .into_iter()
        .map(|m| m.aggregate_id)
        .collect()
}

/// A table made by the migrations before snapshot batches, with rows an earlier relay published
/// and rows it did not: the ordered relay refuses it until it is upgraded, then publishes the
/// unpublished rows alone, in order, and the audit view dates every row.
#[tokio::test]
async fn a_table_made_before_snapshot_batches_is_upgraded_and_publishes_only_its_unpublished_rows()
{
    use diesel_migrations::MigrationHarness;
    upgraded_before_snapshot_batches(|conn| {
        conn.run_pending_migrations(outbox_diesel::MIGRATIONS)
            .expect("upgrade");
    })
    .await;
}

/// The same upgraded by `create_table` (a table of another name has no migrations), which
/// builds the transaction id index once, on `(txid, seq)`.
#[tokio::test]
async fn a_table_made_before_snapshot_batches_is_upgraded_by_create_table() {
    upgraded_before_snapshot_batches(|conn| {
        outbox_diesel::create_table(conn, &OutboxTable::DEFAULT).expect("upgrade");
    })
    .await;
}

async fn upgraded_before_snapshot_batches(upgrade: impl FnOnce(&mut PgConnection)) {
    use diesel_migrations::MigrationHarness;
    let (db, stream) = (TestDb::new(), TestStream::new());
    let mut conn = db.conn();
    for _ in 0..2 {
        conn.revert_last_migration(outbox_diesel::MIGRATIONS)
            .expect("back to the table of the earlier migrations");
    }
    let has_txid = "SELECT count(*) FROM pg_attribute WHERE attrelid = 'outbox'::regclass \
                    AND attname = 'txid' AND NOT attisdropped";
    assert_eq!(db.scalar(has_txid), 0);
    // three rows the earlier relay published, two it did not
    diesel::sql_query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, published_at) \
         SELECT gen_random_uuid(), 'order', 'u-' || i, 'order.placed', '{}', \
         CASE WHEN i <= 3 THEN now() - interval '1 minute' END FROM generate_series(1, 5) i",
    )
    .execute(&mut conn)
    .expect("the earlier rows");

    assert_refused(&db, &stream, "predates snapshot batches").await;

    upgrade(&mut conn);
    assert_eq!(db.scalar(has_txid), 1);
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM pg_indexes WHERE tablename = 'outbox' \
             AND indexname = 'outbox_txid' AND indexdef LIKE '%(txid, seq)'"
        ),
        1,
        "the transaction id index carries seq"
    );
    let relay = InProcessRelay::start(config(&db, &stream), &stream).await;
    conn.transaction(|conn| {
        conn.record_event(&OrderPlaced {
            order_id: "u-6".into(),
            n: 6,
        })
    })
    .expect("a row recorded after the upgrade");
    wait_published(&db, 6, Duration::from_secs(120)).await;
    relay.stop().await;
    assert_eq!(aggregates_in(&stream).await, ["u-4", "u-5", "u-6"]);
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM outbox_audit WHERE published_at < now() - interval '30 seconds'"
        ),
        3,
        "the rows the earlier relay published keep their time"
    );
}

/// A table whose progress table predates recorded late passes, with rows an ordered relay
/// published: the operations still read its cursors, the ordered relay refuses it until
/// `create_table` upgrades it, and then goes on from its cursor.
#[tokio::test]
async fn a_progress_table_made_before_late_passes_is_read_then_upgraded_by_create_table() {
    use diesel_migrations::MigrationHarness;
    let (db, stream) = (TestDb::new(), TestStream::new());
    let mut conn = db.conn();
    let record = |conn: &mut PgConnection, i: i64| {
        conn.transaction(|conn| {
            conn.record_event(&OrderPlaced {
                order_id: format!("u-{i}"),
                n: i,
            })
        })
        .expect("record");
    };
    for i in 1..=3 {
        record(&mut conn, i);
    }
    let relay = InProcessRelay::start(config(&db, &stream), &stream).await;
    wait_published(&db, 3, Duration::from_secs(60)).await;
    relay.stop().await;

    conn.revert_last_migration(outbox_diesel::MIGRATIONS)
        .expect("back to the progress table without late passes");
    let has_late_pass = "SELECT count(*) FROM pg_attribute WHERE attrelid = \
                         'outbox_progress'::regclass AND attname = 'late_after_seq' \
                         AND NOT attisdropped";
    assert_eq!(db.scalar(has_late_pass), 0);
    record(&mut conn, 4);
    let mut a = db.async_conn().await;
    let backlog = outbox_diesel::relay::backlog(&mut a, &OutboxTable::DEFAULT)
        .await
        .expect("the operations read the cursors of the older progress table");
    assert_eq!(
        backlog.unpublished, 1,
        "the three published rows are covered"
    );

    assert_refused(&db, &stream, "late passes").await;

    outbox_diesel::create_table(&mut conn, &OutboxTable::DEFAULT).expect("upgrade");
    assert_eq!(db.scalar(has_late_pass), 1);
    let relay = InProcessRelay::start(config(&db, &stream), &stream).await;
    wait_published(&db, 4, Duration::from_secs(60)).await;
    relay.stop().await;
    assert_eq!(aggregates_in(&stream).await, ["u-1", "u-2", "u-3", "u-4"]);
}
