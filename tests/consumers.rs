//! Consumers against the machine's PostgreSQL and NATS: the inbox, and the JetStream consumer
//! helper that applies each event once whatever the number of deliveries.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use futures_util::StreamExt;
use outbox_diesel::relay::OutboxRow;
use outbox_diesel::{AsyncInboxExt, Inbox, InboxExt, OutboxEvent, OutboxExt};
use outbox_nats::consumer::{Consumer, ConsumerConfig, ConsumerError, Delivery, Outcome};
use outbox_nats::publish::to_message;
use outbox_nats::subject::SubjectTemplate;
use outbox_nats::{Relay, RelayConfig};
use serde::{Deserialize, Serialize};
use support::{TestDb, TestStream, wait_until};
use tokio_util::sync::CancellationToken;

const DURABLE: &str = "billing";
const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "account")]
enum AccountEvent {
    Credited {
        #[outbox(aggregate_id)]
        account: String,
        amount: i64,
    },
    Debited {
        #[outbox(aggregate_id)]
        account: String,
        amount: i64,
    },
}

fn credited(amount: i64) -> AccountEvent {
    AccountEvent::Credited {
        account: "a".into(),
        amount,
    }
}

/// The consumer's state: a balance that every event changes, so a second application shows.
fn create_balances(db: &TestDb) {
    db.execute(
        "CREATE TABLE balances (account text PRIMARY KEY, total bigint NOT NULL)",
        "create balances",
    );
    db.execute("INSERT INTO balances VALUES ('a', 0)", "insert balance");
}

fn balance(db: &TestDb) -> i64 {
    db.scalar("SELECT total FROM balances WHERE account = 'a'")
}

fn inbox_rows(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) FROM processed_messages")
}

/// Applies an event to `balances`.
async fn apply(conn: &mut AsyncPgConnection, event: &AccountEvent) -> QueryResult<()> {
    let (account, delta) = match event {
        AccountEvent::Credited { account, amount } => (account, *amount),
        AccountEvent::Debited { account, amount } => (account, -*amount),
    };
    let update = diesel::sql_query("UPDATE balances SET total = total + $1 WHERE account = $2")
        .bind::<BigInt, _>(delta)
        .bind::<Text, _>(account);
    diesel_async::RunQueryDsl::execute(update, conn)
        .await
        .map(drop)
}

/// What the test handlers saw.
#[derive(Default)]
struct Seen {
    calls: AtomicUsize,
    deliveries: Mutex<Vec<(String, u64)>>,
}

impl Seen {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn note(&self, msg: &Delivery<AccountEvent>) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.deliveries
            .lock()
            .expect("lock")
            .push((msg.message_id.clone(), msg.delivered));
    }
}

fn config(db: &TestDb, stream: &TestStream) -> ConsumerConfig {
    ConsumerConfig::new(DURABLE, db.url.clone())
        .stream(stream.name.clone())
        .filter_subject(format!("{}.>", stream.prefix))
        .ack_wait(Duration::from_secs(1))
        .fetch_wait(Duration::from_millis(200))
        .retry_delay(Duration::from_millis(100), Duration::from_millis(400))
        .startup_timeout(Duration::from_secs(10))
}

async fn create_stream(stream: &TestStream, duplicate_window: Duration) -> jetstream::Context {
    let js = stream.js().await;
    js.create_stream(stream::Config {
        duplicate_window,
        ..stream.config()
    })
    .await
    .expect("create the stream");
    js
}

/// The message the relay would publish for `event` recorded with id `id`.
fn relay_message(
    stream: &TestStream,
    id: uuid::Uuid,
    event: &AccountEvent,
) -> outbox_nats::publish::OutboxMessage {
    let row = OutboxRow {
        seq: 1,
        id,
        aggregate_type: event.aggregate_type().to_owned(),
        aggregate_id: event.aggregate_id(),
        event_type: event.event_type().to_owned(),
        payload: serde_json::to_value(event).expect("json").into(),
        headers: serde_json::json!({}),
        created_at: chrono::Utc::now(),
        attempts: 0,
    };
    to_message(&row, &SubjectTemplate::default(), &stream.prefix).expect("a valid message")
}

async fn publish(
    js: &jetstream::Context,
    msg: outbox_nats::publish::OutboxMessage,
) -> jetstream::publish::PublishAck {
    js.publish_with_headers(msg.subject, msg.headers, msg.payload)
        .await
        .expect("publish")
        .await
        .expect("publish ack")
}

