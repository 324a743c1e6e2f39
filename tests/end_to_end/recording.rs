//! Recording: a committed transaction's events are published with the contract, a rolled-back
//! one's never; recording outside a transaction, or an oversized payload, is refused at record
//! time; async and pooled connections record in their transaction.

use std::time::Duration;

use diesel::prelude::*;
use outbox_diesel::{AsyncOutboxExt, Outbox, OutboxEvent, OutboxExt};
use serde::Serialize;

use crate::support::{TestDb, TestStream, wait_published};
use crate::{InProcessRelay, OrderPlaced, config, create_orders, orders};

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
