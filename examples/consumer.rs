//! # A consumer of the shop's events
//!
//! Reads the events the shop (`cargo run --example shop`) publishes, through
//! `outbox_nats::Consumer`: a durable JetStream pull consumer on the stream `OUTBOX` whose
//! handler runs inside a PostgreSQL transaction together with the inbox check, and which acks
//! each message only after that transaction committed.
//!
//! Delivery is at least once: JetStream drops the duplicates that reach it within the stream's
//! duplicate window, and a message can still come twice (a relay that died after publishing and
//! before marking publishes it again; a consumer that died between its commit and its ack gets
//! it again). The inbox (`processed_messages`, in the consumer's own database) remembers every
//! message id this consumer committed, so each event changes the consumer's state once: here,
//! a per-order tally in the table `order_tally`.
//!
//! ```text
//! cargo run --example consumer
//! cargo run --example consumer -- --name billing --filter 'outbox.order.>'
//! ```
//!
//! Settings (flag or environment variable): `--database-url` / `CONSUMER_DATABASE_URL` (its
//! own database, default `postgres://postgres@127.0.0.1:5432/outbox_shop_consumer`, created
//! when missing), `--nats-url` / `NATS_URL` (default `nats://127.0.0.1:4222`; a
//! comma-separated seed list for a cluster), `--stream` /
//! `OUTBOX_STREAM` (default `OUTBOX`), `--name` / `CONSUMER_NAME` (the durable consumer,
//! default `shop-consumer`), `--filter` / `CONSUMER_FILTER` (default `outbox.>`). Two runs with
//! the same `--name` share the work; different names each see every event. Stop with Ctrl-C.
//!
//! The events go to stdout, one line each; logs and messages go to stderr.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use diesel_async::AsyncPgConnection;
use outbox_diesel::OutboxEvent;
use outbox_nats::cli::NatsArgs;
use outbox_nats::consumer::{Consumer, ConsumerConfig, Delivery};
use outbox_nats::redact_url;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

/// Prints the shop's events, each once, and keeps a tally per order.
#[derive(Debug, Parser)]
#[command(name = "consumer")]
struct Args {
    /// The consumer's own database (inbox and tally); created when missing.
    #[arg(
        long,
        env = "CONSUMER_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/outbox_shop_consumer",
        hide_env_values = true
    )]
    database_url: String,
    /// NATS: `--nats-url` (a seed list too), credentials and TLS, as `outbox-relay` takes them.
    #[command(flatten)]
    nats: NatsArgs,
    /// The stream the relay publishes to.
    #[arg(long, env = "OUTBOX_STREAM", default_value = "OUTBOX")]
    stream: String,
    /// The durable consumer's name.
    #[arg(long, env = "CONSUMER_NAME", default_value = "shop-consumer")]
    name: String,
    /// Only subjects matching this filter.
    #[arg(long, env = "CONSUMER_FILTER", default_value = "outbox.>")]
    filter: String,
}

/// The shop's events, as the consumer reads them (the shop records them `untagged`: the event
/// type travels in the `Outbox-Event-Type` header, the payload is the variant's fields).
#[derive(Debug, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
#[serde(untagged)]
enum OrderEvent {
    #[outbox(event_type = "order.placed")]
    Placed {
        #[outbox(aggregate_id)]
        order_id: i64,
        customer: String,
        total_cents: i64,
    },
    #[outbox(event_type = "order.paid")]
    Paid {
        #[outbox(aggregate_id)]
        order_id: i64,
        total_cents: i64,
    },
    #[outbox(event_type = "order.cancelled")]
    Cancelled {
        #[outbox(aggregate_id)]
        order_id: i64,
        reason: Option<String>,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    // logs go to stderr; the events, the data, go to stdout
    logs::init();
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("consumer: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let url = args.database_url.clone();
    tokio::task::spawn_blocking(move || {
        database::prepare(&url, "CONSUMER_DATABASE_URL", &[TALLY_DDL])
    })
    .await
    .context("database set-up task")??;
    let mut nats = args.nats.options();
    nats.name = Some(args.name.clone());
    let nats = nats.connect().await.with_context(|| {
        format!(
            "cannot reach NATS at {}; start nats-server -js or set NATS_URL",
            redact_url(&args.nats.nats_url)
        )
    })?;
    let config = ConsumerConfig::new(args.name.clone(), args.database_url.clone())
        .stream(args.stream.clone())
        .filter_subject(args.filter.clone());
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    eprintln!(
        "consuming {} ({}) as {}; Ctrl-C to stop",
        args.stream, args.filter, args.name
    );
    Consumer::new(config, nats)
        .run(
            shutdown,
            async |conn: &mut AsyncPgConnection, msg: Delivery<OrderEvent>| {
                use diesel_async::RunQueryDsl;
                println!(
                    "{} {} {} {:?}",
                    msg.subject, msg.message_id, msg.event_type, msg.event
                );
                // the tally commits together with the inbox entry, then the message is acked
                diesel::sql_query(
                    "INSERT INTO order_tally (order_id, events) VALUES ($1, 1) \
                 ON CONFLICT (order_id) DO UPDATE SET events = order_tally.events + 1",
                )
                .bind::<diesel::sql_types::BigInt, _>(order_id(&msg.event))
                .execute(conn)
                .await?;
                Ok::<_, diesel::result::Error>(())
            },
        )
        .await?;
    eprintln!("consumer stopped");
    Ok(())
}

fn order_id(e: &OrderEvent) -> i64 {
    match e {
        OrderEvent::Placed { order_id, .. }
        | OrderEvent::Paid { order_id, .. }
        | OrderEvent::Cancelled { order_id, .. } => *order_id,
    }
}

#[path = "support/database.rs"]
mod database;
#[path = "support/logs.rs"]
mod logs;

/// The per-order tally, created beside the inbox.
const TALLY_DDL: &str =
    "CREATE TABLE IF NOT EXISTS order_tally (order_id bigint PRIMARY KEY, events bigint NOT NULL)";
