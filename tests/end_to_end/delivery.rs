//! Delivery: a row published twice is one message; hostile aggregate ids, plain-SQL rows and a
//! table of another name arrive like any other; many writers' events arrive complete and in
//! order per aggregate, with the relay killed mid-stream too.

use std::collections::HashMap;
use std::time::Duration;

use diesel::prelude::*;
use outbox_diesel::{Outbox, OutboxExt, OutboxTable};

use crate::support::{self, TestDb, TestStream, wait_published, wait_until};
use crate::{InProcessRelay, OrderPlaced, config};

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