async fn consumer_info(stream: &TestStream) -> Option<jetstream::consumer::Info> {
    let js = stream.js().await;
    let s = js.get_stream(&stream.name).await.ok()?;
    s.consumer_info(DURABLE).await.ok()
}

/// Waits until the durable consumer has acked (or terminated) every message up to `seq`.
async fn wait_settled(stream: &TestStream, seq: u64) {
    wait_until(TIMEOUT, &format!("stream sequence {seq} acked"), || async {
        consumer_info(stream)
            .await
            .is_some_and(|i| i.ack_floor.stream_sequence >= seq && i.num_ack_pending == 0)
    })
    .await;
}

/// A consumer running in this process until stopped (or dropped).
type RunningConsumer = support::task::Running<ConsumerError>;

impl RunningConsumer {
    async fn start<F, Er>(config: ConsumerConfig, stream: &TestStream, handler: F) -> Self
    where
        F: Clone + Send + Sync + 'static,
        for<'c> F: AsyncFnOnce(&'c mut AsyncPgConnection, Delivery<AccountEvent>) -> Result<(), Er>
            + outbox_nats::consumer::HandlerFn<
                &'c mut AsyncPgConnection,
                Delivery<AccountEvent>,
                Result<(), Er>,
                Fut: Send,
            >,
        Er: std::fmt::Display + Send + 'static,
    {
        let nats = async_nats::connect(&stream.nats_url)
            .await
            .expect("connect to NATS");
        Self::spawn("consumer", move |shutdown| {
            Consumer::new(config, nats).run(shutdown, handler)
        })
    }
}

/// A handler that applies the event and notes the delivery.
fn applying(
    seen: Arc<Seen>,
) -> impl for<'c> outbox_nats::consumer::HandlerFn<
    &'c mut AsyncPgConnection,
    Delivery<AccountEvent>,
    QueryResult<()>,
    Fut: Send,
> + Clone
+ Send
+ Sync
+ 'static {
    async move |conn: &mut AsyncPgConnection, msg: Delivery<AccountEvent>| {
        apply(conn, &msg.event).await?;
        seen.note(&msg);
        Ok(())
    }
}

#[tokio::test]
async fn same_event_published_twice_outside_the_dedup_window_changes_state_once() {
    let (producer, consumer_db, stream) = (TestDb::new(), TestDb::new(), TestStream::new());
    create_balances(&consumer_db);
    producer
        .conn()
        .transaction(|conn| conn.record_event(&credited(5)))
        .expect("record");

    // a relay with a tiny duplicate window, so that publishing the row again is not dropped
    let relay_config = RelayConfig::new(producer.url.clone())
        .stream(stream.name.clone())
        .subject_prefix(stream.prefix.clone())
        .poll_interval(Duration::from_millis(20))
        .duplicate_window(Duration::from_millis(200))
        .startup_timeout(Duration::from_secs(10));
    let nats = async_nats::connect(&stream.nats_url)
        .await
        .expect("connect");
    let relay_stop = CancellationToken::new();
    let relay = tokio::spawn(Relay::new(relay_config, nats).run(relay_stop.clone()));

    let seen = Arc::new(Seen::default());
    let consumer = RunningConsumer::start(
        config(&consumer_db, &stream),
        &stream,
        applying(seen.clone()),
    )
    .await;
    wait_settled(&stream, 1).await;
    assert_eq!(balance(&consumer_db), 5);

    // the same message stored again past the window: what a relay that died after publishing
    // and before marking does when the stream no longer shows the first copy to its look-up
    // (its limits or a purge removed it), or when an older relay without reconciling runs
    let js = stream.js().await;
    let first = support::read_raw(&js, &stream.name)
        .await
        .into_iter()
        .next()
        .expect("the relayed message");
    let (subject, headers, payload) = (
        first.subject.to_string(),
        first.headers.clone().unwrap_or_default(),
        first.payload.clone(),
    );
    wait_until(TIMEOUT, "the same message stored twice", || async {
        let ack = js
            .publish_with_headers(subject.clone(), headers.clone(), payload.clone())
            .await
            .expect("publish")
            .await
            .expect("ack");
        if ack.duplicate {
            // inside the window yet: JetStream dropped it
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        !ack.duplicate
    })
    .await;
    let messages = stream.read_all().await;
    assert_eq!(messages.len(), 2);
    assert_eq!(
        messages[0].msg_id, messages[1].msg_id,
        "one event, one message id"
    );

    wait_settled(&stream, 2).await;
    consumer.stop().await;
    relay_stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), relay).await;

    assert_eq!(balance(&consumer_db), 5, "the event changed the state once");
    assert_eq!(seen.calls(), 1, "the handler ran once");
    assert_eq!(inbox_rows(&consumer_db), 1);
}

