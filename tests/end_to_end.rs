//! The end-to-end slice against the machine's PostgreSQL and NATS: record in the caller's
//! transaction, relay, and read the stream back.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use diesel::prelude::*;
use outbox_diesel::{AsyncOutboxExt, Outbox, OutboxEvent, OutboxExt, OutboxTable};
use outbox_nats::{Relay, RelayConfig};
use serde::Serialize;
use support::{TestDb, TestStream, wait_published, wait_until};

#[derive(Debug, Clone, Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", event_type = "order.placed")]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    order_id: String,
    n: i64,
}

diesel::table! {
    orders (id) {
        id -> Text,
        total -> BigInt,
    }
}

fn create_orders(db: &TestDb) {
    db.execute(
        "CREATE TABLE orders (id text PRIMARY KEY, total bigint NOT NULL)",
        "create orders",
    );
}

/// Runs a relay in this process until the returned guard is dropped.
type InProcessRelay = support::task::Running<outbox_nats::RelayError>;

impl InProcessRelay {
    async fn start(config: RelayConfig, stream: &TestStream) -> Self {
        let nats = async_nats::connect(&stream.nats_url)
            .await
            .expect("connect to NATS");
        let relay = Relay::new(config, nats);
        Self::spawn("relay", move |shutdown| relay.run(shutdown))
    }
}

fn config(db: &TestDb, stream: &TestStream) -> RelayConfig {
    RelayConfig::new(db.url.clone())
        .stream(stream.name.clone())
        .subject_prefix(stream.prefix.clone())
        .poll_interval(Duration::from_millis(20))
        .startup_timeout(Duration::from_secs(10))
}

#[tokio::test]
async fn committed_transaction_publishes_one_message_per_event_with_the_contract() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    create_orders(&db);
    let mut conn = db.conn();
    let events = vec![
        OrderPlaced {
            order_id: "o-1".into(),
            n: 1,
        },
        OrderPlaced {
            order_id: "o-2".into(),
            n: 2,
        },
    ];
    let ids = conn
        .transaction(|conn| {
            diesel::insert_into(orders::table)
                .values((orders::id.eq("o-1"), orders::total.eq(10)))
                .execute(conn)?;
            conn.record_events(&events)
        })
        .expect("commit");
    assert_eq!(ids.len(), 2);
    assert!(
        ids.iter().all(|id| id.get_version_num() == 7),
        "ids are UUIDv7"
    );

    let relay = InProcessRelay::start(config(&db, &stream), &stream).await;
    wait_published(&db, 2, Duration::from_secs(120)).await;
    relay.stop().await;

    let got = stream.read_all().await;
    assert_eq!(got.len(), 2);
    for (msg, (event, id)) in got.iter().zip(events.iter().zip(&ids)) {
        assert_eq!(msg.msg_id, id.to_string(), "Nats-Msg-Id is the row id");
        assert_eq!(
            msg.subject,
            format!("{}.order.{}", stream.prefix, event.order_id)
        );
        assert_eq!(msg.aggregate_type, "order");
        assert_eq!(msg.aggregate_id, event.order_id);
        assert_eq!(msg.event_type, "order.placed");
        assert_eq!(msg.payload, serde_json::to_value(event).expect("json"));
        let h = |k: &str| msg.headers.get(k).map(|v| v.as_str().to_owned());
        assert_eq!(h("Content-Type").as_deref(), Some("application/json"));
        let created = h("Outbox-Created-At").expect("Outbox-Created-At");
        chrono::DateTime::parse_from_rfc3339(&created).expect("RFC 3339");
    }
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL"),
        0
    );
}

