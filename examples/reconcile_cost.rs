//! What reconciling costs: looking rows in doubt up in the stream before re-publishing them
//! (`outbox_nats::reconcile`), against publishing the same messages, in the same run.
//!
//! ```sh
//! cargo run --release --example reconcile_cost                          # 10,000 rows
//! cargo run --release --example reconcile_cost -- --aggregates 10,100,1000,10000
//! ```
//!
//! Needs NATS with JetStream only (`NATS_URL`, default `nats://127.0.0.1:4222`); it makes a
//! stream of its own and deletes it at the end. For each aggregate count it publishes
//! `--rows` messages over that many aggregates (pipelined, as the relay publishes: the
//! baseline), behind `--filler` messages of other subjects, then reconciles the same rows in
//! batches of `--batch` as a relay that restarted after an outage does: every row is older
//! than the duplicate window, every row is found. Then as many rows of the same aggregates
//! that were never published (a backlog that waited out an outage): every row is looked up,
//! none is found. The figures are the time per row of the look-ups against the time per row
//! of the publishing.

use std::future::IntoFuture;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use async_nats::jetstream;
use clap::Parser;
use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use outbox_diesel::relay::OutboxRow;
use outbox_nats::publish::to_message;
use outbox_nats::reconcile::Reconciler;
use outbox_nats::subject::SubjectTemplate;

#[derive(Parser, Debug)]
#[command(about = "The cost of reconciling rows in doubt against publishing them")]
struct Args {
    /// NATS server URL.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Rows in doubt per run.
    #[arg(long, default_value_t = 10_000)]
    rows: usize,
    /// Aggregate counts, one run each.
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000,10000")]
    aggregates: Vec<usize>,
    /// Messages of other subjects stored before each run's rows.
    #[arg(long, default_value_t = 50_000)]
    filler: usize,
    /// Rows per reconcile pass (the relay's batch).
    #[arg(long, default_value_t = 500)]
    batch: usize,
}

fn row(seq: usize, aggregate: usize, created_at: chrono::DateTime<chrono::Utc>) -> OutboxRow {
    OutboxRow {
        seq: seq as i64,
        id: uuid::Uuid::now_v7(),
        aggregate_type: "order".into(),
        aggregate_id: format!("o{aggregate}"),
        event_type: "order.placed".into(),
        payload: serde_json::json!({"n": seq, "pad": "x".repeat(250)}).into(),
        headers: serde_json::json!({}),
        created_at,
        attempts: 0,
    }
}

/// Publishes `rows` pipelined (up to 512 acks in flight) and waits for every ack.
async fn publish(js: &jetstream::Context, prefix: &str, rows: &[OutboxRow]) -> Result<Duration> {
    let started = Instant::now();
    let mut acks = FuturesOrdered::new();
    for r in rows {
        let m = to_message(r, &SubjectTemplate::default(), prefix)?;
        let msg = jetstream::message::PublishMessage::build()
            .payload(m.payload)
            .headers(m.headers);
        acks.push_back(js.send_publish(m.subject, msg).await?.into_future());
        if acks.len() >= 512
            && let Some(ack) = acks.next().await
        {
            ack?;
        }
    }
    while let Some(ack) = acks.next().await {
        ack?;
    }
    Ok(started.elapsed())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let client = async_nats::connect(&args.nats_url)
        .await
        .context("connect to NATS")?;
    let version = client.server_info().version;
    let js = jetstream::new(client);
    println!(
        "nats-server {version}; {} rows in doubt per run, passes of {}, {} filler messages",
        args.rows, args.batch, args.filler
    );
    println!(
        "| aggregates | publish µs/row | reconcile, in the stream, µs/row | ratio | found | reconcile, not in the stream, µs/row | found |"
    );
    println!("|---|---|---|---|---|---|---|");
    for &aggregates in &args.aggregates {
        let id = uuid::Uuid::now_v7().simple().to_string();
        let (name, prefix) = (format!("RECONCILE_{id}"), format!("r{id}"));
        let window = Duration::from_secs(1);
        js.create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: window,
            ..Default::default()
        })
        .await
        .context("create the stream")?;
        let run = async {
            let recorded = chrono::Utc::now();
            let filler: Vec<OutboxRow> = (0..args.filler)
                .map(|i| {
                    let mut r = row(i, i, recorded);
                    r.aggregate_type = "filler".into();
                    r
                })
                .collect();
            publish(&js, &prefix, &filler).await?;
            let rows: Vec<OutboxRow> = (0..args.rows)
                .map(|i| row(i, i % aggregates.max(1), chrono::Utc::now()))
                .collect();
            let published = publish(&js, &prefix, &rows).await?;
            // the rows are older than the duplicate window less the margin when a relay
            // restarted after an outage reads them again
            tokio::time::sleep(window).await;
            let reconciler = Reconciler::new(
                js.clone(),
                &name,
                SubjectTemplate::default(),
                &prefix,
                window,
            );
            let reconcile = |rows: Vec<OutboxRow>| {
                let mut lookups = reconciler.lookups();
                async move {
                    let started = Instant::now();
                    let mut found = 0;
                    for pass in rows.chunks(args.batch.max(1)) {
                        found += lookups.stored(pass).await?.len();
                    }
                    anyhow::Ok((started.elapsed(), found))
                }
            };
            let absent: Vec<OutboxRow> = rows
                .iter()
                .map(|r| OutboxRow {
                    id: uuid::Uuid::now_v7(),
                    ..r.clone()
                })
                .collect();
            let (reconciled, found) = reconcile(rows).await?;
            let (looked_up, not_found) = reconcile(absent).await?;
            let per_row = |d: Duration| d.as_secs_f64() * 1e6 / args.rows.max(1) as f64;
            println!(
                "| {aggregates} | {:.1} | {:.1} | {:.2} | {found} | {:.1} | {not_found} |",
                per_row(published),
                per_row(reconciled),
                reconciled.as_secs_f64() / published.as_secs_f64().max(1e-9),
                per_row(looked_up),
            );
            anyhow::Ok(())
        };
        let result = run.await;
        let _ = js.delete_stream(&name).await;
        result?;
    }
    Ok(())
}