#[tokio::test]
async fn consumer_killed_between_its_commit_and_its_ack_does_not_apply_the_event_twice() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    create_balances(&db);
    let js = create_stream(&stream, Duration::from_secs(120)).await;
    publish(
        &js,
        relay_message(&stream, uuid::Uuid::now_v7(), &credited(7)),
    )
    .await;
    let seen = Arc::new(Seen::default());

    // the first consumer commits the handler's change, then dies before acking
    {
        let nats = async_nats::connect(&stream.nats_url)
            .await
            .expect("connect");
        let consumer = Consumer::new(config(&db, &stream), nats.clone());
        let pull = consumer.pull_consumer().await.expect("durable consumer");
        let mut batch = pull
            .fetch()
            .max_messages(1)
            .messages()
            .await
            .expect("fetch");
        let msg = tokio::time::timeout(TIMEOUT, batch.next())
            .await
            .expect("a message within the timeout")
            .expect("a message")
            .expect("a message");
        let mut conn = db.async_conn().await;
        let processed = consumer
            .process(&mut conn, &msg, &applying(seen.clone()))
            .await;
        assert!(
            matches!(processed.outcome(), Outcome::Handled),
            "{:?}",
            processed.outcome()
        );
        assert_eq!(balance(&db), 7, "committed");
        // killed here: no ack; the connection goes away
        drop((msg, batch, pull, consumer));
        nats.drain().await.expect("close the connection");
    }
    let info = consumer_info(&stream).await.expect("consumer info");
    assert_eq!(
        info.ack_floor.stream_sequence, 0,
        "nothing acked before the restart"
    );

    // a new instance: JetStream redelivers after ack_wait, the inbox recognises the message
    let consumer =
        RunningConsumer::start(config(&db, &stream), &stream, applying(seen.clone())).await;
    wait_settled(&stream, 1).await;
    consumer.stop().await;

    assert_eq!(balance(&db), 7, "applied once");
    assert_eq!(
        seen.calls(),
        1,
        "the handler did not run for the redelivery"
    );
    assert_eq!(inbox_rows(&db), 1);
}

#[tokio::test]
async fn handler_error_rolls_back_the_change_and_the_inbox_entry_and_the_message_is_redelivered() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    create_balances(&db);
    let js = create_stream(&stream, Duration::from_secs(120)).await;
    publish(
        &js,
        relay_message(&stream, uuid::Uuid::now_v7(), &credited(3)),
    )
    .await;

    let seen = Arc::new(Seen::default());
    let failing_once = {
        let seen = seen.clone();
        async move |conn: &mut AsyncPgConnection, msg: Delivery<AccountEvent>| {
            apply(conn, &msg.event).await.map_err(|e| e.to_string())?;
            seen.note(&msg);
            if msg.delivered == 1 {
                // after its change: the change and the inbox entry must both roll back
                return Err("the downstream service is down".to_owned());
            }
            Ok(())
        }
    };
    let consumer = RunningConsumer::start(config(&db, &stream), &stream, failing_once).await;
    wait_settled(&stream, 1).await;
    consumer.stop().await;

    assert_eq!(balance(&db), 3, "the failed attempt's change rolled back");
    let deliveries = seen.deliveries.lock().expect("lock").clone();
    assert_eq!(deliveries.len(), 2, "{deliveries:?}");
    assert_eq!(deliveries[0].0, deliveries[1].0, "the same message");
    assert_eq!(
        (deliveries[0].1, deliveries[1].1),
        (1, 2),
        "redelivered after the nak"
    );
    assert_eq!(
        inbox_rows(&db),
        1,
        "the second attempt passed the inbox: the first entry rolled back"
    );
}