#[tokio::test]
async fn rolled_back_transaction_publishes_nothing() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    create_orders(&db);
    let mut conn = db.conn();
    let result: Result<(), diesel::result::Error> = conn.transaction(|conn| {
        diesel::insert_into(orders::table)
            .values((orders::id.eq("o-1"), orders::total.eq(10)))
            .execute(conn)?;
        conn.record_event(&OrderPlaced {
            order_id: "o-1".into(),
            n: 1,
        })?;
        Err(diesel::result::Error::RollbackTransaction)
    });
    assert!(result.is_err());
    // and one that fails on a constraint after recording
    let result: Result<(), diesel::result::Error> = conn.transaction(|conn| {
        conn.record_event(&OrderPlaced {
            order_id: "o-2".into(),
            n: 2,
        })?;
        diesel::sql_query("INSERT INTO orders VALUES ('x', 1), ('x', 2)").execute(conn)?;
        Ok(())
    });
    assert!(result.is_err(), "duplicate key rolls back");
    // a committed one after them, so we know when the relay has caught up
    conn.transaction(|conn| {
        conn.record_event(&OrderPlaced {
            order_id: "o-3".into(),
            n: 3,
        })
    })
    .expect("commit");
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 1);
    assert_eq!(db.scalar("SELECT count(*) FROM orders"), 0);

    let relay = InProcessRelay::start(config(&db, &stream), &stream).await;
    wait_published(&db, 1, Duration::from_secs(120)).await;
    relay.stop().await;
    let got = stream.read_all().await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].aggregate_id, "o-3");
}

#[tokio::test]
async fn recording_outside_a_transaction_is_refused_and_writes_nothing() {
    let db = TestDb::new();
    let mut conn = db.conn();
    let err = conn
        .record_event(&OrderPlaced {
            order_id: "o".into(),
            n: 1,
        })
        .expect_err("refused");
    assert!(
        matches!(err, diesel::result::Error::NotInTransaction),
        "{err:?}"
    );
    let err = conn
        .record_events(&[OrderPlaced {
            order_id: "o".into(),
            n: 1,
        }])
        .expect_err("refused");
    assert!(
        matches!(err, diesel::result::Error::NotInTransaction),
        "{err:?}"
    );
    let mut aconn = db.async_conn().await;
    let err = aconn
        .record_event(&OrderPlaced {
            order_id: "o".into(),
            n: 1,
        })
        .await
        .expect_err("refused");
    assert!(
        matches!(err, diesel::result::Error::NotInTransaction),
        "{err:?}"
    );
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 0);
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "blob", event_type = "blob.stored")]
struct BlobStored {
    #[outbox(aggregate_id)]
    id: u32,
    data: String,
}

#[tokio::test]
async fn oversized_payloads_are_refused_at_record_time() {
    let db = TestDb::new();
    let mut conn = db.conn();
    let big = BlobStored {
        id: 1,
        data: "x".repeat(1024 * 1024),
    };
    let err = conn
        .transaction(|conn| conn.record_event(&big))
        .expect_err("refused");
    let diesel::result::Error::SerializationError(inner) = &err else {
        panic!("{err:?}")
    };
    let invalid = inner
        .downcast_ref::<outbox_diesel::InvalidEvent>()
        .expect("InvalidEvent");
    assert!(invalid.is_too_large());
    assert!(err.to_string().contains("over the outbox's limit"), "{err}");

    // a smaller limit of its own
    let small = Outbox::default().max_payload(100);
    let err = conn
        .transaction(|conn| {
            conn.record_event_in(
                &small,
                &BlobStored {
                    id: 2,
                    data: "y".repeat(200),
                },
            )
        })
        .expect_err("refused");
    assert!(matches!(err, diesel::result::Error::SerializationError(_)));
    // a batch with one oversized event writes none of them
    let batch = [
        BlobStored {
            id: 3,
            data: "ok".into(),
        },
        BlobStored {
            id: 4,
            data: "z".repeat(300),
        },
    ];
    conn.transaction(|conn| conn.record_events_in(&small, &batch))
        .expect_err("refused");
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 0);
}

