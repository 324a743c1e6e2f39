//! What the fence costs (`outbox_nats::fence`): the relay's throughput in `ordered` mode with
//! `Nats-Expected-Last-Subject-Sequence` on every publish and without it, side by side in the
//! same run.
//!
//! ```sh
//! cargo run --release --example fence_cost                              # 100,000 rows
//! cargo run --release --example fence_cost -- --aggregates 1000,100000 --repeat 5
//! ```
//!
//! Needs PostgreSQL (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/outbox_fence_cost`,
//! created when missing) and NATS with JetStream (`NATS_URL`). For each aggregate count, it
//! writes `--rows` unpublished rows of about 300 bytes over that many aggregates and drains
//! them with an in-process relay (one partition, a file-storage stream of its own, dedup on),
//! fenced and unfenced in turn (the order swapped every round), `--repeat` rounds; the figure
//! is the median. With as many aggregates as rows, every row's subject is new to the relay:
//! the fence looks each one up before its publish (the worst case); with fewer, the acks of
//! earlier publishes tell the relay what to expect.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use async_nats::jetstream;
use clap::Parser;
use diesel::{Connection, PgConnection, RunQueryDsl};
use outbox_nats::{Cleanup, Ordered, Relay, RelayConfig};
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(about = "The relay's throughput with and without the fence, in the same run")]
struct Args {
    /// PostgreSQL URL of a database of the benchmark's own (created when missing).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/outbox_fence_cost"
    )]
    database_url: String,
    /// NATS server URL.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Rows per run.
    #[arg(long, default_value_t = 100_000)]
    rows: usize,
    /// Aggregate counts, one set of runs each.
    #[arg(long, value_delimiter = ',', default_value = "1000,100000")]
    aggregates: Vec<usize>,
    /// Rounds (each a fenced and an unfenced run); the figure is the median.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    database::prepare(&args.database_url, "DATABASE_URL", &[])?;
    let nats = async_nats::connect(&args.nats_url)
        .await
        .with_context(|| format!("cannot connect to NATS at {}", args.nats_url))?;
    let js = jetstream::new(nats.clone());
    println!(
        "| rows | aggregates | unfenced events/s | fenced events/s | fenced / unfenced |\n|---|---|---|---|---|"
    );
    for &aggregates in &args.aggregates {
        let (mut off, mut on, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..args.repeat {
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            let mut pair = [0.0; 2];
            for fence in order {
                let rate = run(&args, &js, &nats, aggregates, fence).await?;
                pair[usize::from(fence)] = rate;
            }
            eprintln!(
                "{aggregates} aggregates, round {}: unfenced {:.0}/s, fenced {:.0}/s",
                round + 1,
                pair[0],
                pair[1]
            );
            off.push(pair[0]);
            on.push(pair[1]);
            ratios.push(pair[1] / pair[0]);
        }
        println!(
            "| {} | {} | {:.0} | {:.0} | **{:.2}** |",
            args.rows,
            aggregates,
            median(&mut off),
            median(&mut on),
            median(&mut ratios)
        );
    }
    Ok(())
}

/// Writes the rows, drains them with one relay, and returns its events per second.
async fn run(
    args: &Args,
    js: &jetstream::Context,
    nats: &async_nats::Client,
    aggregates: usize,
    fence: bool,
) -> Result<f64> {
    fill(&args.database_url, args.rows, aggregates)?;
    let (stream, prefix) = ("FENCE_COST", "fencecost");
    let _ = js.delete_stream(stream).await;
    js.create_stream(jetstream::stream::Config {
        name: stream.into(),
        subjects: vec![format!("{prefix}.>")],
        storage: jetstream::stream::StorageType::File,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .context("cannot create the stream")?;
    let config = RelayConfig::new(args.database_url.clone())
        .stream(stream)
        .subject_prefix(prefix)
        .mode(
            Ordered::default()
                .fence(fence)
                .cleanup(Cleanup::default().enabled(false)),
        );
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let relay = tokio::spawn(Relay::new(config, nats.clone()).run(shutdown.clone()));
    let mut conn = PgConnection::establish(&args.database_url)?;
    loop {
        #[derive(diesel::QueryableByName)]
        struct Left {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            left: bool,
        }
        let l: Left = diesel::sql_query(
            "SELECT EXISTS (SELECT 1 FROM outbox_audit WHERE published_at IS NULL) AS left",
        )
        .get_result(&mut conn)?;
        if !l.left {
            break;
        }
        if relay.is_finished() || started.elapsed() > Duration::from_secs(600) {
            bail!("the relay stopped or took longer than 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rate = args.rows as f64 / started.elapsed().as_secs_f64();
    shutdown.cancel();
    relay.await??;
    let _ = js.delete_stream(stream).await;
    Ok(rate)
}

/// Empties the outbox and writes `n` unpublished rows over `aggregates` aggregates.
fn fill(url: &str, n: usize, aggregates: usize) -> Result<()> {
    let mut conn = PgConnection::establish(url)?;
    diesel::sql_query("TRUNCATE outbox").execute(&mut conn)?;
    diesel::sql_query("SET synchronous_commit = off").execute(&mut conn)?;
    diesel::sql_query(format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'order-' || (i % {aggregates}), 'order.placed', \
         jsonb_build_object('order_id', 'order-' || (i % {aggregates}), 'customer', 'customer-' || i, 'note', repeat('x', 230)) \
         FROM generate_series(0, {}) i",
        n - 1
    ))
    .execute(&mut conn)?;
    diesel::sql_query("VACUUM ANALYZE outbox").execute(&mut conn)?;
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

#[path = "support/database.rs"]
mod database;