#[tokio::test]
async fn undecodable_message_does_not_block_the_ones_behind_it() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    create_balances(&db);
    let js = create_stream(&stream, Duration::from_secs(120)).await;
    let advisories = format!(
        "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{}.{DURABLE}",
        stream.name
    );
    let client = async_nats::connect(&stream.nats_url)
        .await
        .expect("connect");
    let mut terminated = client
        .subscribe(advisories)
        .await
        .expect("subscribe to advisories");
    client.flush().await.expect("flush");

    // poison: a body that is not the event's JSON, and a message without an id
    let mut bad_json = relay_message(&stream, uuid::Uuid::now_v7(), &credited(1));
    bad_json.payload = bytes::Bytes::from_static(b"{\"Credited\": \"not an object\"}");
    publish(&js, bad_json).await;
    publish(
        &js,
        relay_message(&stream, uuid::Uuid::now_v7(), &credited(10)),
    )
    .await;
    let mut no_id = relay_message(&stream, uuid::Uuid::now_v7(), &credited(1));
    no_id.headers = async_nats::HeaderMap::new();
    no_id.headers.insert("Outbox-Event-Type", "credited");
    publish(&js, no_id).await;
    publish(
        &js,
        relay_message(&stream, uuid::Uuid::now_v7(), &credited(20)),
    )
    .await;
    publish(
        &js,
        relay_message(
            &stream,
            uuid::Uuid::now_v7(),
            &AccountEvent::Debited {
                account: "a".into(),
                amount: 5,
            },
        ),
    )
    .await;

    // one message in flight at a time: without terminating, the first would block the rest
    let seen = Arc::new(Seen::default());
    let cfg = config(&db, &stream).max_ack_pending(1).undecodable_after(3);
    let consumer = RunningConsumer::start(cfg, &stream, applying(seen.clone())).await;
    wait_settled(&stream, 5).await;
    consumer.stop().await;

    assert_eq!(balance(&db), 25, "every good message applied once");
    assert_eq!(seen.calls(), 3);
    let mut sequences = Vec::new();
    for _ in 0..2 {
        let advisory = tokio::time::timeout(Duration::from_secs(5), terminated.next())
            .await
            .expect("a termination advisory within 5 s")
            .expect("advisory");
        let v: serde_json::Value =
            serde_json::from_slice(&advisory.payload).expect("advisory json");
        assert_eq!(v["deliveries"], 3, "terminated at the third delivery: {v}");
        sequences.push(v["stream_seq"].as_u64().expect("stream_seq"));
    }
    sequences.sort_unstable();
    assert_eq!(sequences, [1, 3], "the two poison messages were terminated");
}

#[tokio::test]
async fn shutdown_finishes_the_message_in_hand_then_returns() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    create_balances(&db);
    let js = create_stream(&stream, Duration::from_secs(120)).await;
    publish(
        &js,
        relay_message(&stream, uuid::Uuid::now_v7(), &credited(4)),
    )
    .await;

    let started = Arc::new(tokio::sync::Notify::new());
    let slow = {
        let started = started.clone();
        async move |conn: &mut AsyncPgConnection, msg: Delivery<AccountEvent>| {
            started.notify_one();
            tokio::time::sleep(Duration::from_millis(300)).await;
            apply(conn, &msg.event).await
        }
    };
    let consumer = RunningConsumer::start(config(&db, &stream), &stream, slow).await;
    tokio::time::timeout(TIMEOUT, started.notified())
        .await
        .expect("the handler starts");
    consumer.stop().await; // cancels while the handler runs

    assert_eq!(balance(&db), 4, "the message in hand was finished");
    // and acked: no consumer runs any more, so only the stopped one can have acked it
    wait_settled(&stream, 1).await;
}

#[tokio::test]
async fn missing_inbox_table_is_a_clear_start_up_error() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    create_stream(&stream, Duration::from_secs(120)).await;
    db.execute("DROP TABLE processed_messages", "drop");
    let nats = async_nats::connect(&stream.nats_url)
        .await
        .expect("connect");
    let run = Consumer::new(config(&db, &stream), nats)
        .run(CancellationToken::new(), applying(Arc::default()));
    let err = tokio::time::timeout(TIMEOUT, run)
        .await
        .expect("returns")
        .expect_err("refuses");
    assert!(matches!(err, ConsumerError::InboxMissing(_)), "{err}");
    assert!(err.to_string().contains("MIGRATIONS"), "{err}");
}

// --- the inbox on its own -------------------------------------------------------------------

#[test]
fn mark_processed_is_true_once_per_consumer_and_message() {
    let db = TestDb::new();
    let mut conn = db.conn();
    let mark = |conn: &mut PgConnection, consumer: &str, id: &str| {
        conn.transaction(|conn| conn.mark_processed(consumer, id))
            .expect("mark")
    };
    assert!(mark(&mut conn, "billing", "m-1"));
    assert!(!mark(&mut conn, "billing", "m-1"), "the same message again");
    assert!(
        mark(&mut conn, "shipping", "m-1"),
        "another consumer has its own entries"
    );
    assert!(mark(&mut conn, "billing", "m-2"));
    assert_eq!(inbox_rows(&db), 3);
}