#[tokio::test]
async fn a_row_published_twice_is_one_message_in_the_stream() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let mut conn = db.conn();
    conn.transaction(|conn| {
        conn.record_events(&[
            OrderPlaced {
                order_id: "a".into(),
                n: 1,
            },
            OrderPlaced {
                order_id: "b".into(),
                n: 2,
            },
        ])
    })
    .expect("commit");
    let relay = InProcessRelay::start(config(&db, &stream), &stream).await;
    wait_published(&db, 2, Duration::from_secs(120)).await;
    relay.stop().await;
    // the relay died between publish and record: the rows look unpublished again
    diesel::sql_query("DELETE FROM outbox_progress")
        .execute(&mut conn)
        .expect("forget the progress");
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL"),
        2
    );
    let relay = InProcessRelay::start(config(&db, &stream), &stream).await;
    wait_published(&db, 2, Duration::from_secs(120)).await;
    relay.stop().await;
    assert_eq!(
        stream.count().await,
        2,
        "JetStream dropped the re-published rows by Nats-Msg-Id"
    );
}

#[tokio::test]
async fn hostile_aggregate_ids_make_valid_subjects_that_round_trip() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let ids = [
        "a.b",
        "*",
        ">",
        "two words",
        "tab\there",
        "Zürich",
        "日本.>",
        "%2E",
        "a..b",
    ];
    let mut conn = db.conn();
    conn.transaction(|conn| {
        for (n, id) in ids.iter().enumerate() {
            conn.record_event(&OrderPlaced {
                order_id: (*id).into(),
                n: n as i64,
            })?;
        }
        Ok::<_, diesel::result::Error>(())
    })
    .expect("commit");
    let relay = InProcessRelay::start(config(&db, &stream), &stream).await;
    wait_published(&db, ids.len() as i64, Duration::from_secs(120)).await;
    relay.stop().await;
    let got = stream.read_all().await;
    assert_eq!(got.len(), ids.len());
    let template = outbox_nats::subject::SubjectTemplate::default();
    for (msg, id) in got.iter().zip(ids) {
        let tokens: Vec<&str> = msg.subject.split('.').collect();
        assert_eq!(tokens.len(), 3, "{}", msg.subject);
        assert!(
            tokens
                .iter()
                .all(|t| !t.is_empty() && *t != "*" && *t != ">"),
            "{}",
            msg.subject
        );
        assert!(
            msg.subject.chars().all(|c| c.is_ascii_graphic()),
            "{}",
            msg.subject
        );
        assert_eq!(template.aggregate_id_of(&msg.subject).as_deref(), Some(id));
        assert_eq!(msg.aggregate_id, id, "the header carries the raw id");
    }
}

#[tokio::test]
async fn a_row_inserted_by_plain_sql_is_relayed_like_any_other() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    diesel::sql_query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('0190f5f0-0000-7000-8000-000000000001', 'invoice', 'inv-9', 'invoice.sent', '{\"to\": \"x@y\"}')",
    )
    .execute(&mut db.conn())
    .expect("plain insert");
    let relay = InProcessRelay::start(config(&db, &stream), &stream).await;
    wait_published(&db, 1, Duration::from_secs(120)).await;
    relay.stop().await;
    let got = stream.read_all().await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].msg_id, "0190f5f0-0000-7000-8000-000000000001");
    assert_eq!(got[0].subject, format!("{}.invoice.inv-9", stream.prefix));
    assert_eq!(got[0].payload, serde_json::json!({"to": "x@y"}));
}

#[tokio::test]
async fn a_schema_qualified_table_of_another_name_works_end_to_end() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let table: OutboxTable = "billing.events".parse().expect("name");
    let mut conn = db.conn();
    diesel::sql_query("CREATE SCHEMA billing")
        .execute(&mut conn)
        .expect("schema");
    outbox_diesel::create_table(&mut conn, &table).expect("create table");
    outbox_diesel::create_table(&mut conn, &table).expect("create table is idempotent");
    let billing = Outbox::new(table.clone());
    conn.transaction(|conn| {
        conn.record_event_in(
            &billing,
            &OrderPlaced {
                order_id: "b-1".into(),
                n: 1,
            },
        )
    })
    .expect("commit");
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 0);
    let relay = InProcessRelay::start(config(&db, &stream).table(table), &stream).await;
    wait_until(Duration::from_secs(30), "published", || async {
        db.scalar("SELECT count(*) FROM billing.events_audit WHERE published_at IS NOT NULL") == 1
    })
    .await;
    relay.stop().await;
    assert_eq!(stream.count().await, 1);
}

