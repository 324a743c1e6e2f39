//! # A consumer of the outbox's events
//!
//! Reads the events the shop (`cargo run --example shop`) publishes: a durable JetStream pull
//! consumer on the stream `OUTBOX`, acking each message explicitly after it is handled. It
//! prints each event (subject, `Nats-Msg-Id`, event type, payload).
//!
//! Delivery is at least once: JetStream drops the duplicates that reach it within the stream's
//! duplicate window, and a message can still come twice (a relay that died after publishing
//! and before marking its row publishes it again later; a consumer that died before acking
//! gets it again). So the consumer drops duplicates itself, by `Nats-Msg-Id`, through an
//! [`Inbox`]: here an in-memory, bounded set. A durable consumer keeps its position across
//! restarts, but this inbox forgets, so keep processing idempotent or use a database inbox that
//! commits "seen" together with the handler's own writes (outbox-diesel's
//! `processed_messages`): only the `Inbox` implementation changes.
//!
//! ```text
//! cargo run --example consumer
//! cargo run --example consumer -- --name billing --filter 'outbox.order.>'
//! ```
//!
//! Settings (flag or environment variable): `--nats-url` / `NATS_URL` (default
//! `nats://127.0.0.1:4222`), `--stream` / `OUTBOX_STREAM` (default `OUTBOX`), `--name` /
//! `CONSUMER_NAME` (the durable consumer, default `shop-consumer`), `--filter` /
//! `CONSUMER_FILTER` (default `outbox.>`), `--remember` (message ids kept for dedup, default
//! 100000). Two runs with the same `--name` share the work; different names each see every
//! event. Stop with Ctrl-C.

use std::collections::{HashSet, VecDeque};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use async_nats::jetstream::{self, AckKind, consumer::AckPolicy, consumer::pull};
use clap::Parser;
use futures_util::StreamExt;
use outbox_nats::redact_url;

/// Prints the events of the outbox stream, once each.
#[derive(Debug, Parser)]
#[command(name = "consumer")]
struct Args {
    /// NATS server URL.
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    nats_url: String,
    /// The stream to read.
    #[arg(long, env = "OUTBOX_STREAM", default_value = "OUTBOX")]
    stream: String,
    /// The durable consumer's name: it keeps its position across restarts.
    #[arg(long, env = "CONSUMER_NAME", default_value = "shop-consumer")]
    name: String,
    /// Only subjects matching this filter (`outbox.order.>`, `outbox.order.42`).
    #[arg(long, env = "CONSUMER_FILTER", default_value = "outbox.>")]
    filter: String,
    /// How many message ids the in-memory inbox remembers.
    #[arg(long, default_value_t = 100_000)]
    remember: usize,
}

/// What a consumer has already processed, by message id.
///
/// The handler runs only for ids the inbox has not seen, and the id is remembered after the
/// handler succeeded. A database inbox does both in the handler's transaction.
trait Inbox {
    /// Whether `msg_id` was processed already.
    fn seen(&self, msg_id: &str) -> bool;
    /// Remembers `msg_id` as processed.
    fn remember(&mut self, msg_id: &str);
}

/// An [`Inbox`] in memory that forgets the oldest ids beyond `capacity`.
struct MemoryInbox {
    ids: HashSet<String>,
    order: VecDeque<String>,
    capacity: usize,
}

impl MemoryInbox {
    fn new(capacity: usize) -> Self {
        MemoryInbox {
            ids: HashSet::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }
}

impl Inbox for MemoryInbox {
    fn seen(&self, msg_id: &str) -> bool {
        self.ids.contains(msg_id)
    }

    fn remember(&mut self, msg_id: &str) {
        if self.ids.insert(msg_id.to_owned()) {
            self.order.push_back(msg_id.to_owned());
            while self.order.len() > self.capacity {
                if let Some(old) = self.order.pop_front() {
                    self.ids.remove(&old);
                }
            }
        }
    }
}

/// One event, as the outbox relay publishes it.
struct Event<'m> {
    subject: &'m str,
    msg_id: Option<&'m str>,
    event_type: &'m str,
    aggregate_id: &'m str,
    payload: String,
}

