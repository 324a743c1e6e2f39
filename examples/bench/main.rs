//! Benchmarks of the outbox, each figure printed beside a baseline measured in the same run.
//!
//! ```sh
//! cargo run --release --example bench            # the full run (BENCHMARKS.md)
//! cargo run --release --example bench -- --quick # a smaller one, a minute or two
//! ```
//!
//! Build the relay binary first (`cargo build --release --workspace --bins`): sections 1 and 5
//! run it as the separate process it is in production. It needs PostgreSQL (`BENCH_PG`, a
//! server URL without a database name, default
//! `postgres://postgres@127.0.0.1:5432`) and NATS with JetStream (`NATS_URL`, default
//! `nats://127.0.0.1:4222`). It creates a database and streams of its own and removes them at
//! the end. Sections:
//!
//! 1. relay throughput (300-byte JSON payloads, file storage, dedup on) per mode, `outbox-relay`
//!    processes against a bare async-nats program publishing the same messages with the same
//!    headers and window, with the CPU each process spent per event;
//! 2. commit-to-ack latency at a steady rate of committed transactions, with `NOTIFY` wake-up,
//!    poll-only, and log tailing (`--rates`, `--wakes` pick runs; `--latency-trace FILE` writes
//!    each event's latency with its commit's time in the run, to tell stalls from queues);
//! 3. write-path cost: business transactions per second alone, with a hand-written Diesel insert
//!    of the outbox row, and with `record_event` (sync and async), 8 writers;
//! 4. the poll query's time with published rows kept and with an unpublished backlog;
//! 5. the relay's peak memory while draining a backlog (the `outbox-relay` binary), ordered and
//!    log tailing, and log tailing relaying one transaction of the backlog's size.
//!
//! Each section is a module of its own (`throughput`, `latency`, `write_path`, `poll_cost`,
//! `memory`), beside what they share here (the database, the streams, the rows) and in
//! `process` (the CPU and memory each process used, read from `/proc`).
//!
//! Machines are noisy: compare the ratios, not the absolute figures, across runs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use async_nats::jetstream;
use clap::Parser;
use diesel::{Connection, ExpressionMethods, PgConnection, QueryableByName};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use outbox_diesel::{AsyncOutboxExt, Notify, Outbox, OutboxEvent, OutboxExt};
use outbox_nats::{LogTailing, ModeKind, Relay, RelayConfig};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use process::*;

mod latency;
mod memory;
mod poll_cost;
mod process;
mod throughput;
mod write_path;

#[derive(Parser, Debug)]
#[command(about = "Benchmarks of the outbox against same-run baselines")]
struct Args {
    /// PostgreSQL server URL, without a database.
    #[arg(
        long,
        env = "BENCH_PG",
        default_value = "postgres://postgres@127.0.0.1:5432"
    )]
    pg: String,
    /// NATS server URL.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Events per throughput run.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Published rows kept for the poll-cost section: each figure of the list in turn.
    #[arg(long, value_delimiter = ',', default_value = "1000000,10000000")]
    kept: Vec<usize>,
    /// Backlog drained for the memory section.
    #[arg(long, default_value_t = 1_000_000)]
    memory_backlog: usize,
    /// Rows of one aggregate held back behind its parked row, for the poll-cost section.
    #[arg(long, default_value_t = 1_000_000)]
    held_back: usize,
    /// Rows of 900 KB payloads (under NATS's default 1 MiB `max_payload`) drained for the
    /// memory section.
    #[arg(long, default_value_t = 500)]
    large_rows: usize,
    /// Rows in section 2's table before each run of a polling relay, read by its cursor
    /// (a progress row past them) and analyzed: the table a relay caught up finds in
    /// production. 0: an empty table, as section 2 ran before BENCHMARKS.md section 14.
    #[arg(long, default_value_t = 100_000)]
    latency_kept: usize,
    /// Seconds per write-path measurement.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// A smaller run: 20k events once each, 200k kept rows, 100k backlog, 3 s per write-path
    /// figure.
    #[arg(long)]
    quick: bool,
    /// Runs of each throughput figure (each after its own baseline); the median is printed.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// The relays' `--batch-size` in sections 1 and 2.
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// Only the section 1 runs whose name contains one of these, comma-separated (e.g.
    /// `log-tailing` or `1 partition`).
    #[arg(long, value_delimiter = ',')]
    runs: Vec<String>,
    /// Only the section 1 run of exactly this name (repeatable; names contain commas, so
    /// `--runs` cannot pick one of those whose names contain another's), e.g.
    /// `--run "ordered, 1 partition, 1 relay"`.
    #[arg(long)]
    run: Vec<String>,
    /// Sections 2 to 4 on the outbox turned into a ring of four partitions
    /// (`outbox_diesel::partition_table`, blocks of 1,000,000 rows), and every run of section 1.
    #[arg(long)]
    rotated: bool,
    /// Section 2's rates (committed transactions a second), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1000,5000")]
    rates: Vec<u32>,
    /// Only section 2's runs of these wake-ups, comma-separated: `notify`, `notify-no-linger`,
    /// `poll`, `tailing`.
    #[arg(long, value_delimiter = ',', value_enum)]
    wakes: Vec<latency::Wake>,
    /// A file that section 2 writes each event's latency to, one line each: the run, the
    /// seconds from the run's start to the commit, and the milliseconds to the message (to
    /// see whether a p99 comes from stalls at intervals or from a queue).
    #[arg(long)]
    latency_trace: Option<std::path::PathBuf>,
    /// Only these sections (1-6), comma-separated.
    #[arg(long, value_delimiter = ',')]
    only: Vec<u8>,
}