#[tokio::test]
async fn async_and_pooled_connections_record_in_their_transaction() {
    use diesel_async::AsyncConnection;
    use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    use diesel_async::pooled_connection::deadpool::Pool;

    let db = TestDb::new();
    let mut conn = db.async_conn().await;
    conn.transaction(async |conn| {
        conn.record_event(&OrderPlaced {
            order_id: "async-1".into(),
            n: 1,
        })
        .await?;
        Ok::<_, diesel::result::Error>(())
    })
    .await
    .expect("commit");
    let rolled_back: Result<(), diesel::result::Error> = conn
        .transaction(async |conn| {
            conn.record_event(&OrderPlaced {
                order_id: "async-2".into(),
                n: 2,
            })
            .await?;
            Err(diesel::result::Error::RollbackTransaction)
        })
        .await;
    assert!(rolled_back.is_err());

    let pool = Pool::builder(AsyncDieselConnectionManager::<
        diesel_async::AsyncPgConnection,
    >::new(&db.url))
    .build()
    .expect("pool");
    let mut pooled = pool.get().await.expect("pooled connection");
    pooled
        .transaction(async |conn| {
            conn.record_events(&[OrderPlaced {
                order_id: "pooled-1".into(),
                n: 3,
            }])
            .await?;
            Ok::<_, diesel::result::Error>(())
        })
        .await
        .expect("commit");

    let r2d2 = diesel::r2d2::Pool::builder()
        .max_size(1)
        .build(diesel::r2d2::ConnectionManager::<PgConnection>::new(
            &db.url,
        ))
        .expect("r2d2 pool");
    let mut c = r2d2.get().expect("r2d2 connection");
    c.transaction(|conn| {
        conn.record_event(&OrderPlaced {
            order_id: "r2d2-1".into(),
            n: 4,
        })
    })
    .expect("commit");
    assert!(matches!(
        c.record_event(&OrderPlaced {
            order_id: "r2d2-2".into(),
            n: 5
        }),
        Err(diesel::result::Error::NotInTransaction)
    ));

    let mut ids: Vec<String> = {
        use outbox_diesel::schema::outbox::dsl::*;
        outbox
            .select(aggregate_id)
            .order(seq)
            .load(&mut db.conn())
            .expect("load")
    };
    ids.sort();
    assert_eq!(ids, ["async-1", "pooled-1", "r2d2-1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_events_from_eight_writers_arrive_complete_and_in_order_per_aggregate() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    const WRITERS: usize = 8;
    const PER_WRITER: usize = 1250;
    const AGGREGATES: usize = 200;
    let relay = InProcessRelay::start(config(&db, &stream), &stream).await;
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let url = db.url.clone();
        writers.push(std::thread::spawn(move || {
            let mut conn = PgConnection::establish(&url).expect("connect");
            for i in 0..PER_WRITER {
                let n = (w * PER_WRITER + i) as i64;
                let agg = format!("agg-{}", (n as usize * 7919) % AGGREGATES);
                conn.transaction(|conn| {
                    // the documented rule: serialise an aggregate's writers by locking it first
                    diesel::sql_query("SELECT pg_advisory_xact_lock(hashtext($1))")
                        .bind::<diesel::sql_types::Text, _>(&agg)
                        .execute(conn)?;
                    conn.record_event(&OrderPlaced {
                        order_id: agg.clone(),
                        n,
                    })
                })
                .expect("commit");
            }
        }));
    }
    for w in writers {
        w.join().expect("writer");
    }
    let total = (WRITERS * PER_WRITER) as i64;
    wait_published(&db, total, Duration::from_secs(120)).await;
    relay.stop().await;

    let got = stream.read_all().await;
    assert_eq!(got.len() as i64, total, "every event once");
    // commit order per aggregate = seq order (writers of one aggregate were serialised)
    let mut conn = db.conn();
    let rows: Vec<(i64, uuid::Uuid, String)> = {
        use outbox_diesel::schema::outbox::dsl::*;
        outbox
            .select((seq, id, aggregate_id))
            .order(seq)
            .load(&mut conn)
            .expect("rows")
    };
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    for (_, id, agg) in &rows {
        expected
            .entry(agg.clone())
            .or_default()
            .push(id.to_string());
    }
    let mut seen: HashMap<String, Vec<String>> = HashMap::new();
    for m in &got {
        seen.entry(m.aggregate_id.clone())
            .or_default()
            .push(m.msg_id.clone());
    }
    assert_eq!(seen.len(), AGGREGATES);
    for (agg, ids) in &expected {
        assert_eq!(seen.get(agg), Some(ids), "order of aggregate {agg}");
    }
}

/// `--delete-published`: rows are deleted as JetStream acks them. The relay (the binary) is
/// killed three times while four writers commit; every event still arrives once, in the order
/// of its aggregate's transactions, and the table ends empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delete_published_relay_killed_mid_stream_loses_nothing_and_keeps_order() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    const WRITERS: usize = 4;
    const PER_WRITER: usize = 1000;
    const AGGREGATES: usize = 50;
    diesel::connection::SimpleConnection::batch_execute(
        &mut db.conn(),
        "CREATE TABLE counters (agg text PRIMARY KEY, v bigint NOT NULL); \
         INSERT INTO counters SELECT 'agg-' || i, 0 FROM generate_series(0, 49) i",
    )
    .expect("counters");
    let relay_args = ["--delete-published", "--batch-size", "50"];
    let mut relay = support::Proc::spawn(
        "relay",
        &mut support::relay_command(&db, &stream, &relay_args),
    );
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let url = db.url.clone();
        writers.push(std::thread::spawn(move || {
            let mut conn = PgConnection::establish(&url).expect("connect");
            for i in 0..PER_WRITER {
                let agg = format!("agg-{}", (w * 7 + i * 13) % AGGREGATES);
                conn.transaction(|conn| {
                    // the aggregate's row lock serialises its writers; `v` numbers its events
                    #[derive(QueryableByName)]
                    struct V {
                        #[diesel(sql_type = diesel::sql_types::BigInt)]
                        v: i64,
                    }
                    let v: V = diesel::sql_query(
                        "UPDATE counters SET v = v + 1 WHERE agg = $1 RETURNING v",
                    )
                    .bind::<diesel::sql_types::Text, _>(&agg)
                    .get_result(conn)?;
                    conn.record_event(&OrderPlaced {
                        order_id: agg.clone(),
                        n: v.v,
                    })
                })
                .expect("commit");
            }
        }));
    }
    for _ in 0..3 {
        let before = stream.count().await;
        wait_until(
            Duration::from_secs(60),
            "the relay to publish more",
            || async { stream.count().await >= before + 300 },
        )
        .await;
        relay.kill();
        relay = support::Proc::spawn(
            "relay",
            &mut support::relay_command(&db, &stream, &relay_args),
        );
    }
    for w in writers {
        w.join().expect("writer");
    }
    wait_until(Duration::from_secs(120), "an empty outbox", || async {
        db.scalar("SELECT count(*) FROM outbox") == 0
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(20)), Some(0));

    let got = stream.read_all().await;
    assert_eq!(got.len(), WRITERS * PER_WRITER, "every event once");
    let mut seen: HashMap<String, Vec<i64>> = HashMap::new();
    for m in &got {
        let n = m.payload["n"].as_i64().expect("n");
        seen.entry(m.aggregate_id.clone()).or_default().push(n);
    }
    assert_eq!(seen.len(), AGGREGATES);
    for (agg, ns) in &seen {
        let expected: Vec<i64> = (1..=ns.len() as i64).collect();
        assert_eq!(ns, &expected, "events of {agg} in commit order, none lost");
    }
}

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

