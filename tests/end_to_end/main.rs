//! The end-to-end slice against the machine's PostgreSQL and NATS: record in the caller's
//! transaction, relay, and read the stream back.
//!
//! - `recording`: what a transaction records, and what it refuses;
//! - `delivery`: what arrives in the stream, once and in order, from any writer and any table;
//! - `upgrades`: tables made by earlier migrations, refused until upgraded, then relayed;
//! - `wake_ups`: what wakes an idle relay (a writer's notification, `retry`, another relay).

mod delivery;
mod recording;
#[path = "../support/mod.rs"]
mod support;
mod upgrades;
mod wake_ups;

use std::time::Duration;

use outbox_diesel::OutboxEvent;
use outbox_nats::{Relay, RelayConfig};
use serde::Serialize;
use support::{TestDb, TestStream};

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