impl<'m> Event<'m> {
    fn of(msg: &'m async_nats::Message) -> Self {
        let header = |name: &str| {
            msg.headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str())
        };
        let payload = match serde_json::from_slice::<serde_json::Value>(&msg.payload) {
            Ok(json) => json.to_string(),
            Err(_) => String::from_utf8_lossy(&msg.payload).into_owned(),
        };
        Event {
            subject: msg.subject.as_str(),
            msg_id: header("Nats-Msg-Id"),
            event_type: header("Outbox-Event-Type").unwrap_or("?"),
            aggregate_id: header("Outbox-Aggregate-Id").unwrap_or("?"),
            payload,
        }
    }
}

fn is_stream_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::GetStreamErrorKind::JetStream(js)
            if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}

/// The business logic: here, print it.
fn handle(event: &Event<'_>) -> anyhow::Result<()> {
    println!(
        "{:<16} {:<24} order {:<6} Nats-Msg-Id {}\n  {}",
        event.event_type,
        event.subject,
        event.aggregate_id,
        event.msg_id.unwrap_or("(none)"),
        event.payload
    );
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    tokio::select! {
        result = run(args) => match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("consumer: {e:#}");
                ExitCode::FAILURE
            }
        },
        _ = tokio::signal::ctrl_c() => {
            eprintln!("consumer: stopped");
            ExitCode::SUCCESS
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let client = async_nats::ConnectOptions::new()
        .name("outbox-example-consumer")
        .connect(args.nats_url.as_str())
        .await
        .with_context(|| {
            format!(
                "cannot reach NATS at {}. Start nats-server with JetStream (`nats-server -js`), \
                 or set NATS_URL=nats://HOST:PORT",
                redact_url(&args.nats_url)
            )
        })?;
    let js = jetstream::new(client);

    let mut waiting = false;
    let stream = loop {
        match js.get_stream(&args.stream).await {
            Ok(stream) => break stream,
            Err(e) if is_stream_not_found(&e) => {
                if !waiting {
                    eprintln!(
                        "consumer: no stream {} yet; waiting for the relay to create it \
                         (start `cargo run --example shop`)",
                        args.stream
                    );
                    waiting = true;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => bail!(
                "cannot read stream {}: {e}; is JetStream enabled (`nats-server -js`)?",
                args.stream
            ),
        }
    };

    let consumer: jetstream::consumer::PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(args.name.clone()),
            filter_subject: args.filter.clone(),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .with_context(|| format!("cannot create the durable consumer {}", args.name))?;
    eprintln!(
        "consumer: {} reading stream {} (filter {}); Ctrl-C to stop",
        args.name, args.stream, args.filter
    );

    let mut inbox = MemoryInbox::new(args.remember);
    let mut messages = consumer
        .messages()
        .await
        .context("cannot start consuming")?;
    while let Some(next) = messages.next().await {
        let msg = match next {
            Ok(msg) => msg,
            Err(e) => {
                eprintln!("consumer: {e}; continuing");
                continue;
            }
        };
        let event = Event::of(&msg);
        match event.msg_id {
            Some(id) if inbox.seen(id) => {
                println!("duplicate {id} ({}): dropped", event.event_type);
            }
            id => match handle(&event) {
                Ok(()) => {
                    if let Some(id) = id {
                        inbox.remember(id);
                    }
                }
                Err(e) => {
                    eprintln!(
                        "consumer: handling {} failed: {e:#}; redelivering later",
                        event.subject
                    );
                    let delay = AckKind::Nak(Some(Duration::from_secs(5)));
                    if let Err(e) = msg.ack_with(delay).await {
                        eprintln!("consumer: nak failed: {e}");
                    }
                    continue;
                }
            },
        }
        // Ack after the work is done: a crash before this line means redelivery, not loss.
        if let Err(e) = msg.ack().await {
            eprintln!(
                "consumer: ack failed ({e}); the message will come again and be dropped as a duplicate"
            );
        }
    }
    Ok(())
}