/// A relay of `mode` that polls, and balances its partitions, every 10 s, and lingers `linger`
/// after a read that found rows: between those, only a notification wakes it.
fn polling_every_10s(
    db: &TestDb,
    stream: &TestStream,
    mode: outbox_nats::Mode,
    linger: Duration,
) -> RelayConfig {
    let mut config = config(db, stream)
        .poll_interval(Duration::from_secs(10))
        .lease(Duration::from_secs(40))
        .linger(linger);
    config.mode = mode;
    config.standby_interval = Duration::from_secs(10);
    config
}

/// A writer that notifies once a minute (so only its first commit wakes the relay), the
/// relay polling (and balancing its partitions, which reads too) every 10 s and lingering 3 s
/// after a read that found rows.
async fn commits_after_a_notified_one(mode: outbox_nats::Mode) {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let outbox = Outbox::new(OutboxTable::default())
        .notify(outbox_diesel::Notify::Debounced(Duration::from_secs(60)));
    let config = polling_every_10s(&db, &stream, mode, Duration::from_secs(3));
    let relay = InProcessRelay::start(config, &stream).await;
    let mut conn = db.conn();
    let record = |conn: &mut PgConnection, n: i64| {
        conn.transaction(|conn| {
            conn.record_event_in(
                &outbox,
                &OrderPlaced {
                    order_id: "o-1".into(),
                    n,
                },
            )
        })
        .expect("record");
    };
    // notified: read at once
    record(&mut conn, 1);
    wait_published(&db, 1, Duration::from_secs(20)).await;
    // within the debounce, so not notified: read by the relay's lingering reads
    record(&mut conn, 2);
    wait_until(
        Duration::from_secs(5),
        "the unnotified commit published while the relay lingers, before its next poll",
        || async { stream.count().await == 2 },
    )
    .await;
    // once the linger is over the relay waits for a NOTIFY or its poll again: an unnotified
    // commit waits for the poll (10 s)
    tokio::time::sleep(Duration::from_secs(4)).await;
    record(&mut conn, 3);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        stream.count().await,
        2,
        "the relay stops reading every few hundred milliseconds once the linger is over"
    );
    wait_until(
        Duration::from_secs(20),
        "the last commit published at the poll",
        || async { stream.count().await == 3 },
    )
    .await;
    relay.stop().await;
    let got = stream.read_all().await;
    let ns: Vec<i64> = got
        .iter()
        .map(|m| m.payload["n"].as_i64().unwrap_or(-1))
        .collect();
    assert_eq!(ns, [1, 2, 3]);
}