#[derive(Serialize, OutboxEvent, Clone)]
#[outbox(aggregate_type = "order", event_type = "order.placed")]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    order_id: String,
    customer: String,
    note: String,
}

/// The middle value (the mean of the middle two for an even count).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.is_empty() {
        0.0
    } else if v.len().is_multiple_of(2) {
        (v[m - 1] + v[m]) / 2.0
    } else {
        v[m]
    }
}

/// About 300 bytes of JSON.
fn event(i: usize) -> OrderPlaced {
    OrderPlaced {
        order_id: format!("order-{}", i % 1000),
        customer: format!("customer-{i:08}"),
        note: "x".repeat(230),
    }
}

/// The baselines' `i`th message: its subject and the six headers a relay sends.
fn raw_message(prefix: &str, i: usize) -> (String, async_nats::HeaderMap) {
    let mut h = async_nats::HeaderMap::new();
    h.insert("Nats-Msg-Id", uuid::Uuid::now_v7().to_string().as_str());
    h.insert("Outbox-Aggregate-Type", "order");
    h.insert(
        "Outbox-Aggregate-Id",
        format!("order-{}", i % 1000).as_str(),
    );
    h.insert("Outbox-Event-Type", "order.placed");
    h.insert(
        "Outbox-Created-At",
        chrono::Utc::now().to_rfc3339().as_str(),
    );
    h.insert("Content-Type", "application/json");
    (format!("{prefix}.order.order-{}", i % 1000), h)
}

/// A run of section 1.
struct Run {
    name: &'static str,
    mode: ModeKind,
    partitions: u32,
    workers: u32,
    relays: usize,
    delete: bool,
    /// on the table made anew as a ring of partitions (`partition_table`) of blocks of
    /// this many rows
    ring: Option<i64>,
    /// cleanup on, `--retention 0s`, and the run's CPU counted until the table is empty
    cleanup: bool,
    /// with the partition index of `partitions` (`outbox-relay index`)
    indexed: bool,
    /// nine events in ten on 100 aggregates of partition 0 of 8 (one busy partition), the
    /// tenth spread over 1,000 aggregates
    skewed: bool,
}

struct Bench {
    args: Args,
    db_name: String,
    db_url: String,
    nats: async_nats::Client,
    js: jetstream::Context,
    streams: Vec<String>,
}

