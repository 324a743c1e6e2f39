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
//!    poll-only, and log tailing;
//! 3. write-path cost: business transactions per second alone, with a hand-written Diesel insert
//!    of the outbox row, and with `record_event` (sync and async), 8 writers;
//! 4. the poll query's time with published rows kept and with an unpublished backlog;
//! 5. the relay's peak memory while draining a backlog (the `outbox-relay` binary), ordered and
//!    log tailing, and log tailing relaying one transaction of the backlog's size.
//!
//! Machines are noisy: compare the ratios, not the absolute figures, across runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
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

    /// Fills the outbox with `n` rows in transactions of `per_tx` rows each: as a service's
    /// commits would for log tailing, which reads a transaction whole.
    fn fill_rows(&self, n: usize, per_tx: usize, published: bool) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        // the fill is not measured: no WAL flush per transaction
        diesel::sql_query("SET synchronous_commit = off").execute(&mut conn)?;
        let mut done = 0;
        while done < n {
            let m = per_tx.min(n - done);
            diesel::sql_query(format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, published_at) \
                 SELECT gen_random_uuid(), 'order', 'order-' || (i % 1000), 'order.placed', \
                 jsonb_build_object('order_id', 'order-' || (i % 1000), 'customer', 'customer-' || i, 'note', repeat('x', 230)), \
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
        let mut stream = self.js.get_stream(stream).await?;
        Ok(stream.info().await?.state.messages < n as u64)
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

    /// Section 1.
    async fn throughput(&mut self) -> Result<()> {
        let n = self.args.events;
        let repeat = self.args.repeat.max(1);
        println!("\n## 1. relay throughput ({n} events of ~300 B, file storage, dedup on)\n");
        println!(
            "Each run follows its own baselines, the same messages with 512 acks in flight: a bare \
             async-nats publisher (JetStream's publish API, a future per ack), and a lean one (core \
             NATS publishes with a numbered reply subject under one inbox subscription, as the relay \
             publishes); median of {repeat}. The last column is the baseline's CPU per event \
             outside PostgreSQL (nats-server + publisher) over the relay's (nats-server + relay): \
             the ratio to expect where the database has cores of its own.\n"
        );
        println!(
            "| run | events/s | baseline events/s | ratio to baseline | lean baseline events/s | ratio to lean baseline | CPU µs per event: PostgreSQL / nats-server / relay | baseline: nats-server / publisher | lean baseline: nats-server / publisher | CPU ratio outside PostgreSQL |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|");
        let run = |name, mode, partitions, workers, relays, delete| Run {
            name,
            mode,
            partitions,
            workers,
            relays,
            delete,
            ring: None,
            cleanup: false,
            indexed: false,
        };
        let runs = [
            run(
                "ordered, 1 partition, 1 relay",
                ModeKind::Ordered,
                1,
                1,
                1,
                false,
            ),
            Run {
                ring: Some(1_000_000),
                ..run(
                    "ordered, 1 partition, 1 relay, rotated table (4 partitions)",
                    ModeKind::Ordered,
                    1,
                    1,
                    1,
                    false,
                )
            },
            Run {
                cleanup: true,
                ..run(
                    "ordered, 1 partition, 1 relay, cleanup to the end (--retention 0s)",
                    ModeKind::Ordered,
                    1,
                    1,
                    1,
                    false,
                )
            },
            Run {
                cleanup: true,
                // the backlog in 3.5 blocks: three partitions go by TRUNCATE
                ring: Some((n as i64 * 2 / 7).max(1000)),
                ..run(
                    "ordered, 1 partition, 1 relay, cleanup to the end (--retention 0s), rotated table (4 partitions, blocks of 2/7 of the backlog)",
                    ModeKind::Ordered,
                    1,
                    1,
                    1,
                    false,
                )
            },
            run(
                "ordered, 1 partition, 1 relay, --delete-published",
                ModeKind::Ordered,
                1,
                1,
                1,
                true,
            ),
            run(
                "ordered, 4 partitions, 1 relay",
                ModeKind::Ordered,
                4,
                1,
                1,
                false,
            ),
            run(
                "ordered, 4 partitions, 2 relays",
                ModeKind::Ordered,
                4,
                1,
                2,
                false,
            ),
            Run {
                indexed: true,
                ..run(
                    "ordered, 4 partitions, 2 relays, partition index",
                    ModeKind::Ordered,
                    4,
                    1,
                    2,
                    false,
                )
            },
            run(
                "ordered, 4 partitions, 2 relays, --delete-published",
                ModeKind::Ordered,
                4,
                1,
                2,
                true,
            ),
            Run {
                indexed: true,
                ..run(
                    "ordered, 4 partitions, 2 relays, --delete-published, partition index",
                    ModeKind::Ordered,
                    4,
                    1,
                    2,
                    true,
                )
            },
            run(
                "ordered, 8 partitions, 4 relays",
                ModeKind::Ordered,
                8,
                1,
                4,
                false,
            ),
            Run {
                indexed: true,
                ..run(
                    "ordered, 8 partitions, 4 relays, partition index",
                    ModeKind::Ordered,
                    8,
                    1,
                    4,
                    false,
                )
            },
            run(
                "unordered, 4 workers, 1 relay",
                ModeKind::Unordered,
                1,
                4,
                1,
                false,
            ),
            run(
                "log-tailing, 1 relay (transactions of 100 events)",
                ModeKind::LogTailing,
                1,
                1,
                1,
                false,
            ),
        ];
        if let Some(unknown) = self
            .args
            .run
            .iter()
            .find(|f| !runs.iter().any(|r| r.name == f.as_str()))
        {
            let names: Vec<&str> = runs.iter().map(|r| r.name).collect();
            anyhow::bail!("--run {unknown:?} names no run; the runs are: {names:#?}");
        }
        let logical = self.wal_level()? == "logical";
        for r in runs {
            let picked = (self.args.runs.is_empty() && self.args.run.is_empty())
                || self.args.runs.iter().any(|f| r.name.contains(f.as_str()))
                || self.args.run.iter().any(|f| r.name == f.as_str());
            if !picked {
                continue;
            }
            if r.mode == ModeKind::LogTailing && !logical {
                println!(
                    "| {} | skipped: `wal_level` is not `logical` (`ALTER SYSTEM SET wal_level = logical` and restart PostgreSQL) | | | | | | | | |",
                    r.name
                );
                continue;
            }
            let ring = r.ring.or(self.args.rotated.then_some(1_000_000));
            let mut rates = Vec::new();
            let mut baselines = Vec::new();
            let mut ratios = Vec::new();
            let mut cpu = Vec::new();
            let mut base_cpu = Vec::new();
            let (mut leans, mut lean_ratios, mut lean_cpu) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..repeat {
                // a ring made anew each time, so that the backlog starts at its first block
                self.rotate_outbox(ring)?;
                self.partition_index(r.indexed.then_some(r.partitions))?;
                let (baseline, b) = self.raw_publish(n).await?;
                let (lean, l) = self.raw_publish_lean(n).await?;
                let (rate, c) = self.relay_run(n, &r).await?;
                leans.push(lean);
                lean_ratios.push(rate / lean);
                lean_cpu.push(l);
                rates.push(rate);
                baselines.push(baseline);
                ratios.push(rate / baseline);
                cpu.push(c);
                base_cpu.push(b);
            }
            let (c, b) = (CpuUse::median(&cpu), CpuUse::median(&base_cpu));
            let l = CpuUse::median(&lean_cpu);
            println!(
                "| {} | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {:.2} |",
                r.name,
                median(&mut rates),
                median(&mut baselines),
                median(&mut ratios),
                median(&mut leans),
                median(&mut lean_ratios),
                c.postgres,
                c.nats,
                c.own,
                b.nats,
                b.own,
                l.nats,
                l.own,
                (b.nats + b.own) / (c.nats + c.own).max(f64::EPSILON)
            );
        }
        self.rotate_outbox(self.args.rotated.then_some(1_000_000))?;
        self.partition_index(None)?;
        Ok(())
    }

    /// Drops the outbox's partition indexes, and makes that of `partitions` partitions, if any
    /// (`outbox_diesel::create_partition_index`, as `outbox-relay index` does).
    fn partition_index(&self, partitions: Option<u32>) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        diesel::sql_query(
            "DO $$ DECLARE i text; BEGIN FOR i IN SELECT indexrelid::regclass::text \
             FROM pg_index WHERE indrelid = 'outbox'::regclass \
             AND indexrelid::regclass::text LIKE 'outbox\\_ready\\_p%' \
             LOOP EXECUTE 'DROP INDEX ' || i; END LOOP; END $$",
        )
        .execute(&mut conn)?;
        if let Some(n) = partitions {
            outbox_diesel::create_partition_index(
                &mut conn,
                &outbox_diesel::OutboxTable::DEFAULT,
                n,
            )?;
        }
        Ok(())
    }

    /// Makes `outbox` anew as a ring of four partitions of `ring` rows a block
    /// (`outbox_diesel::partition_table`), or, with `None`, a plain table again (made anew,
    /// empty, when it was a ring).
    fn rotate_outbox(&self, ring: Option<i64>) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        let table = outbox_diesel::OutboxTable::DEFAULT;
        #[derive(QueryableByName)]
        struct Partitioned {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            p: bool,
        }
        let found: Partitioned = diesel::sql_query(
            "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table \
             WHERE partrelid = to_regclass('outbox')) AS p",
        )
        .get_result(&mut conn)?;
        if found.p || ring.is_some() {
            diesel::sql_query("DROP TABLE outbox, outbox_progress CASCADE").execute(&mut conn)?;
            outbox_diesel::create_table(&mut conn, &table)?;
            // the dropped table left log tailing's publication
            diesel::sql_query("DROP PUBLICATION IF EXISTS outbox_pub").execute(&mut conn)?;
        }
        if let Some(block) = ring {
            outbox_diesel::partition_table(
                &mut conn,
                &table,
                outbox_diesel::Rotation::default().block_rows(block),
            )?;
        }
        Ok(())
    }

    async fn raw_publish(&mut self, n: usize) -> Result<(f64, CpuUse)> {
        let (name, prefix) = ("BENCH_RAW", "benchraw");
        self.stream(name, prefix).await?;
        let payload = bytes::Bytes::from(serde_json::to_vec(&event(0))?);
        let cpu_before = cpu_snapshot();
        let start = Instant::now();
        let mut in_flight = FuturesUnordered::new();
        for i in 0..n {
            if in_flight.len() >= 512
                && let Some(r) = in_flight.next().await
            {
                r?;
            }
            let (subject, h) = raw_message(prefix, i);
            let ack = self
                .js
                .publish_with_headers(subject, h, payload.clone())
                .await?;
            in_flight.push(ack.into_future());
        }
        while let Some(r) = in_flight.next().await {
            r?;
        }
        let rate = n as f64 / start.elapsed().as_secs_f64();
        Ok((
            rate,
            CpuUse::between(&cpu_before, &cpu_snapshot(), n, &[std::process::id()]),
        ))
    }

    /// The same messages as [`Bench::raw_publish`], published with core NATS and a reply
    /// subject under one wildcard inbox subscription, each ack matched by its reply subject:
    /// no future, channel or timer per message.
    async fn raw_publish_lean(&mut self, n: usize) -> Result<(f64, CpuUse)> {
        #[derive(serde::Deserialize)]
        struct Ack {
            seq: Option<u64>,
        }
        let (name, prefix) = ("BENCH_RAW", "benchraw");
        self.stream(name, prefix).await?;
        let payload = bytes::Bytes::from(serde_json::to_vec(&event(0))?);
        let inbox = self.nats.new_inbox();
        let mut acks = self.nats.subscribe(format!("{inbox}.*")).await?;
        let cpu_before = cpu_snapshot();
        let start = Instant::now();
        let mut in_flight = 0usize;
        let take_ack = async |acks: &mut async_nats::Subscriber| -> Result<()> {
            let m = acks.next().await.context("the ack subscription ended")?;
            let ack: Ack = serde_json::from_slice(&m.payload)?;
            ack.seq.context("a publish was refused")?;
            Ok(())
        };
        for i in 0..n {
            if in_flight >= 512 {
                take_ack(&mut acks).await?;
                in_flight -= 1;
            }
            let (subject, h) = raw_message(prefix, i);
            self.nats
                .publish_with_reply_and_headers(subject, format!("{inbox}.{i}"), h, payload.clone())
                .await?;
            in_flight += 1;
        }
        while in_flight > 0 {
            take_ack(&mut acks).await?;
            in_flight -= 1;
        }
        let rate = n as f64 / start.elapsed().as_secs_f64();
        Ok((
            rate,
            CpuUse::between(&cpu_before, &cpu_snapshot(), n, &[std::process::id()]),
        ))
    }

    async fn relay_run(&mut self, n: usize, run: &Run) -> Result<(f64, CpuUse)> {
        let (mode, partitions, workers, relays) =
            (run.mode, run.partitions, run.workers, run.relays);
        let (delete_published, cleanup) = (run.delete, run.cleanup);
        self.reset_outbox()?;
        let tailing = mode == ModeKind::LogTailing;
        let slot = format!("{}_slot", self.db_name);
        if tailing {
            // the slot sees only what commits after its creation: make it before the backlog
            self.create_slot(&slot)?;
            self.fill_rows(n, 100, false)?;
        } else {
            self.fill(n, false)?;
        }
        let name = format!(
            "BENCH_{}_{partitions}_{workers}_{relays}_{}",
            mode.to_string().to_uppercase(),
            u8::from(delete_published)
        );
        let prefix = name.to_lowercase().replace('_', "");
        self.stream(&name, &prefix).await?;
        let mut args = vec![
            "--mode".to_owned(),
            mode.to_string(),
            "--partitions".to_owned(),
            partitions.to_string(),
            "--workers".to_owned(),
            workers.to_string(),
            "--batch-size".to_owned(),
            self.args.batch_size.to_string(),
        ];
        if delete_published {
            args.push("--delete-published".to_owned());
        }
        if cleanup {
            args.extend(["--retention", "0s", "--cleanup-interval", "1s"].map(String::from));
        }
        if tailing {
            args.extend(["--slot".to_owned(), slot.clone()]);
        }
        let cpu_before = cpu_snapshot();
        let start = Instant::now();
        let children = (0..relays)
            .map(|_| self.spawn_relay(&name, &prefix, &args))
            .collect::<Result<Vec<_>>>()?;
        loop {
            if !self.left(&name, n).await? {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            if start.elapsed() > Duration::from_secs(600) {
                bail!("the relay did not drain {n} events in 10 minutes");
            }
        }
        let rate = n as f64 / start.elapsed().as_secs_f64();
        if cleanup {
            // the cleanup of what was published counts in the run's CPU
            let drained = Instant::now();
            while self.rows_left()? > 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                if drained.elapsed() > Duration::from_secs(120) {
                    bail!("cleanup did not empty the outbox in 2 minutes");
                }
            }
        }
        // before the relays exit and take their figures (and their backends') with them
        let pids: Vec<u32> = children.iter().map(RelayProcess::id).collect();
        let cpu = CpuUse::between(&cpu_before, &cpu_snapshot(), n, &pids);
        drop(children);
        if tailing {
            self.drop_slot(&slot)?;
        }
        Ok((rate, cpu))
    }

    /// Rows in the outbox.
    fn rows_left(&self) -> Result<i64> {
        use diesel::RunQueryDsl;
        #[derive(QueryableByName)]
        struct Left {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let mut conn = PgConnection::establish(&self.db_url)?;
        Ok(diesel::sql_query("SELECT count(*) AS n FROM outbox")
            .get_result::<Left>(&mut conn)?
            .n)
    }

    /// Section 2.
    async fn latency(&mut self) -> Result<()> {
        println!(
            "\n## 2. commit-to-ack latency (steady rate of committed transactions, one event each)\n"
        );
        println!(
            "PostgreSQL's CPU per event counts the writers' inserts and commits too: the same in every row of a rate, so the difference between rows is the relay's reads.\n"
        );
        println!("| rate | wake-up | p50 ms | p99 ms | max ms | PostgreSQL CPU µs per event |");
        println!("|---|---|---|---|---|---|");
        let logical = self.wal_level()? == "logical";
        for rate in [1000u32, 5000] {
            for wake in [
                Wake::Notify,
                Wake::NotifyNoLinger,
                Wake::Poll,
                Wake::Tailing,
            ] {
                let how = match wake {
                    Wake::Notify => "LISTEN/NOTIFY (debounced 10 ms) + 100 ms poll, 10 ms linger",
                    Wake::NotifyNoLinger => {
                        "LISTEN/NOTIFY (debounced 10 ms) + 100 ms poll, --linger 0"
                    }
                    Wake::Poll => "poll only, 100 ms, 10 ms linger",
                    Wake::Tailing => "log tailing (the replication stream pushes each commit)",
                };
                if wake == Wake::Tailing && !logical {
                    println!("| {rate}/s | {how} | skipped: `wal_level` is not `logical` | | | |");
                    continue;
                }
                let (p50, p99, max, pg) = self.latency_run(rate, wake).await?;
                println!("| {rate}/s | {how} | {p50:.1} | {p99:.1} | {max:.1} | {pg:.1} |");
            }
        }
        Ok(())
    }

    async fn latency_run(&mut self, rate: u32, wake: Wake) -> Result<(f64, f64, f64, f64)> {
        self.reset_outbox()?;
        let listen = matches!(wake, Wake::Notify | Wake::NotifyNoLinger);
        let tag = format!("{wake:?}").to_lowercase();
        let name = format!("BENCH_LAT_{rate}_{tag}");
        let prefix = format!("benchlat{rate}{tag}");
        self.stream(&name, &prefix).await?;
        let slot = format!("{}_slot", self.db_name);
        if wake == Wake::Tailing {
            self.create_slot(&slot)?;
        }
        let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let mut sub = self.nats.subscribe(format!("{prefix}.>")).await?;
        let shutdown = CancellationToken::new();
        let nats = async_nats::connect(&self.args.nats_url).await?;
        let config = RelayConfig::new(self.db_url.clone())
            .stream(name.clone())
            .subject_prefix(prefix.clone())
            .listen(listen)
            .batch_size(self.args.batch_size);
        let config = if wake == Wake::NotifyNoLinger {
            config.linger(Duration::ZERO)
        } else {
            config
        };
        let config = if wake == Wake::Tailing {
            config.mode(LogTailing::default().slot(slot.clone()))
        } else {
            config
        };
        if self.args.latency_kept > 0 && wake != Wake::Tailing {
            use diesel::RunQueryDsl;
            self.fill(self.args.latency_kept, false)?;
            let mut conn = PgConnection::establish(&self.db_url)?;
            diesel::sql_query(
                "INSERT INTO outbox_progress (partitions, partition, upto_seq, snap) \
                 SELECT 1, 0, max(seq), pg_current_snapshot() FROM outbox",
            )
            .execute(&mut conn)?;
            diesel::sql_query("VACUUM ANALYZE outbox").execute(&mut conn)?;
        }
        let relay = tokio::spawn(Relay::new(config, nats).run(shutdown.clone()));
        tokio::time::sleep(Duration::from_millis(500)).await;
        let cpu_before = cpu_snapshot();
        let duration = Duration::from_secs(self.args.seconds.max(3));
        let total = (rate as u64 * duration.as_secs()) as usize;
        // writers: 4 threads sharing the rate
        let writers: Vec<_> = (0..4)
            .map(|w| {
                let (url, committed) = (self.db_url.clone(), committed.clone());
                let outbox = Outbox::default().notify(if listen {
                    Notify::Debounced(Duration::from_millis(10))
                } else {
                    Notify::Off
                });
                std::thread::spawn(move || -> Result<()> {
                    let mut conn = PgConnection::establish(&url)?;
                    let interval = Duration::from_secs_f64(4.0 / rate as f64);
                    let start = Instant::now();
                    for i in (w..total).step_by(4) {
                        let due = start + interval * (i / 4) as u32;
                        if let Some(wait) = due.checked_duration_since(Instant::now()) {
                            std::thread::sleep(wait);
                        }
                        let id = conn.transaction(|c| c.record_event_in(&outbox, &event(i)))?;
                        committed
                            .lock()
                            .map_err(|_| anyhow::anyhow!("poisoned"))?
                            .insert(id.to_string(), Instant::now());
                    }
                    Ok(())
                })
            })
            .collect();
        let mut latencies = Vec::with_capacity(total);
        let deadline = Instant::now() + duration + Duration::from_secs(30);
        while latencies.len() < total && Instant::now() < deadline {
            let Ok(Some(msg)) = tokio::time::timeout(Duration::from_secs(5), sub.next()).await
            else {
                break;
            };
            let now = Instant::now();
            let Some(id) = msg
                .headers
                .as_ref()
                .and_then(|h| h.get("Nats-Msg-Id"))
                .map(|v| v.to_string())
            else {
                continue;
            };
            // the commit is recorded just after it returns: wait for it when the message wins
            let mut at = None;
            for _ in 0..100 {
                at = committed
                    .lock()
                    .map_err(|_| anyhow::anyhow!("poisoned"))?
                    .get(&id)
                    .copied();
                if at.is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_micros(100)).await;
            }
            if let Some(at) = at {
                latencies.push(now.saturating_duration_since(at).as_secs_f64() * 1000.0);
            }
        }
        for w in writers {
            w.join().map_err(|_| anyhow::anyhow!("writer panicked"))??;
        }
        let cpu = CpuUse::between(&cpu_before, &cpu_snapshot(), total, &[]);
        shutdown.cancel();
        relay.await??;
        if wake == Wake::Tailing {
            self.drop_slot(&slot)?;
        }
        latencies.sort_by(|a, b| a.total_cmp(b));
        if latencies.is_empty() {
            bail!("no message arrived");
        }
        let pct =
            |p: f64| latencies[((latencies.len() as f64 * p) as usize).min(latencies.len() - 1)];
        Ok((
            pct(0.50),
            pct(0.99),
            latencies[latencies.len() - 1],
            cpu.postgres,
        ))
    }

    /// Section 3.
    async fn write_path(&mut self) -> Result<()> {
        use diesel::RunQueryDsl;
        let secs = self.args.seconds;
        println!(
            "\n## 3. write path: business transactions per second, 8 writers, {secs} s each\n"
        );
        let mut conn = PgConnection::establish(&self.db_url)?;
        diesel::sql_query("CREATE TABLE IF NOT EXISTS bench_orders (id bigserial PRIMARY KEY, customer text NOT NULL, note text NOT NULL)")
            .execute(&mut conn)?;
        let repeat = self.args.repeat.max(1);
        println!("Rounds of every kind in turn; median of {repeat} rounds, each ratio against the");
        println!("hand-written insert of its own round.\n");
        println!("| transaction | tx/s | ratio to hand-written insert |");
        println!("|---|---|---|");
        // per kind: tx/s of each round, ratio of each round
        let mut figures: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); 6];
        for _ in 0..repeat {
            let hand = self.writers(WriteKind::HandWritten, secs)?;
            let round = [
                self.writers(WriteKind::BusinessOnly, secs)?,
                hand,
                self.writers(WriteKind::RecordEvent, secs)?,
                self.writers(WriteKind::RecordEventNotifyOff, secs)?,
                self.writers_async(secs).await?,
                self.writers(WriteKind::RecordEventNotifyEveryCommit, secs)?,
            ];
            for (k, tps) in round.into_iter().enumerate() {
                figures[k].0.push(tps);
                figures[k].1.push(tps / hand);
            }
        }
        let names = [
            "business INSERT alone",
            "+ hand-written Diesel INSERT of the outbox row",
            "+ `record_event` (sync, default debounced NOTIFY)",
            "+ `record_event` (sync, NOTIFY off)",
            "+ `record_event` (async, default debounced NOTIFY)",
            "+ `record_event` with NOTIFY on every commit",
        ];
        for (name, (tps, ratios)) in names.iter().zip(figures.iter_mut()) {
            println!("| {name} | {:.0} | {:.2} |", median(tps), median(ratios));
        }
        Ok(())
    }

    fn writers(&self, kind: WriteKind, secs: u64) -> Result<f64> {
        use diesel::RunQueryDsl;
        self.reset_outbox()?;
        let stop = Instant::now() + Duration::from_secs(secs);
        let outbox = Arc::new(match kind {
            WriteKind::RecordEventNotifyEveryCommit => {
                Outbox::default().notify(Notify::EveryTransaction)
            }
            WriteKind::RecordEventNotifyOff => Outbox::default().notify(Notify::Off),
            _ => Outbox::default(),
        });
        let handles: Vec<_> = (0..8)
            .map(|w| {
                let (url, outbox) = (self.db_url.clone(), outbox.clone());
                std::thread::spawn(move || -> Result<u64> {
                    let mut conn = PgConnection::establish(&url)?;
                    let mut n = 0u64;
                    while Instant::now() < stop {
                        let e = event(w * 1_000_000 + n as usize);
                        conn.transaction(|c| {
                            diesel::sql_query(
                                "INSERT INTO bench_orders (customer, note) VALUES ($1, $2)",
                            )
                            .bind::<diesel::sql_types::Text, _>(&e.customer)
                            .bind::<diesel::sql_types::Text, _>(&e.note)
                            .execute(c)?;
                            match kind {
                                WriteKind::BusinessOnly => {}
                                WriteKind::HandWritten => {
                                    use outbox_diesel::schema::outbox::dsl::*;
                                    diesel::insert_into(outbox)
                                        .values((
                                            id.eq(uuid::Uuid::now_v7()),
                                            aggregate_type.eq("order"),
                                            aggregate_id.eq(&e.order_id),
                                            event_type.eq("order.placed"),
                                            payload.eq(serde_json::to_value(&e).map_err(
                                                |err| {
                                                    diesel::result::Error::SerializationError(
                                                        Box::new(err),
                                                    )
                                                },
                                            )?),
                                        ))
                                        .execute(c)?;
                                }
                                WriteKind::RecordEvent
                                | WriteKind::RecordEventNotifyOff
                                | WriteKind::RecordEventNotifyEveryCommit => {
                                    c.record_event_in(&outbox, &e)?;
                                }
                            }
                            Ok::<_, diesel::result::Error>(())
                        })?;
                        n += 1;
                    }
                    Ok(n)
                })
            })
            .collect();
        let mut total = 0;
        for h in handles {
            total += h.join().map_err(|_| anyhow::anyhow!("writer panicked"))??;
        }
        Ok(total as f64 / secs as f64)
    }

    async fn writers_async(&self, secs: u64) -> Result<f64> {
        use diesel_async::RunQueryDsl;
        self.reset_outbox()?;
        let stop = Instant::now() + Duration::from_secs(secs);
        let mut tasks = Vec::new();
        for w in 0..8usize {
            let url = self.db_url.clone();
            tasks.push(tokio::spawn(async move {
                let mut conn = AsyncPgConnection::establish(&url).await?;
                let mut n = 0u64;
                while Instant::now() < stop {
                    let e = event(w * 1_000_000 + n as usize);
                    conn.transaction(async |c| {
                        diesel::sql_query(
                            "INSERT INTO bench_orders (customer, note) VALUES ($1, $2)",
                        )
                        .bind::<diesel::sql_types::Text, _>(&e.customer)
                        .bind::<diesel::sql_types::Text, _>(&e.note)
                        .execute(c)
                        .await?;
                        c.record_event(&e).await?;
                        Ok::<_, diesel::result::Error>(())
                    })
                    .await?;
                    n += 1;
                }
                Ok::<u64, anyhow::Error>(n)
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await??;
        }
        Ok(total as f64 / secs as f64)
    }

    /// Section 4.
    async fn poll_cost(&mut self) -> Result<()> {
        println!("\n## 4. poll cost: the relays' fetch queries, median of 200 runs\n");
        println!(
            "| table | unordered: ms to find the oldest row (LIMIT 1) | ratio to empty | unordered: ms per batch of 500 | ordered: ms per batch of 500 at its cursor (its session's CPU µs per row returned) |"
        );
        println!("|---|---|---|---|---|");
        self.reset_outbox()?;
        let empty = self.poll_time(1).await?;
        println!(
            "| empty | {empty:.3} | 1.00 | {:.3} | {:.3} |",
            self.poll_time(500).await?,
            self.batch_time(&outbox_diesel::relay::Cursor::start(), 500)
                .await?
        );
        let mut kept = 0;
        let mut cursor = outbox_diesel::relay::Cursor::start();
        for target in self.args.kept.clone() {
            if target <= kept {
                continue;
            }
            self.fill_published(target - kept)?;
            kept = target;
            // an ordered relay's cursor past every row kept
            cursor = self.cursor_now()?;
            let t = self.poll_time(1).await?;
            println!(
                "| {kept} published rows kept, none unpublished | {t:.3} | {:.2} | {:.3} | {:.3} |",
                t / empty,
                self.poll_time(500).await?,
                self.batch_time(&cursor, 500).await?
            );
        }
        self.fill(100_000, false)?;
        // a relay draining the backlog: its cursor's snapshot is that of its last batch, taken
        // after the backlog was written (the first batch after a restart reads the rows
        // written since the last recorded snapshot by transaction id once, on top)
        cursor.snap = self.cursor_now()?.snap;
        let backlog = self.poll_time(1).await?;
        println!(
            "| same + 100000 unpublished backlog | {backlog:.3} | {:.2} | {:.3} | {:.3} |",
            backlog / empty,
            self.poll_time(500).await?,
            self.batch_time(&cursor, 500).await?
        );
        // an ordered relay caught up: its cursor after the backlog, which it leaves in the
        // table unmarked (in `outbox_ready`), and the table analyzed since, as autovacuum does
        {
            use diesel::RunQueryDsl;
            let mut conn = PgConnection::establish(&self.db_url)?;
            diesel::sql_query("VACUUM ANALYZE outbox").execute(&mut conn)?;
        }
        println!(
            "| same, an ordered relay caught up (its cursor after the backlog, the table analyzed) | – | – | – | {:.3} |",
            self.batch_time(&self.cursor_now()?, 500).await?
        );
        let held = self.args.held_back;
        self.hold_back(held).await?;
        cursor.snap = self.cursor_now()?.snap;
        let t = self.poll_time(1).await?;
        println!(
            "| same + {held} rows of one aggregate held back behind its parked row | {t:.3} | {:.2} | {:.3} | {:.3} |",
            t / empty,
            self.poll_time(500).await?,
            self.batch_time(&cursor, 500).await?
        );
        let late = self.late_pass(100_000)?;
        let finding = outbox_diesel::relay::Cursor {
            late: None,
            ..late.clone()
        };
        println!(
            "| same + a late pass over 100000 rows of one transaction, the batch that finds them (and reads the first part) | – | – | – | {:.3} |",
            self.batch_time(&finding, 500).await?
        );
        println!(
            "| same + a late pass over 100000 rows of one transaction, its first part read | – | – | – | {:.3} |",
            self.batch_time(&late, 500).await?
        );
        Ok(())
    }

    /// A cursor in a late pass: `n` rows of one transaction that committed after an ordered
    /// relay had read a later row (so they are late for its cursor), the pass's first part of
    /// 500 read.
    fn late_pass(&self, n: usize) -> Result<outbox_diesel::relay::Cursor> {
        use diesel::RunQueryDsl;
        #[derive(QueryableByName)]
        struct Seq {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            seq: i64,
        }
        let mut bulk = PgConnection::establish(&self.db_url)?;
        diesel::sql_query("SET synchronous_commit = off").execute(&mut bulk)?;
        diesel::sql_query("BEGIN").execute(&mut bulk)?;
        let first: Seq = diesel::sql_query(format!(
            "WITH ins AS (INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'bulk', 'b-' || (i % 100), 'bulk.loaded', \
             jsonb_build_object('i', i, 'note', repeat('x', 230)) FROM generate_series(1, {n}) i \
             RETURNING seq) SELECT min(seq) AS seq FROM ins"
        ))
        .get_result(&mut bulk)?;
        let mut later = PgConnection::establish(&self.db_url)?;
        diesel::sql_query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), 'order', 'later', 'order.placed', '{}')",
        )
        .execute(&mut later)?;
        // the relay read up to the later row while the transaction was open
        let mut cursor = self.cursor_now()?;
        diesel::sql_query("COMMIT").execute(&mut bulk)?;
        diesel::sql_query("VACUUM ANALYZE outbox").execute(&mut later)?;
        cursor.late = Some(outbox_diesel::relay::LatePass {
            after_seq: first.seq + 499,
            snap: self.cursor_now()?.snap,
        });
        Ok(cursor)
    }

    /// A cursor past every row in the table, as an ordered relay leaves it after reading them.
    fn cursor_now(&self) -> Result<outbox_diesel::relay::Cursor> {
        use diesel::RunQueryDsl;
        #[derive(diesel::QueryableByName)]
        struct Now {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            upto_seq: i64,
            #[diesel(sql_type = diesel::sql_types::Text)]
            snap: String,
        }
        let mut conn = PgConnection::establish(&self.db_url)?;
        let now: Now = diesel::sql_query(
            "SELECT COALESCE(max(seq), 0) AS upto_seq, pg_current_snapshot()::text AS snap FROM outbox",
        )
        .get_result(&mut conn)?;
        Ok(outbox_diesel::relay::Cursor::at(now.upto_seq, now.snap))
    }

    /// The median of 200 runs of the ordered relay's batch at `cursor`, in ms (after 20 runs
    /// that set aside what a parked row holds back), and its session's CPU per row returned
    /// over those 200 runs.
    async fn batch_time(
        &self,
        cursor: &outbox_diesel::relay::Cursor,
        limit: i64,
    ) -> Result<BatchCost> {
        let mut conn = AsyncPgConnection::establish(&self.db_url).await?;
        outbox_diesel::relay::prepare_session(&mut conn).await?;
        let backend = outbox_diesel::relay::backend_pid(&mut conn).await? as u32;
        let table = outbox_diesel::OutboxTable::DEFAULT;
        let part = outbox_diesel::relay::Partition::ALL;
        let mut times = Vec::with_capacity(200);
        let (mut rows, mut cpu_before) = (0, 0.0);
        for i in 0..220 {
            if i == 20 {
                cpu_before = process_cpu_secs(backend);
            }
            let start = Instant::now();
            let batch = outbox_diesel::relay::fetch_batch(
                &mut conn,
                &table,
                part,
                cursor,
                &[],
                limit,
                8 << 20,
            )
            .await?;
            if i >= 20 {
                times.push(start.elapsed().as_secs_f64() * 1000.0);
                rows += batch.rows.len();
            }
        }
        let cpu = process_cpu_secs(backend) - cpu_before;
        Ok(BatchCost {
            ms: median(&mut times),
            us_per_row: (rows > 0).then(|| cpu * 1e6 / rows as f64),
        })
    }

    /// Section 6: what deleting kept rows costs PostgreSQL, for rows marked `published_at`
    /// (unordered, and the ordered relay before snapshot batches) and for rows an ordered
    /// relay's cursor covered, each published an hour ago: the relay's own cleanup
    /// (`outbox_nats::cleanup::sweep`, batches of 5,000) and a `VACUUM` after it.
    async fn cleanup_cost(&mut self) -> Result<()> {
        use diesel::RunQueryDsl;
        let n = self.args.events;
        println!("\n## 6. cleanup of {n} kept rows: PostgreSQL CPU per row removed\n");
        println!(
            "| rows published by | deleted in | delete: PostgreSQL CPU µs/row | delete + VACUUM: µs/row |"
        );
        println!("|---|---|---|---|");
        for covered in [false, true] {
            self.reset_outbox()?;
            self.fill(n, false)?;
            let mut conn = PgConnection::establish(&self.db_url)?;
            if covered {
                diesel::sql_query(
                    "INSERT INTO outbox_progress (partitions, partition, upto_seq, snap, published_at) \
                     SELECT 1, 0, max(seq), pg_current_snapshot(), now() - interval '1 hour' FROM outbox",
                )
                .execute(&mut conn)?;
            } else {
                diesel::sql_query("UPDATE outbox SET published_at = now() - interval '1 hour'")
                    .execute(&mut conn)?;
            }
            let table = outbox_diesel::OutboxTable::DEFAULT;
            let (deleted, took, delete, total) = self.measured_sweep(&mut conn, &table, n).await?;
            if deleted as usize != n {
                bail!("cleanup removed {deleted} rows of {n}");
            }
            let by = if covered {
                "the ordered relay (a cursor covered them)"
            } else {
                "a mark (`published_at` set)"
            };
            println!("| {by} | {took:.2?} | {delete:.1} | {total:.1} |");
        }
        // a rotated table: the same rows in three partitions of a ring of four, each emptied
        // with one TRUNCATE; a tenth of them as well, for a cost that does not follow the rows
        for rows in [n, n / 10] {
            let (took, delete, total) = self.rotated_cleanup(rows).await?;
            println!(
                "| the ordered relay, a rotated table (`partition_table`): {rows} rows in 3 partitions emptied | {took:.2?} | {delete:.2} ({:.1} ms in all) | {total:.2} |",
                delete * rows as f64 / 1000.0
            );
        }
        Ok(())
    }

    /// `rows` rows covered by a cursor recorded an hour ago, in the first three partitions of
    /// a ring of four (`outbox_diesel::partition_table`, blocks of a third of them), the
    /// fourth being filled: the relay's cleanup, timed, then a `VACUUM`. Returns the time and
    /// PostgreSQL's CPU per row removed without and with the `VACUUM`.
    async fn rotated_cleanup(&self, rows: usize) -> Result<(Duration, f64, f64)> {
        use diesel::RunQueryDsl;
        let table = outbox_diesel::OutboxTable::new("bench_ring")?;
        let block = rows.div_ceil(3).max(1000) as i64;
        let mut conn = PgConnection::establish(&self.db_url)?;
        diesel::sql_query("DROP TABLE IF EXISTS bench_ring, bench_ring_progress CASCADE")
            .execute(&mut conn)?;
        outbox_diesel::partition_table(
            &mut conn,
            &table,
            outbox_diesel::Rotation::default().block_rows(block),
        )?;
        diesel::sql_query("SET synchronous_commit = off").execute(&mut conn)?;
        diesel::sql_query(format!(
            "INSERT INTO bench_ring (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'order', 'order-' || (i % 1000), 'order.placed', \
             jsonb_build_object('order_id', 'order-' || (i % 1000), 'customer', 'customer-' || i, 'note', repeat('x', 230)) \
             FROM generate_series(1, {rows}) i"
        ))
        .execute(&mut conn)?;
        // the next seq goes to the fourth partition, the one being filled
        diesel::sql_query(format!(
            "SELECT setval(pg_get_serial_sequence('bench_ring', 'seq'), {})",
            3 * block
        ))
        .execute(&mut conn)?;
        diesel::sql_query(
            "INSERT INTO bench_ring_progress (partitions, partition, upto_seq, snap, published_at) \
             SELECT 1, 0, max(seq), pg_current_snapshot(), now() - interval '1 hour' FROM bench_ring",
        )
        .execute(&mut conn)?;
        let (_, took, delete, total) = self.measured_sweep(&mut conn, &table, rows).await?;
        #[derive(QueryableByName)]
        struct Left {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let left: Left =
            diesel::sql_query("SELECT count(*) AS n FROM bench_ring").get_result(&mut conn)?;
        diesel::sql_query("DROP TABLE bench_ring, bench_ring_progress CASCADE")
            .execute(&mut conn)?;
        if left.n != 0 {
            bail!(
                "cleanup of the rotated table left {} rows of {rows}",
                left.n
            );
        }
        Ok((took, delete, total))
    }

    /// `VACUUM ANALYZE` of `table`, then the relay's cleanup of it (retention 60 s, batches
    /// of 5,000) and a `VACUUM`: the rows it deleted one by one, its time, and PostgreSQL's
    /// CPU per row of `rows` without and with the `VACUUM`.
    async fn measured_sweep(
        &self,
        conn: &mut PgConnection,
        table: &outbox_diesel::OutboxTable,
        rows: usize,
    ) -> Result<(u64, Duration, f64, f64)> {
        use diesel::RunQueryDsl;
        let t = table.quoted();
        diesel::sql_query(format!("VACUUM ANALYZE {t}")).execute(conn)?;
        let mut aconn = AsyncPgConnection::establish(&self.db_url).await?;
        let before = cpu_snapshot();
        let started = Instant::now();
        let deleted = outbox_nats::cleanup::sweep(
            &mut aconn,
            table,
            None,
            Duration::from_secs(60),
            5_000,
            &CancellationToken::new(),
        )
        .await?;
        let took = started.elapsed();
        let deleting = cpu_snapshot();
        diesel::sql_query(format!("VACUUM {t}")).execute(conn)?;
        let after = cpu_snapshot();
        Ok((
            deleted,
            took,
            CpuUse::between(&before, &deleting, rows, &[]).postgres,
            CpuUse::between(&before, &after, rows, &[]).postgres,
        ))
    }

    /// A hot aggregate's row parked with `n` later rows of it recorded, held back the way the
    /// relay holds them (`outbox_diesel::relay::hold_back`), then vacuumed.
    async fn hold_back(&self, n: usize) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        diesel::sql_query("SET synchronous_commit = off").execute(&mut conn)?;
        diesel::sql_query(format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, attempts, last_error, parked_at) \
             SELECT gen_random_uuid(), 'order', 'hot', 'order.placed', \
             jsonb_build_object('i', i, 'note', repeat('x', 230)), \
             CASE WHEN i = 0 THEN 5 ELSE 0 END, CASE WHEN i = 0 THEN 'rejected' END, \
             CASE WHEN i = 0 THEN now() END FROM generate_series(0, {n}) i"
        ))
        .execute(&mut conn)?;
        #[derive(QueryableByName)]
        struct Seq {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            seq: i64,
        }
        let seqs: Vec<i64> = diesel::sql_query(
            "SELECT seq FROM outbox WHERE aggregate_id = 'hot' AND parked_at IS NULL ORDER BY seq",
        )
        .load::<Seq>(&mut conn)?
        .into_iter()
        .map(|s| s.seq)
        .collect();
        let mut aconn = AsyncPgConnection::establish(&self.db_url).await?;
        let table = outbox_diesel::OutboxTable::DEFAULT;
        let mut held = 0;
        for chunk in seqs.chunks(50_000) {
            held += outbox_diesel::relay::hold_back(&mut aconn, &table, chunk).await?;
        }
        if held != n {
            bail!("held back {held} rows of {n}");
        }
        diesel::sql_query("VACUUM ANALYZE outbox").execute(&mut conn)?;
        Ok(())
    }

    /// Adds `n` published rows the way a relay leaves them: inserted unpublished (so they
    /// entered the partial index), then marked, then vacuumed as autovacuum would.
    fn fill_published(&self, n: usize) -> Result<()> {
        use diesel::RunQueryDsl;
        let mut conn = PgConnection::establish(&self.db_url)?;
        let chunk = 500_000;
        let mut done = 0;
        while done < n {
            let m = chunk.min(n - done);
            self.fill(m, false)?;
            diesel::sql_query(
                "UPDATE outbox SET published_at = now() - interval '1 hour' WHERE published_at IS NULL",
            )
            .execute(&mut conn)?;
            diesel::sql_query("VACUUM outbox").execute(&mut conn)?;
            done += m;
        }
        diesel::sql_query("VACUUM ANALYZE outbox").execute(&mut conn)?;
        Ok(())
    }

    /// The median of 200 runs of the fetch, in ms.
    async fn poll_time(&self, limit: i64) -> Result<f64> {
        let mut conn = AsyncPgConnection::establish(&self.db_url).await?;
        outbox_diesel::relay::prepare_session(&mut conn).await?;
        let table = outbox_diesel::OutboxTable::DEFAULT;
        let part = outbox_diesel::relay::Partition::ALL;
        for _ in 0..20 {
            outbox_diesel::relay::fetch_unpublished(&mut conn, &table, part, &[], limit).await?;
        }
        let mut times = Vec::with_capacity(200);
        for _ in 0..200 {
            let start = Instant::now();
            outbox_diesel::relay::fetch_unpublished(&mut conn, &table, part, &[], limit).await?;
            times.push(start.elapsed().as_secs_f64() * 1000.0);
        }
        Ok(median(&mut times))
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

    /// Section 5.
    async fn memory(&mut self) -> Result<()> {
        let n = self.args.memory_backlog;
        println!("\n## 5. relay memory: peak RSS of `outbox-relay` draining {n} rows\n");
        println!("| relay | backlog | drained in | events/s | peak RSS |");
        println!("|---|---|---|---|---|");
        self.memory_run(n, None).await?;
        self.memory_large(self.args.large_rows, "ordered").await?;
        self.memory_large(self.args.large_rows, "unordered").await?;
        if self.wal_level()? == "logical" {
            self.memory_run(n, Some(100)).await?;
            self.memory_run(n, Some(n)).await?;
        } else {
            println!("| log-tailing | skipped: `wal_level` is not `logical` | | | |");
        }
        Ok(())
    }

    /// One drain of `n` rows of 900 KB payloads by a relay in `mode` with its defaults
    /// (`--max-batch-bytes` 8 MiB; unordered: 4 workers), sampling its peak RSS.
    async fn memory_large(&mut self, n: usize, mode: &str) -> Result<()> {
        use diesel::RunQueryDsl;
        self.reset_outbox()?;
        let mut conn = PgConnection::establish(&self.db_url)?;
        diesel::sql_query("SET synchronous_commit = off").execute(&mut conn)?;
        for start in (0..n).step_by(50) {
            // 900 KB of JSON text each: 28,125 md5 digests of 32 characters
            diesel::sql_query(format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 SELECT gen_random_uuid(), 'blob', 'blob-' || (i % 100), 'blob.stored', \
                 jsonb_build_object('i', i, 'data', repeat(md5(i::text), 28125)) \
                 FROM generate_series({start}, {}) i",
                (start + 50).min(n) - 1
            ))
            .execute(&mut conn)?;
        }
        let (name, prefix) = ("BENCH_MEM_LARGE", "benchmemlarge");
        self.stream(name, prefix).await?;
        let args = ["--mode", mode, "--no-cleanup"].map(String::from);
        let child = self.spawn_relay(name, prefix, &args)?;
        let start = Instant::now();
        let mut peak_kb = 0u64;
        while self.left(name, n).await? {
            peak_kb = peak_kb.max(vm_hwm_kb(child.id()).unwrap_or(0));
            tokio::time::sleep(Duration::from_millis(100)).await;
            if start.elapsed() > Duration::from_secs(900) {
                bail!("the relay did not drain the large rows in 15 minutes");
            }
        }
        peak_kb = peak_kb.max(vm_hwm_kb(child.id()).unwrap_or(0));
        let elapsed = start.elapsed().as_secs_f64();
        drop(child);
        println!(
            "| {mode}, 900 KB payloads | {n} | {elapsed:.1} s | {:.0} | {:.1} MiB |",
            n as f64 / elapsed,
            peak_kb as f64 / 1024.0
        );
        Ok(())
    }

    /// One drain of `n` rows by an `ordered` relay, or a log-tailing one with the backlog in
    /// transactions of `per_tx` events (`Some(n)`: one transaction), sampling its peak RSS.
    async fn memory_run(&mut self, n: usize, per_tx: Option<usize>) -> Result<()> {
        self.reset_outbox()?;
        let tailing = per_tx.is_some();
        let slot = format!("{}_slot", self.db_name);
        let mut args = Vec::new();
        if let Some(per_tx) = per_tx {
            self.create_slot(&slot)?;
            self.fill_rows(n, per_tx, false)?;
            args.extend(["--mode", "log-tailing", "--slot", &slot].map(String::from));
        } else {
            self.fill(n, false)?;
        }
        let (name, prefix) = if tailing {
            ("BENCH_MEM_LT", "benchmemlt")
        } else {
            ("BENCH_MEM", "benchmem")
        };
        self.stream(name, prefix).await?;
        let child = self.spawn_relay(name, prefix, &args)?;
        let start = Instant::now();
        let mut peak_kb = 0u64;
        loop {
            if !self.left(name, n).await? {
                break;
            }
            peak_kb = peak_kb.max(vm_hwm_kb(child.id()).unwrap_or(0));
            tokio::time::sleep(Duration::from_millis(100)).await;
            if start.elapsed() > Duration::from_secs(900) {
                bail!("the relay did not drain the backlog in 15 minutes");
            }
        }
        peak_kb = peak_kb.max(vm_hwm_kb(child.id()).unwrap_or(0));
        let elapsed = start.elapsed().as_secs_f64();
        drop(child);
        if tailing {
            self.drop_slot(&slot)?;
        }
        let relay = match per_tx {
            None => "ordered".to_owned(),
            Some(m) if m >= n => "log-tailing, one transaction".to_owned(),
            Some(m) => format!("log-tailing, transactions of {m}"),
        };
        println!(
            "| {relay} | {n} | {elapsed:.1} s | {:.0} | {:.1} MiB |",
            n as f64 / elapsed,
            peak_kb as f64 / 1024.0
        );
        Ok(())
    }
}