#[tokio::test]
async fn ordered_relay_reads_commits_after_a_notified_one_within_its_linger() {
    commits_after_a_notified_one(outbox_nats::Ordered::default().into()).await;
}

#[tokio::test]
async fn unordered_relay_reads_commits_after_a_notified_one_within_its_linger() {
    commits_after_a_notified_one(outbox_nats::Unordered::default().workers(1).into()).await;
}

/// A parked row, released by `retry` while the relay idles (polling and balancing every 10 s):
/// `retry` notifies the table's channel, and the relay publishes the row at once (before, at
/// its next poll: an idle relay's question does not see a row whose `UPDATE` kept its
/// transaction id).
/// `before_retry`: the rows published before it (5 when the parked row holds the rest of its
/// aggregate back, in the ordered mode; 10 in the unordered one).
async fn retry_wakes_an_idle_relay(mode: outbox_nats::Mode, before_retry: u64) {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let outbox = Outbox::new(OutboxTable::default());
    let mut conn = db.conn();
    let record = |conn: &mut PgConnection, order: &str, n: i64| {
        conn.transaction(|conn| {
            conn.record_event_in(
                &outbox,
                &OrderPlaced {
                    order_id: order.into(),
                    n,
                },
            )
        })
        .expect("record");
    };
    record(&mut conn, "o-1", 0);
    db.execute("UPDATE outbox SET parked_at = now(), attempts = 5", "park");
    for n in 1..=5 {
        record(&mut conn, "o-1", n);
        record(&mut conn, "o-2", n);
    }
    let config = polling_every_10s(&db, &stream, mode, Duration::from_millis(200));
    let relay = InProcessRelay::start(config, &stream).await;
    wait_until(
        Duration::from_secs(20),
        "every row published that the parked one does not hold back",
        || async { stream.count().await == before_retry },
    )
    .await;
    // past the linger and the first looks: the relay waits for a notification or its poll
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut a = db.async_conn().await;
    let released = outbox_nats::operations::retry(
        &mut a,
        &OutboxTable::DEFAULT,
        outbox_nats::operations::Retry::All,
    )
    .await
    .expect("retry");
    assert_eq!(released, 1);
    wait_until(
        Duration::from_secs(3),
        "the released row published at once, not at the next poll",
        || async { stream.count().await == 11 },
    )
    .await;
    relay.stop().await;
    let o1: Vec<i64> = stream
        .read_all()
        .await
        .iter()
        .filter(|m| m.aggregate_id == "o-1")
        .map(|m| m.payload["n"].as_i64().unwrap_or(-1))
        .collect();
    if before_retry == 5 {
        // ordered: the released row first, then the rows it held back
        assert_eq!(o1, [0, 1, 2, 3, 4, 5]);
    } else {
        assert_eq!(o1, [1, 2, 3, 4, 5, 0]);
    }
}