#[tokio::main]
async fn main() -> Result<()> {
    use diesel::RunQueryDsl;
    let mut args = Args::parse();
    if args.quick {
        args.events = 20_000;
        args.kept = vec![200_000];
        args.repeat = 1;
        args.memory_backlog = 100_000;
        args.held_back = 100_000;
        args.large_rows = 200;
        args.seconds = 3;
    }
    let db_name = format!("outbox_bench_{}", std::process::id());
    let mut admin = PgConnection::establish(&format!("{}/postgres", args.pg))
        .with_context(|| format!("cannot reach PostgreSQL at {}; set BENCH_PG", args.pg))?;
    diesel::sql_query(format!("CREATE DATABASE {db_name}")).execute(&mut admin)?;
    let db_url = format!("{}/{db_name}", args.pg);
    let nats = async_nats::connect(&args.nats_url)
        .await
        .with_context(|| format!("cannot reach NATS at {}; set NATS_URL", args.nats_url))?;
    let js = jetstream::new(nats.clone());
    let mut bench = Bench {
        args,
        db_name,
        db_url,
        nats,
        js,
        streams: Vec::new(),
    };
    let result = bench.run().await;
    bench.cleanup(&mut admin).await;
    result
}

impl Bench {
    fn wants(&self, section: u8) -> bool {
        self.args.only.is_empty() || self.args.only.contains(&section)
    }

    async fn run(&mut self) -> Result<()> {
        let mut conn = PgConnection::establish(&self.db_url)?;
        outbox_diesel::run_migrations(&mut conn).map_err(|e| anyhow::anyhow!("{e}"))?;
        self.rotate_outbox(self.args.rotated.then_some(1_000_000))?;
        println!("# outbox benchmarks");
        println!(
            "machine: {} cores; {}",
            num_cpus(),
            server_versions(&mut conn, &self.nats)
        );
        if self.args.rotated {
            println!("the outbox: a ring of 4 partitions of 1,000,000-row blocks (`--rotated`)");
        }
        if self.wants(1) {
            self.throughput().await?;
        }
        if self.wants(2) {
            self.latency().await?;
        }
        if self.wants(3) {
            self.write_path().await?;
        }
        if self.wants(4) {
            self.poll_cost().await?;
        }
        if self.wants(5) {
            self.memory().await?;
        }
        if self.wants(6) {
            self.cleanup_cost().await?;
        }
        Ok(())
    }