/// How the relay of a latency run learns of a commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// A polling relay woken by the recording side's `NOTIFY`.
    Notify,
    /// The same without reading again after a read that found rows (`--linger 0`).
    NotifyNoLinger,
    /// A polling relay, polling only.
    Poll,
    /// The log-tailing relay.
    Tailing,
}

#[derive(Clone, Copy)]
enum WriteKind {
    BusinessOnly,
    HandWritten,
    RecordEvent,
    RecordEventNotifyOff,
    RecordEventNotifyEveryCommit,
}

/// CPU seconds used so far by every process: pid → (command name, seconds). A PostgreSQL
/// process counts its reaped children too: the postmaster's are the backends (and workers)
/// that have exited, so sessions that end during a run are counted.
fn cpu_snapshot() -> HashMap<u32, (String, f64)> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ...`: the name may hold spaces, so split at the last `)`
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = stat[open + 1..close].to_owned();
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // utime and stime are fields 14 and 15; `fields` starts at field 3; USER_HZ is 100
        let ticks = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        // cutime and cstime (16 and 17): the children's, once reaped
        let children = if comm == "postgres" {
            ticks(13) + ticks(14)
        } else {
            0.0
        };
        out.insert(pid, (comm, (ticks(11) + ticks(12) + children) / 100.0));
    }
    out
}

/// A batch's median time and its session's CPU per row returned (none when it returned no
/// row), as section 4 prints them: `2.104 (3.9)`.
struct BatchCost {
    ms: f64,
    us_per_row: Option<f64>,
}

impl std::fmt::Display for BatchCost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.us_per_row {
            Some(us) => write!(f, "{:.3} ({us:.1})", self.ms),
            None => write!(f, "{:.3}", self.ms),
        }
    }
}

/// The CPU a process has used so far (user and system), in seconds; 0 when it is gone.
fn process_cpu_secs(pid: u32) -> f64 {
    cpu_snapshot().get(&pid).map_or(0.0, |(_, secs)| *secs)
}

/// CPU µs per event spent by PostgreSQL, nats-server and this process (the relay or the
/// publisher) between two snapshots.
#[derive(Clone, Copy, Default)]
struct CpuUse {
    postgres: f64,
    nats: f64,
    own: f64,
}

impl CpuUse {
    fn between(
        before: &HashMap<u32, (String, f64)>,
        after: &HashMap<u32, (String, f64)>,
        events: usize,
        own: &[u32],
    ) -> Self {
        // each kind's total after less its total before: a process gone since (a PostgreSQL
        // session that ended) is in the postmaster's reaped children's time after
        let mut u = CpuUse::default();
        for (snapshot, sign) in [(after, 1.0), (before, -1.0)] {
            for (pid, (comm, secs)) in snapshot {
                let per_event = sign * secs * 1e6 / events.max(1) as f64;
                if own.contains(pid) {
                    u.own += per_event;
                } else if comm == "postgres" {
                    u.postgres += per_event;
                } else if comm == "nats-server" {
                    u.nats += per_event;
                }
            }
        }
        u
    }

    fn median(all: &[CpuUse]) -> CpuUse {
        let pick = |f: fn(&CpuUse) -> f64| median(&mut all.iter().map(f).collect::<Vec<_>>());
        CpuUse {
            postgres: pick(|c| c.postgres),
            nats: pick(|c| c.nats),
            own: pick(|c| c.own),
        }
    }
}

/// The `outbox-relay` binary beside this example (`target/release/outbox-relay`).
fn relay_bin() -> Result<std::path::PathBuf> {
    let bin = std::env::current_exe()?
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("outbox-relay"))
        .context("target dir")?;
    if !bin.exists() {
        bail!(
            "{} is missing: cargo build --release --workspace --bins first",
            bin.display()
        );
    }
    Ok(bin)
}

/// A relay process, stopped with SIGTERM (and waited for) when dropped.
struct RelayProcess(std::process::Child);

impl RelayProcess {
    fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

fn vm_hwm_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

fn num_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn server_versions(conn: &mut PgConnection, nats: &async_nats::Client) -> String {
    use diesel::RunQueryDsl;
    #[derive(QueryableByName)]
    struct V {
        #[diesel(sql_type = diesel::sql_types::Text)]
        v: String,
    }
    let pg = diesel::sql_query("SELECT current_setting('server_version') AS v")
        .get_result::<V>(conn)
        .map(|v| v.v)
        .unwrap_or_default();
    format!(
        "PostgreSQL {pg}, nats-server {}",
        nats.server_info().version
    )
}