#[tokio::test]
async fn retry_wakes_an_idle_ordered_relay_at_once() {
    retry_wakes_an_idle_relay(outbox_nats::Ordered::default().into(), 5).await;
}

#[tokio::test]
async fn retry_wakes_idle_unordered_workers_at_once() {
    retry_wakes_an_idle_relay(outbox_nats::Unordered::default().workers(2).into(), 10).await;
}

/// Relays that look at the partitions' shares every 20 s: one that joins, and one that
/// stops, move the shares at once (relays tell each other with `NOTIFY`), whether the others
/// are idle or standing by, not at the others' next look.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_move_the_shares_at_once_when_one_joins_or_stops() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let relay = || {
        let mut config = config(&db, &stream).lease(Duration::from_secs(60));
        config.mode = outbox_nats::Ordered::default().partitions(2).into();
        config.standby_interval = Duration::from_secs(20);
        InProcessRelay::start(config, &stream)
    };
    let soon = Duration::from_secs(5);
    let a = relay().await;
    wait_until(soon, "the first relay owns both partitions", || async {
        support::partitions_per_owner(&db).values().eq([&2])
    })
    .await;
    // past the first relay's second look (100 ms after its first): its next is 20 s away
    tokio::time::sleep(Duration::from_secs(1)).await;

    let b = relay().await;
    wait_until(
        soon,
        "a relay that joins gets its share at once",
        || async {
            let s = support::partitions_per_owner(&db);
            s.len() == 2 && s.values().all(|&n| n == 1)
        },
    )
    .await;
    let first_two: Vec<i32> = support::partitions_per_owner(&db).into_keys().collect();

    // a third relay stands by: no partition is left for it
    let c = relay().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let s = support::partitions_per_owner(&db);
    assert!(
        s.len() == 2 && s.keys().all(|pid| first_two.contains(pid)),
        "the two relays keep their partitions: {s:?}"
    );

    a.stop().await;
    wait_until(
        soon,
        "the relay standing by takes the partition of one that stops, at once",
        || async {
            let s = support::partitions_per_owner(&db);
            s.len() == 2
                && s.values().all(|&n| n == 1)
                && s.keys().any(|pid| !first_two.contains(pid))
        },
    )
    .await;

    b.stop().await;
    wait_until(
        soon,
        "the relay left takes the partition of the next that stops, at once",
        || async {
            let s = support::partitions_per_owner(&db);
            s.len() == 1 && s.iter().all(|(pid, &n)| n == 2 && !first_two.contains(pid))
        },
    )
    .await;

    let mut conn = db.conn();
    for i in 0..20 {
        conn.transaction(|conn| {
            conn.record_event(&OrderPlaced {
                order_id: format!("o-{}", i % 5),
                n: i,
            })
        })
        .expect("record");
    }
    wait_published(&db, 20, Duration::from_secs(30)).await;
    c.stop().await;
    assert_eq!(stream.count().await, 20);
}
