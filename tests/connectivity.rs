//! Production connectivity: NATS seed lists and clusters, TLS to NATS and to PostgreSQL,
//! against private servers that each test starts and stops.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use outbox_diesel::{OutboxEvent, OutboxExt};
use outbox_nats::NatsOptions;
use outbox_nats::consumer::{Consumer, ConsumerConfig, Delivery};
use serde::{Deserialize, Serialize};
use support::servers::NatsCluster;
use support::{Proc, TestDb, TestStream, relay_command, wait_until};
use tokio_util::sync::CancellationToken;

const TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "order", event_type = "order.placed")]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    order_id: i64,
}

/// Records `n` events, one transaction each, order ids `from..from + n`.
fn record(db: &TestDb, from: i64, n: i64) {
    let mut conn = db.conn();
    for order_id in from..from + n {
        conn.transaction(|c| c.record_event(&OrderPlaced { order_id }))
            .expect("record");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_connect_through_a_seed_list_whose_first_seed_is_down() {
    let mut cluster = NatsCluster::start();
    cluster.kill(0);
    let seeds = cluster.urls();
    let (db, consumer_db) = (TestDb::new(), TestDb::new());
    let stream = TestStream::on(&seeds);
    record(&db, 0, 20);

    let _relay = Proc::spawn("outbox-relay", &mut relay_command(&db, &stream, &[]));
    wait_until(TIMEOUT, "20 events in the stream", || async {
        stream.count().await == 20
    })
    .await;

    let nats = NatsOptions::new(seeds.clone())
        .connect()
        .await
        .expect("the consumer connects through the seed list");
    let handled = Arc::new(AtomicUsize::new(0));
    let counted = handled.clone();
    let config = ConsumerConfig::new("seeds", consumer_db.url.clone())
        .stream(stream.name.clone())
        .filter_subject(format!("{}.>", stream.prefix))
        .fetch_wait(Duration::from_millis(200));
    let shutdown = CancellationToken::new();
    let consumer = tokio::spawn(Consumer::new(config, nats).run(
        shutdown.clone(),
        async move |_conn: &mut AsyncPgConnection, _msg: Delivery<OrderPlaced>| {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok::<(), diesel::result::Error>(())
        },
    ));
    wait_until(TIMEOUT, "the consumer handled 20 events", || async {
        handled.load(Ordering::SeqCst) == 20
    })
    .await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), consumer)
        .await
        .expect("the consumer stops")
        .expect("consumer task")
        .expect("consumer result");
}

#[test]
fn relay_refuses_a_seed_list_with_a_bad_url_at_once() {
    let (db, stream) = (
        TestDb::new(),
        TestStream::on("nats://127.0.0.1:4222,nats://b:notaport"),
    );
    let mut relay = Proc::spawn(
        "outbox-relay",
        relay_command(&db, &stream, &[]).stderr(std::process::Stdio::piped()),
    );
    let code = relay.wait_exit(Duration::from_secs(10));
    assert_eq!(code, Some(1), "exits at once with a configuration error");
    let mut err = String::new();
    use std::io::Read;
    relay
        .child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("read stderr");
    assert!(
        err.contains("nats://b:notaport") && err.contains("comma-separated"),
        "names the bad seed and the form: {err}"
    );
}