    async fn cleanup(&mut self, admin: &mut PgConnection) {
        use diesel::RunQueryDsl;
        for s in &self.streams {
            let _ = self.js.delete_stream(s).await;
        }
        // a run stopped half-way may have left its slot, which would keep the database
        let _ = diesel::sql_query(format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = '{}_slot'",
            self.db_name
        ))
        .execute(admin);
        let _ = diesel::sql_query(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.db_name
        ))
        .execute(admin);
    }

    async fn stream(&mut self, name: &str, prefix: &str) -> Result<()> {
        let _ = self.js.delete_stream(name).await;
        self.js
            .create_stream(jetstream::stream::Config {
                name: name.into(),
                subjects: vec![format!("{prefix}.>")],
                storage: jetstream::stream::StorageType::File,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await?;
        self.streams.push(name.into());
        Ok(())
    }

    fn reset_outbox(&self) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        diesel::sql_query("TRUNCATE outbox, outbox_progress").execute(&mut conn)?;
        Ok(())
    }

    /// Fills the outbox with `n` rows of ~300 bytes, as SQL, unpublished or published an hour
    /// ago, in large transactions.
    fn fill(&self, n: usize, published: bool) -> Result<()> {
        self.fill_rows(n, 200_000, published)
    }

    /// [`Bench::fill`] with nine rows in ten on 100 aggregates whose partition of 8 is 0, the
    /// tenth spread over 1,000 as `fill` spreads them: the traffic of one busy partition among
    /// quiet ones. (One busy aggregate would measure something else: a relay sends a row only
    /// once the previous row of its aggregate is acked, so one aggregate goes at one message
    /// per round trip to the server.)
    fn fill_skewed(&self, n: usize) -> Result<()> {
        self.fill_aggregates(
            n,
            200_000,
            false,
            "CASE WHEN i % 10 = 0 THEN 'order-' || (i % 1000) \
             ELSE (ARRAY(SELECT 'busy-' || g FROM generate_series(0, 10000) AS g \
             WHERE ('x' || substr(md5('busy-' || g), 1, 7))::bit(28)::integer % 8 = 0 \
             ORDER BY g LIMIT 100))[1 + i % 100] END",
        )
    }

    /// Fills the outbox with `n` rows in transactions of `per_tx` rows each: as a service's
    /// commits would for log tailing, which reads a transaction whole.
    fn fill_rows(&self, n: usize, per_tx: usize, published: bool) -> Result<()> {
        self.fill_aggregates(n, per_tx, published, "'order-' || (i % 1000)")
    }

    /// [`Bench::fill_rows`] with the aggregate id of row `i` given as SQL.
    fn fill_aggregates(
        &self,
        n: usize,
        per_tx: usize,
        published: bool,
        aggregate: &str,
    ) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        // the fill is not measured: no WAL flush per transaction
        diesel::sql_query("SET synchronous_commit = off").execute(&mut conn)?;
        let mut done = 0;
        while done < n {
            let m = per_tx.min(n - done);
            diesel::sql_query(format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, published_at) \
                 SELECT gen_random_uuid(), 'order', {aggregate}, 'order.placed', \
                 jsonb_build_object('order_id', {aggregate}, 'customer', 'customer-' || i, 'note', repeat('x', 230)), \
                 {} FROM generate_series({}, {}) i",
                if published { "now() - interval '1 hour'" } else { "NULL" },
                done,
                done + m - 1
            ))
            .execute(&mut conn)?;
            done += m;
        }
        diesel::sql_query("ANALYZE outbox").execute(&mut conn)?;
        Ok(())
    }

    /// Whether a drain of `n` events into `stream` is unfinished: the stream holds fewer than
    /// `n` messages (deduplicated by id, so each event counts once). Asked of the stream, not of
    /// the table: a query of the table every 10 ms would add its own cost to the database's
    /// figure, which is what the runs compare.
    async fn left(&self, stream: &str, n: usize) -> Result<bool> {
        Ok(self.stored(stream).await? < n as u64)
    }

    /// The messages in `stream`.
    async fn stored(&self, stream: &str) -> Result<u64> {
        let mut stream = self.js.get_stream(stream).await?;
        Ok(stream.info().await?.state.messages)
    }

    fn wal_level(&self) -> Result<String> {
        use diesel::RunQueryDsl;
        #[derive(QueryableByName)]
        struct W {
            #[diesel(sql_type = diesel::sql_types::Text)]
            w: String,
        }
        let mut conn = PgConnection::establish(&self.db_url)?;
        Ok(
            diesel::sql_query("SELECT current_setting('wal_level') AS w")
                .get_result::<W>(&mut conn)?
                .w,
        )
    }

    /// The publication log tailing reads (`outbox_pub`) and a new slot, as the relay would make
    /// them, before the backlog is written.
    fn create_slot(&self, slot: &str) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        diesel::sql_query(
            "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'outbox_pub') \
             THEN CREATE PUBLICATION outbox_pub FOR TABLE outbox WITH (publish = 'insert, update'); \
             END IF; END $$",
        )
        .execute(&mut conn)?;
        diesel::sql_query(format!(
            "SELECT 1 FROM pg_create_logical_replication_slot('{slot}', 'pgoutput')"
        ))
        .execute(&mut conn)?;
        Ok(())
    }

    /// Drops the slot (a database with a slot cannot be dropped), once the stopped relay's
    /// backend has let go of it.
    fn drop_slot(&self, slot: &str) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        let mut tries = 0;
        loop {
            let dropped = diesel::sql_query(format!(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                 WHERE slot_name = '{slot}'"
            ))
            .execute(&mut conn);
            match dropped {
                Ok(_) => return Ok(()),
                Err(e) if tries >= 50 => return Err(e.into()),
                Err(_) => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// An `outbox-relay run` process on `stream` and `prefix` with `args` added, logging
    /// errors only (the backlogs are old on purpose: no stall warnings in the figures).
    fn spawn_relay(&self, stream: &str, prefix: &str, args: &[String]) -> Result<RelayProcess> {
        let child = std::process::Command::new(relay_bin()?)
            .args(["run", "--stream", stream, "--subject-prefix", prefix])
            .args(args)
            .env("DATABASE_URL", &self.db_url)
            .env("NATS_URL", &self.args.nats_url)
            .env("RUST_LOG", "error")
            .spawn()?;
        Ok(RelayProcess(child))
    }
}