#[test]
fn mark_processed_refuses_outside_a_transaction() {
    let db = TestDb::new();
    let refused = db.conn().mark_processed("billing", "m-1");
    assert!(
        matches!(refused, Err(diesel::result::Error::NotInTransaction)),
        "{refused:?}"
    );
    assert_eq!(inbox_rows(&db), 0, "nothing written");
}

#[test]
fn inbox_entry_rolls_back_with_the_consumers_transaction() {
    let db = TestDb::new();
    let mut conn = db.conn();
    let failed: Result<(), diesel::result::Error> = conn.transaction(|conn| {
        assert!(conn.mark_processed("billing", "m-1")?);
        Err(diesel::result::Error::RollbackTransaction)
    });
    assert!(failed.is_err());
    assert_eq!(inbox_rows(&db), 0);
    assert!(
        conn.transaction(|conn| conn.mark_processed("billing", "m-1"))
            .expect("mark")
    );
}

#[test]
fn a_racing_second_delivery_waits_for_the_first_and_sees_it() {
    let db = TestDb::new();
    let mut first = db.conn();
    first
        .transaction(|conn| {
            assert!(conn.mark_processed("billing", "m-1")?);
            let url = db.url.clone();
            let second = std::thread::spawn(move || {
                let mut conn = PgConnection::establish(&url).expect("connect");
                conn.transaction(|conn| conn.mark_processed("billing", "m-1")).expect("mark")
            });
            // the second insert waits on the first's uncommitted row
            let start = std::time::Instant::now();
            while db.scalar("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()") == 0 {
                assert!(start.elapsed() < TIMEOUT, "the second delivery never waited");
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok::<_, diesel::result::Error>(second)
        })
        .map(|second| assert!(!second.join().expect("second"), "the second sees the first's commit"))
        .expect("commit");
}

#[tokio::test]
async fn async_mark_processed_works_and_refuses_outside_a_transaction() {
    let db = TestDb::new();
    let mut conn = db.async_conn().await;
    let refused = conn.mark_processed("billing", "m-1").await;
    assert!(
        matches!(refused, Err(diesel::result::Error::NotInTransaction)),
        "{refused:?}"
    );
    let first = conn
        .transaction(async |conn| conn.mark_processed("billing", "m-1").await)
        .await
        .expect("mark");
    let again = conn
        .transaction(async |conn| conn.mark_processed("billing", "m-1").await)
        .await
        .expect("mark");
    assert!(first && !again);
}

#[test]
fn cleanup_deletes_entries_older_than_the_retention_in_batches() {
    let db = TestDb::new();
    let mut conn = db.conn();
    diesel::sql_query(
        "INSERT INTO processed_messages (consumer, message_id, processed_at) \
         SELECT 'billing', 'old-' || i, now() - interval '2 days' FROM generate_series(1, 25) i",
    )
    .execute(&mut conn)
    .expect("old entries");
    diesel::sql_query(
        "INSERT INTO processed_messages (consumer, message_id) \
         SELECT 'billing', 'new-' || i FROM generate_series(1, 5) i",
    )
    .execute(&mut conn)
    .expect("new entries");
    let day = Duration::from_secs(24 * 3600);
    let inbox = Inbox::global();
    assert_eq!(
        inbox
            .delete_older_than(&mut conn, day, 10)
            .expect("one batch"),
        10
    );
    assert_eq!(inbox.cleanup(&mut conn, day, 4).expect("cleanup"), 15);
    assert_eq!(inbox_rows(&db), 5, "recent entries stay");
    assert_eq!(
        db.scalar("SELECT count(*) FROM processed_messages WHERE message_id LIKE 'new-%'"),
        5
    );
}

#[test]
fn an_inbox_in_another_table() {
    let db = TestDb::new();
    let mut conn = db.conn();
    diesel::sql_query("CREATE SCHEMA billing")
        .execute(&mut conn)
        .expect("schema");
    let inbox = Inbox::new("billing.seen".parse().expect("valid"));
    inbox.create_table(&mut conn).expect("create");
    inbox.create_table(&mut conn).expect("create is idempotent");
    assert!(
        conn.transaction(|conn| conn.mark_processed_with(&inbox, "c", "m"))
            .expect("mark")
    );
    assert_eq!(db.scalar("SELECT count(*) FROM billing.seen"), 1);
    assert_eq!(inbox_rows(&db), 0, "not the default table");
}
