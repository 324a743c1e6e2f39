//! What recording a publication costs the database, per candidate design of the ordered relay,
//! under sustained load (BENCHMARKS.md, "Candidates for the ordered relay without a write per
//! event").
//!
//! ```sh
//! cargo run --release --example publish_record_cost                  # about 12 minutes
//! cargo run --release --example publish_record_cost -- --rounds 1 --tx-sizes 10 --only baseline,snapshots
//! ```
//!
//! Each run makes a database of its own (dropped after), starts 8 writers inserting outbox rows
//! at a fixed total rate (transactions of 1 or of 10 events, `--aggregates` aggregate ids) and
//! one reader that consumes them in order the way the candidate would, with its cleanup of kept
//! rows and a `VACUUM` every `--vacuum-every` (autovacuum is off on the tables, so that every
//! candidate pays for its dead rows in its own measured session). The publish itself is left
//! out: the reader publishes nothing, since the figure is the database's share. When the writers
//! stop, the reader drains the rest, the cleanup waits out the retention and removes every kept
//! row, and a last `VACUUM` runs. The figure is the CPU (utime + stime from `/proc/<pid>/stat`)
//! of every backend of the run (writers, reader, maintenance) over the events written.
//!
//! Candidates, beside the baseline (the writers alone, the hand-written `INSERT`):
//!
//! 1. `marked`: today's ordered mode, the relay's own statements (`outbox_diesel::relay`): fetch
//!    through the partial index on unpublished rows, `UPDATE … SET published_at` per batch,
//!    `delete_published` past the retention;
//! 2. `hot-mark`: no index reads `published_at` (fillfactor lowered), a watermark row per
//!    partition with the snapshot it was set at, so late commits are found by their `xid8`;
//!    cleanup by `seq` ranges below the watermark;
//! 3. `delete`: today's fetch, `DELETE … WHERE seq = ANY(…)` per batch, nothing kept;
//! 4. `snapshots`: PgQ's batches: rows carry `xid8`, a batch is the rows whose transaction
//!    became visible between two snapshots, progress is one row per consumer, and old rows go
//!    by recycling partitions (by `txid` range) with `TRUNCATE`.
//!
//! Candidates 2 and 4 (and the others) also run a held-open transaction: it inserts a row, stays
//! open while later rows commit and are consumed, then commits; the run prints whether its row
//! was consumed.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Parser;
use diesel::sql_types::{Array, BigInt, Text};
use diesel::{Connection, PgConnection, QueryableByName};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use outbox_diesel::OutboxTable;
use outbox_diesel::relay::{self, OutboxRow, Partition};

#[derive(Parser, Debug)]
#[command(about = "Database CPU per event of each way to record a publication")]
struct Args {
    /// PostgreSQL server URL, without a database.
    #[arg(
        long,
        env = "BENCH_PG",
        default_value = "postgres://postgres@127.0.0.1:5432"
    )]
    pg: String,
    /// Seconds of writing per run.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Events per second, all writers together.
    #[arg(long, default_value_t = 2000)]
    rate: u64,
    /// Writer sessions.
    #[arg(long, default_value_t = 8)]
    writers: usize,
    /// Events per writer transaction: one run of every candidate for each.
    #[arg(long, value_delimiter = ',', default_value = "1,10")]
    tx_sizes: Vec<usize>,
    /// Distinct aggregate ids.
    #[arg(long, default_value_t = 1000)]
    aggregates: usize,
    /// Most rows per reader batch (the relay's `--batch-size`).
    #[arg(long, default_value_t = 500)]
    batch: i64,
    /// The reader's pause after a batch that was not full.
    #[arg(long, default_value = "10ms", value_parser = humantime::parse_duration)]
    poll_interval: Duration,
    /// How long published rows are kept.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    retention: Duration,
    /// How often the cleanup runs.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    cleanup_interval: Duration,
    /// Rows per cleanup statement (the relay's `--cleanup-batch`).
    #[arg(long, default_value_t = 5000)]
    cleanup_batch: i64,
    /// How often the maintenance session vacuums the table (autovacuum is off on it).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    vacuum_every: Duration,
    /// The table's fillfactor for the HOT mark.
    #[arg(long, default_value_t = 50)]
    fillfactor: u32,
    /// Only these candidates (baseline, marked, hot-mark, delete, snapshots), comma-separated.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Rounds of every run; the table shows the medians.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Candidate {
    Baseline,
    Marked,
    HotMark,
    Delete,
    Snapshots,
}

impl Candidate {
    const ALL: [Candidate; 5] = [
        Candidate::Baseline,
        Candidate::Marked,
        Candidate::HotMark,
        Candidate::Delete,
        Candidate::Snapshots,
    ];

    fn name(self) -> &'static str {
        match self {
            Candidate::Baseline => "baseline",
            Candidate::Marked => "marked",
            Candidate::HotMark => "hot-mark",
            Candidate::Delete => "delete",
            Candidate::Snapshots => "snapshots",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Candidate::Baseline => "baseline: the INSERT alone, no reader",
            Candidate::Marked => "1. today: partial index, non-HOT mark, cleanup past retention",
            Candidate::HotMark => "2. HOT mark: watermark + xid8 window, fillfactor",
            Candidate::Delete => "3. delete on publish",
            Candidate::Snapshots => "4. snapshot batches (PgQ), partitions truncated",
        }
    }
}

/// A `pg_snapshot` as its text form `xmin:xmax:xip,…` reads.
#[derive(Clone, Debug)]
struct Snapshot {
    text: String,
    xmax: u64,
    xip: Vec<u64>,
}

impl Snapshot {
    fn parse(text: &str) -> Result<Snapshot> {
        let mut parts = text.splitn(3, ':');
        let mut next = || {
            parts
                .next()
                .ok_or_else(|| anyhow!("not a pg_snapshot: {text:?}"))
        };
        let _xmin: u64 = next()?.parse()?;
        let xmax = next()?.parse()?;
        let xip = next()?
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::parse)
            .collect::<Result<Vec<u64>, _>>()?;
        Ok(Snapshot {
            text: text.to_owned(),
            xmax,
            xip,
        })
    }
}

#[derive(QueryableByName)]
struct TextValue {
    #[diesel(sql_type = Text)]
    v: String,
}

#[derive(QueryableByName)]
struct BigValue {
    #[diesel(sql_type = BigInt)]
    v: i64,
}

/// A bind parameter of a [`Stmt`].
enum Bind<'a> {
    Big(i64),
    Text(&'a str),
    Texts(&'a [String]),
    Bigs(&'a [i64]),
}

/// A statement written as text with its parameters between the pieces, prepared once per
/// session as the relay's own statements are (diesel's `sql_query` is parsed and planned
/// again on every call).
struct Stmt<'a> {
    pieces: &'a [&'a str],
    binds: Vec<Bind<'a>>,
}

impl<'a> Stmt<'a> {
    fn new(pieces: &'a [&'a str], binds: Vec<Bind<'a>>) -> Self {
        Stmt { pieces, binds }
    }
}

impl diesel::query_builder::QueryId for Stmt<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl diesel::query_builder::Query for Stmt<'_> {
    type SqlType = diesel::sql_types::Untyped;
}

impl diesel::query_builder::QueryFragment<diesel::pg::Pg> for Stmt<'_> {
    fn walk_ast<'b>(
        &'b self,
        mut out: diesel::query_builder::AstPass<'_, 'b, diesel::pg::Pg>,
    ) -> diesel::QueryResult<()> {
        for (i, piece) in self.pieces.iter().enumerate() {
            out.push_sql(piece);
            match self.binds.get(i) {
                Some(Bind::Big(v)) => out.push_bind_param::<BigInt, _>(v)?,
                Some(Bind::Text(v)) => out.push_bind_param::<Text, _>(v)?,
                Some(Bind::Texts(v)) => out.push_bind_param::<Array<Text>, _>(v)?,
                Some(Bind::Bigs(v)) => out.push_bind_param::<Array<BigInt>, _>(v)?,
                None => {}
            }
        }
        Ok(())
    }
}

impl<Conn> diesel::RunQueryDsl<Conn> for Stmt<'_> {}

async fn text_value(conn: &mut AsyncPgConnection, sql: &str) -> Result<String> {
    let row: TextValue = Stmt::new(&[sql], Vec::new()).get_result(conn).await?;
    Ok(row.v)
}

async fn current_snapshot(conn: &mut AsyncPgConnection) -> Result<Snapshot> {
    Snapshot::parse(&text_value(conn, "SELECT pg_current_snapshot()::text AS v").await?)
}

/// CPU seconds (utime + stime) of `pid` so far; `USER_HZ` is 100.
fn cpu_seconds(pid: i32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some(close) = stat.rfind(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// The backends of a run, by role.
#[derive(Default)]
struct Backends {
    writers: Vec<i32>,
    reader: Vec<i32>,
    maintenance: Vec<i32>,
}

impl Backends {
    fn cpu(&self) -> [f64; 3] {
        let sum = |pids: &[i32]| pids.iter().map(|p| cpu_seconds(*p)).sum::<f64>();
        [
            sum(&self.writers),
            sum(&self.reader),
            sum(&self.maintenance),
        ]
    }
}

/// What the run's tasks share. In a module of its own: `diesel_async::RunQueryDsl`, in scope
/// elsewhere, has a `load` of its own for every type.
mod shared {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    #[derive(Default)]
    pub struct Shared {
        written: AtomicU64,
        consumed: AtomicU64,
        batches: AtomicU64,
        writing_done: AtomicBool,
        drained: AtomicBool,
        held_consumed: AtomicBool,
    }

    impl Shared {
        pub fn written(&self) -> u64 {
            self.written.load(Ordering::SeqCst)
        }
        pub fn add_written(&self, n: u64) {
            self.written.fetch_add(n, Ordering::SeqCst);
        }
        pub fn consumed(&self) -> u64 {
            self.consumed.load(Ordering::SeqCst)
        }
        /// Counts a batch of `n` rows.
        pub fn add_consumed(&self, n: u64) {
            self.consumed.fetch_add(n, Ordering::SeqCst);
            if n > 0 {
                self.batches.fetch_add(1, Ordering::SeqCst);
            }
        }
        pub fn batches(&self) -> u64 {
            self.batches.load(Ordering::SeqCst)
        }
        pub fn writing_done(&self) -> bool {
            self.writing_done.load(Ordering::SeqCst)
        }
        pub fn set_writing_done(&self) {
            self.writing_done.store(true, Ordering::SeqCst);
        }
        pub fn drained(&self) -> bool {
            self.drained.load(Ordering::SeqCst)
        }
        pub fn set_drained(&self) {
            self.drained.store(true, Ordering::SeqCst);
        }
        pub fn held_consumed(&self) -> bool {
            self.held_consumed.load(Ordering::SeqCst)
        }
        pub fn set_held_consumed(&self) {
            self.held_consumed.store(true, Ordering::SeqCst);
        }
    }
}
use shared::Shared;

const HELD_AGGREGATE: &str = "held-open";

/// One run's figures.
struct Figures {
    candidate: Candidate,
    tx_size: usize,
    events: u64,
    consumed: u64,
    rate: f64,
    /// µs per event: writers, reader, maintenance
    cpu: [f64; 3],
    batch_rows: f64,
    updates: i64,
    hot_updates: i64,
    held: Option<bool>,
    leftover: i64,
    load_before: String,
    load_after: String,
}

impl Figures {
    fn total(&self) -> f64 {
        self.cpu.iter().sum()
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let candidates: Vec<Candidate> = Candidate::ALL
        .into_iter()
        .filter(|c| args.only.is_empty() || args.only.iter().any(|o| o == c.name()))
        .collect();
    if candidates.is_empty() {
        bail!("--only names no candidate; expected baseline, marked, hot-mark, delete, snapshots");
    }
    println!("# what recording a publication costs the database");
    println!(
        "{} writers, {} events/s in all, {} s per run, {} aggregates, batches of up to {}, \
         poll {:?}, retention {:?}, cleanup every {:?}, VACUUM every {:?}, fillfactor {} (HOT \
         mark); the publish is left out; CPU from /proc/<pid>/stat of the run's backends",
        args.writers,
        args.rate,
        args.seconds,
        args.aggregates,
        args.batch,
        args.poll_interval,
        args.retention,
        args.cleanup_interval,
        args.vacuum_every,
        args.fillfactor
    );
    let mut all: Vec<Figures> = Vec::new();
    let mut run_no = 0;
    for round in 0..args.rounds {
        for &tx_size in &args.tx_sizes {
            for &candidate in &candidates {
                run_no += 1;
                let db = format!("outbox_pubcost_{}_{run_no}", std::process::id());
                let figures = run_in_database(&args, &db, candidate, tx_size).await?;
                print_run(round, &figures);
                all.push(figures);
            }
        }
    }
    print_table(&all);
    Ok(())
}

fn print_run(round: usize, f: &Figures) {
    println!(
        "round {} tx {:>2} {:<10} events {:>7} consumed {:>7} ({:.0}/s) µs/event total {:>6.1} \
         = writers {:.1} + reader {:.1} + cleanup/vacuum {:.1}; rows/batch {:.0}; updates {} \
         (HOT {}); held-open {}; rows left {}; load {} → {}",
        round + 1,
        f.tx_size,
        f.candidate.name(),
        f.events,
        f.consumed,
        f.rate,
        f.total(),
        f.cpu[0],
        f.cpu[1],
        f.cpu[2],
        f.batch_rows,
        f.updates,
        f.hot_updates,
        match f.held {
            None => "-",
            Some(true) => "OK",
            Some(false) => "FAILED",
        },
        f.leftover,
        f.load_before,
        f.load_after
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 0 => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        n => v[n / 2],
    }
}

fn print_table(all: &[Figures]) {
    let mut tx_sizes: Vec<usize> = all.iter().map(|f| f.tx_size).collect();
    tx_sizes.dedup();
    tx_sizes.sort_unstable();
    tx_sizes.dedup();
    for tx in tx_sizes {
        println!();
        println!("## transactions of {tx} event(s): medians over the rounds");
        println!(
            "| candidate | µs/event total | writers / reader / cleanup+vacuum | ratio to the insert | \
             HOT updates / updates | held-open row consumed | load |"
        );
        println!("|---|---|---|---|---|---|---|");
        let of = |c: Candidate| -> Vec<&Figures> {
            all.iter()
                .filter(|f| f.tx_size == tx && f.candidate == c)
                .collect()
        };
        let base = median(of(Candidate::Baseline).iter().map(|f| f.total()).collect());
        for c in Candidate::ALL {
            let runs = of(c);
            if runs.is_empty() {
                continue;
            }
            let total = median(runs.iter().map(|f| f.total()).collect());
            let part = |i: usize| median(runs.iter().map(|f| f.cpu[i]).collect());
            let ratio = if base > 0.0 {
                format!("{:.2}", total / base)
            } else {
                "-".into()
            };
            let upd: i64 = runs.iter().map(|f| f.updates).sum();
            let hot: i64 = runs.iter().map(|f| f.hot_updates).sum();
            let held = if runs.iter().all(|f| f.held.is_none()) {
                "-"
            } else if runs.iter().all(|f| f.held == Some(true)) {
                "OK"
            } else {
                "FAILED"
            };
            let loads: Vec<String> = runs
                .iter()
                .map(|f| format!("{} → {}", f.load_before, f.load_after))
                .collect();
            println!(
                "| {} | {:.1} | {:.1} / {:.1} / {:.1} | {} | {} | {} | {} |",
                c.describe(),
                total,
                part(0),
                part(1),
                part(2),
                ratio,
                if upd > 0 {
                    format!("{hot} / {upd} = {:.2}", hot as f64 / upd as f64)
                } else {
                    "-".into()
                },
                held,
                loads.join("; ")
            );
        }
    }
}

async fn run_in_database(
    args: &Args,
    db: &str,
    candidate: Candidate,
    tx_size: usize,
) -> Result<Figures> {
    let mut admin = PgConnection::establish(&format!("{}/postgres", args.pg))
        .with_context(|| format!("cannot reach PostgreSQL at {}; set BENCH_PG", args.pg))?;
    sync_execute(&mut admin, &format!("CREATE DATABASE {db}"))
        .context("cannot create the benchmark's database")?;
    let url = format!("{}/{db}", args.pg);
    let result = run(args, &url, candidate, tx_size).await;
    let _ = sync_execute(
        &mut admin,
        &format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"),
    );
    result
}

/// The table as the candidate needs it, made by today's migration first.
fn set_up(url: &str, candidate: Candidate, args: &Args, span: u64) -> Result<()> {
    let mut conn = PgConnection::establish(url).context("cannot reach the new database")?;
    outbox_diesel::run_migrations(&mut conn)
        .map_err(|e| anyhow!("cannot apply the outbox migration: {e}"))?;
    let mut ddl: Vec<String> = Vec::new();
    match candidate {
        Candidate::Baseline | Candidate::Marked | Candidate::Delete => {}
        Candidate::HotMark => {
            ddl.extend([
                "DROP INDEX outbox_unpublished, outbox_ready, outbox_published".into(),
                "ALTER TABLE outbox ADD COLUMN txid xid8 NOT NULL DEFAULT pg_current_xact_id()"
                    .into(),
                "CREATE INDEX outbox_txid ON outbox (txid)".into(),
                format!("ALTER TABLE outbox SET (fillfactor = {})", args.fillfactor),
                "CREATE TABLE relay_cursor (part integer PRIMARY KEY, watermark bigint NOT NULL, \
                 snap pg_snapshot NOT NULL)"
                    .into(),
                "INSERT INTO relay_cursor VALUES (0, 0, pg_current_snapshot())".into(),
            ]);
        }
        Candidate::Snapshots => {
            ddl.push("DROP TABLE outbox".into());
            ddl.push(SNAPSHOT_TABLE.into());
            ddl.push(
                "CREATE INDEX outbox_parked ON outbox (aggregate_type, aggregate_id) \
                 WHERE parked_at IS NOT NULL"
                    .into(),
            );
            ddl.push(
                "CREATE TABLE relay_consumer (part integer PRIMARY KEY, snap pg_snapshot NOT NULL, \
                 at timestamptz NOT NULL DEFAULT now())"
                    .into(),
            );
            ddl.push("INSERT INTO relay_consumer VALUES (0, pg_current_snapshot())".into());
        }
    }
    for sql in &ddl {
        sync_execute(&mut conn, sql).with_context(|| format!("set-up failed: {sql}"))?;
    }
    if candidate == Candidate::Snapshots {
        // the first partitions: from the start to two spans past the next transaction id
        let next: u64 =
            <diesel::query_builder::SqlQuery as diesel::RunQueryDsl<PgConnection>>::get_result::<
                TextValue,
            >(
                diesel::sql_query("SELECT pg_snapshot_xmax(pg_current_snapshot())::text AS v"),
                &mut conn,
            )?
            .v
            .parse()?;
        for (i, (lo, hi)) in [(None, next + span), (Some(next + span), next + 2 * span)]
            .into_iter()
            .enumerate()
        {
            let from = lo.map_or("MINVALUE".to_owned(), |l: u64| format!("'{l}'"));
            sync_execute(
                &mut conn,
                &format!(
                    "CREATE TABLE outbox_p{i} PARTITION OF outbox FOR VALUES FROM ({from}) TO ('{hi}')"
                ),
            )?;
            sync_execute(
                &mut conn,
                &format!("ALTER TABLE outbox_p{i} SET (autovacuum_enabled = false)"),
            )?;
        }
    } else {
        sync_execute(
            &mut conn,
            "ALTER TABLE outbox SET (autovacuum_enabled = false)",
        )?;
    }
    sync_execute(&mut conn, "CHECKPOINT")?;
    Ok(())
}

fn sync_execute(conn: &mut PgConnection, sql: &str) -> diesel::QueryResult<usize> {
    diesel::RunQueryDsl::execute(diesel::sql_query(sql), conn)
}

/// Today's table, partitioned by the inserting transaction's id, with no index on
/// `published_at` (never set here: a view would answer it from the consumer's snapshots).
/// A partitioned table's unique keys include the partition key: `(txid, seq)` is the primary
/// key and serves the batch query, `id` is unique with `txid`.
const SNAPSHOT_TABLE: &str = "CREATE TABLE outbox (
    seq            bigint      GENERATED ALWAYS AS IDENTITY,
    id             uuid        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL DEFAULT '{}',
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz,
    aggregate_hash integer     NOT NULL
        GENERATED ALWAYS AS (('x' || substr(md5(aggregate_id), 1, 7))::bit(28)::integer) STORED,
    attempts       integer     NOT NULL DEFAULT 0,
    last_error     text,
    parked_at      timestamptz,
    txid           xid8        NOT NULL DEFAULT pg_current_xact_id(),
    CONSTRAINT outbox_aggregate_type_is_a_subject_token
        CHECK (aggregate_type <> '' AND aggregate_type !~ '[.*>[:space:][:cntrl:]]'),
    CONSTRAINT outbox_event_type_is_subject_tokens
        CHECK (event_type ~ '^[^.*>[:space:][:cntrl:]]+(\\.[^.*>[:space:][:cntrl:]]+)*$'),
    CONSTRAINT outbox_aggregate_id_is_a_header_value CHECK (aggregate_id <> '' AND aggregate_id !~ '[\\r\\n]'),
    CONSTRAINT outbox_headers_is_an_object CHECK (jsonb_typeof(headers) = 'object'),
    PRIMARY KEY (txid, seq),
    UNIQUE (id, txid)
) PARTITION BY RANGE (txid)";

async fn connect(url: &str) -> Result<(AsyncPgConnection, i32)> {
    let mut conn = AsyncPgConnection::establish(url)
        .await
        .context("cannot connect to the benchmark's database")?;
    let pid = relay::backend_pid(&mut conn).await?;
    Ok((conn, pid))
}

async fn run(args: &Args, url: &str, candidate: Candidate, tx_size: usize) -> Result<Figures> {
    // transaction ids per second: the writers' and a margin for the reader and the cleanup
    let xids_per_sec = args.rate / tx_size.max(1) as u64 + 200;
    // a partition per 5 s of transactions (or per retention, when longer)
    let span = (xids_per_sec as f64 * args.retention.as_secs_f64().max(5.0)) as u64;
    set_up(url, candidate, args, span)?;
    let shared = Arc::new(Shared::default());
    let mut backends = Backends::default();
    let mut writer_conns = Vec::new();
    for _ in 0..args.writers {
        let (conn, pid) = connect(url).await?;
        backends.writers.push(pid);
        writer_conns.push(conn);
    }
    let with_reader = candidate != Candidate::Baseline;
    let held_conn = if with_reader {
        let (conn, pid) = connect(url).await?;
        backends.writers.push(pid);
        Some(conn)
    } else {
        None
    };
    let reader_conn = if with_reader {
        let (mut conn, pid) = connect(url).await?;
        backends.reader.push(pid);
        relay::prepare_session(&mut conn).await?;
        Some(conn)
    } else {
        None
    };
    let (mut maint_conn, maint_pid) = connect(url).await?;
    backends.maintenance.push(maint_pid);
    maint_conn.batch_execute("SET jit = off").await?;

    let load_before = load_average();
    let cpu_before = backends.cpu();
    let started = Instant::now();
    let stop_at = started + Duration::from_secs(args.seconds);

    let mut writers = Vec::new();
    let per_writer_tx_per_sec = args.rate as f64 / args.writers as f64 / tx_size as f64;
    for (w, conn) in writer_conns.into_iter().enumerate() {
        let shared = shared.clone();
        let aggregates = args.aggregates;
        writers.push(tokio::spawn(writer(
            conn,
            w,
            tx_size,
            aggregates,
            per_writer_tx_per_sec,
            stop_at,
            shared,
        )));
    }
    let held =
        held_conn.map(|conn| tokio::spawn(held_open(conn, args.rate, stop_at, shared.clone())));
    let reader = reader_conn.map(|conn| {
        let shared = shared.clone();
        let (batch, poll) = (args.batch, args.poll_interval);
        tokio::spawn(async move {
            match candidate {
                Candidate::Marked | Candidate::Delete => {
                    read_today(conn, candidate, batch, poll, shared).await
                }
                Candidate::HotMark => read_hot(conn, batch, poll, shared).await,
                Candidate::Snapshots => read_snapshots(conn, poll, shared).await,
                Candidate::Baseline => Ok(conn),
            }
        })
    });
    let maintenance = {
        let shared = shared.clone();
        let m = Maintenance {
            candidate,
            retention: args.retention,
            interval: args.cleanup_interval,
            batch: args.cleanup_batch,
            vacuum_every: args.vacuum_every,
            span,
        };
        tokio::spawn(async move { m.run(maint_conn, shared).await })
    };

    let mut kept = Vec::new();
    for w in writers {
        kept.push(w.await??);
    }
    let rate = shared.written() as f64 / args.seconds as f64;
    if let Some(h) = held {
        kept.push(h.await??);
    }
    shared.set_writing_done();
    if let Some(r) = reader {
        kept.push(r.await??);
    }
    shared.set_drained();
    let (maint_conn, leftover) = maintenance.await??;
    kept.push(maint_conn);
    let cpu_after = backends.cpu();
    let load_after = load_average();
    drop(kept);

    let events = shared.written();
    let consumed = shared.consumed();
    let per_event = |i: usize| (cpu_after[i] - cpu_before[i]) * 1e6 / events.max(1) as f64;
    // the sessions are closed: their statistics have reached the server
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (mut conn, _) = connect(url).await?;
    #[derive(QueryableByName)]
    struct Updates {
        #[diesel(sql_type = BigInt)]
        upd: i64,
        #[diesel(sql_type = BigInt)]
        hot: i64,
    }
    let stats: Updates = diesel::sql_query(
        "SELECT coalesce(sum(n_tup_upd), 0)::bigint AS upd, \
         coalesce(sum(n_tup_hot_upd), 0)::bigint AS hot FROM pg_stat_user_tables \
         WHERE relname LIKE 'outbox%'",
    )
    .get_result(&mut conn)
    .await?;
    let batches = shared.batches();
    Ok(Figures {
        candidate,
        tx_size,
        events,
        consumed,
        rate,
        cpu: [per_event(0), per_event(1), per_event(2)],
        batch_rows: if batches > 0 {
            consumed as f64 / batches as f64
        } else {
            0.0
        },
        updates: stats.upd,
        hot_updates: stats.hot,
        held: with_reader.then(|| shared.held_consumed()),
        leftover,
        load_before,
        load_after,
    })
}

/// One writer: transactions of `tx_size` events (one multi-row `INSERT`, the hand-written
/// insert of the write-path benchmark) at a fixed pace until `stop_at`.
async fn writer(
    mut conn: AsyncPgConnection,
    w: usize,
    tx_size: usize,
    aggregates: usize,
    tx_per_sec: f64,
    stop_at: Instant,
    shared: Arc<Shared>,
) -> Result<AsyncPgConnection> {
    use diesel::ExpressionMethods;
    use outbox_diesel::schema::outbox::dsl::*;
    let interval = Duration::from_secs_f64(1.0 / tx_per_sec);
    // writers start spread over one interval
    let mut next = tokio::time::Instant::now() + interval.mul_f64(w as f64 / 8.0);
    let mut n = 0usize;
    while Instant::now() < stop_at {
        tokio::time::sleep_until(next).await;
        next += interval;
        let rows: Vec<_> = (0..tx_size)
            .map(|_| {
                n += 1;
                let i = w * 10_000_000 + n;
                (
                    id.eq(uuid::Uuid::now_v7()),
                    aggregate_type.eq("order"),
                    aggregate_id.eq(format!("order-{}", i % aggregates)),
                    event_type.eq("order.placed"),
                    payload.eq(serde_json::json!({
                        "order_id": format!("order-{}", i % aggregates),
                        "customer": format!("customer-{i:08}"),
                        "note": "x".repeat(230),
                    })),
                )
            })
            .collect();
        diesel::insert_into(outbox)
            .values(&rows)
            .execute(&mut conn)
            .await?;
        shared.add_written(tx_size as u64);
    }
    Ok(conn)
}

/// A transaction that inserts a row, stays open while a second's worth of later rows
/// (`rate`) commit and are consumed, then commits before the writers stop.
async fn held_open(
    mut conn: AsyncPgConnection,
    rate: u64,
    stop_at: Instant,
    shared: Arc<Shared>,
) -> Result<AsyncPgConnection> {
    tokio::time::sleep(Duration::from_secs(1)).await;
    conn.batch_execute("BEGIN").await?;
    diesel::sql_query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'order', $1, 'order.placed', '{}')",
    )
    .bind::<Text, _>(HELD_AGGREGATE)
    .execute(&mut conn)
    .await?;
    let from = shared.consumed();
    let deadline = stop_at
        .checked_sub(Duration::from_secs(1))
        .unwrap_or(stop_at);
    while shared.consumed() < from + rate && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    conn.batch_execute("COMMIT").await?;
    shared.add_written(1);
    Ok(conn)
}

/// Counts a consumed batch; the publish is replaced by nothing.
fn consume(shared: &Shared, rows: &[OutboxRow]) {
    if rows.iter().any(|r| r.aggregate_id == HELD_AGGREGATE) {
        shared.set_held_consumed();
    }
    shared.add_consumed(rows.len() as u64);
}

/// Whether the reader has nothing left to do: writing is over and every row is consumed
/// (or it has waited long enough for the rest).
fn drained(shared: &Shared, since: &mut Option<Instant>) -> bool {
    if !shared.writing_done() {
        return false;
    }
    let start = *since.get_or_insert_with(Instant::now);
    shared.consumed() >= shared.written() || start.elapsed() > Duration::from_secs(120)
}

/// Candidates 1 and 3: the relay's own fetch (`fetch_ready`: the partial index on unpublished
/// rows, with the parked-row check), then its mark or its delete.
async fn read_today(
    mut conn: AsyncPgConnection,
    candidate: Candidate,
    batch: i64,
    poll: Duration,
    shared: Arc<Shared>,
) -> Result<AsyncPgConnection> {
    let table = OutboxTable::default();
    let mut since = None;
    let all = Partition::ALL;
    loop {
        let rows = relay::fetch_ready(
            &mut conn,
            &table,
            &[all.index as i32],
            all.count,
            &[],
            batch,
            None,
        )
        .await?;
        let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
        consume(&shared, &rows);
        if candidate == Candidate::Delete {
            relay::delete_acked(&mut conn, &table, &seqs).await?;
        } else {
            relay::mark_published(&mut conn, &table, &seqs).await?;
        }
        if (rows.len() as i64) < batch {
            if drained(&shared, &mut since) {
                return Ok(conn);
            }
            tokio::time::sleep(poll).await;
        }
    }
}

/// Candidate 2: a watermark `W` (the highest `seq` read) and the snapshot `S` it was set at.
/// Every row at or below `W` that was committed and visible at `S` has been read, so an unread
/// row at or below `W` belongs to a transaction in progress at `S` (in its `xip` list) or
/// given its id after `S` (at or above its `xmax`): the rescan window is those transactions'
/// rows only, found through the index on `txid`. The mark is an `UPDATE` of `published_at`,
/// which no index reads: HOT when the page has room.
async fn read_hot(
    mut conn: AsyncPgConnection,
    batch: i64,
    poll: Duration,
    shared: Arc<Shared>,
) -> Result<AsyncPgConnection> {
    #[derive(QueryableByName)]
    struct Cursor {
        #[diesel(sql_type = BigInt)]
        watermark: i64,
        #[diesel(sql_type = Text)]
        snap: String,
    }
    let c: Cursor =
        diesel::sql_query("SELECT watermark, snap::text AS snap FROM relay_cursor WHERE part = 0")
            .get_result(&mut conn)
            .await?;
    let (mut watermark, mut prev) = (c.watermark, Snapshot::parse(&c.snap)?);
    let fetch = [
        // the window: the rows of the transactions in progress at the previous snapshot, by
        // exact id, and of those given an id since it (below the current snapshot's `xmax`;
        // later ones fall in the next window); `seq + 0`, so that no plan scans the primary key
        // for every row at or below the watermark
        "SELECT seq, id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, \
         attempts FROM ( \
           (SELECT * FROM outbox WHERE (txid = ANY(",
        "::text[]::xid8[]) OR (txid >= ",
        "::xid8 AND txid < ",
        "::xid8)) AND seq + 0 <= ",
        " AND published_at IS NULL AND parked_at IS NULL) \
           UNION ALL \
           (SELECT * FROM outbox WHERE seq > ",
        " AND published_at IS NULL AND parked_at IS NULL ORDER BY seq LIMIT ",
        ")) o ORDER BY seq",
    ];
    let mark = [
        "WITH marked AS (UPDATE outbox SET published_at = now() \
           WHERE seq = ANY(",
        ") AND published_at IS NULL) \
         UPDATE relay_cursor SET watermark = ",
        ", snap = ",
        "::pg_snapshot WHERE part = 0",
    ];
    let mut since = None;
    let mut saved = Instant::now();
    loop {
        // taken before the fetch, whose own snapshot sees at least as much
        let cur = current_snapshot(&mut conn).await?;
        let xip: Vec<String> = prev.xip.iter().map(u64::to_string).collect();
        let (from, to) = (prev.xmax.to_string(), cur.xmax.to_string());
        let rows: Vec<OutboxRow> = Stmt::new(
            &fetch,
            vec![
                Bind::Texts(&xip),
                Bind::Text(&from),
                Bind::Text(&to),
                Bind::Big(watermark),
                Bind::Big(watermark),
                Bind::Big(batch),
            ],
        )
        .load(&mut conn)
        .await?;
        consume(&shared, &rows);
        let new_watermark = rows.iter().map(|r| r.seq).max().unwrap_or(0).max(watermark);
        let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
        if !rows.is_empty() || saved.elapsed() > Duration::from_secs(1) {
            // the mark and the cursor in one statement, one transaction
            Stmt::new(
                &mark,
                vec![
                    Bind::Bigs(&seqs),
                    Bind::Big(new_watermark),
                    Bind::Text(&cur.text),
                ],
            )
            .execute(&mut conn)
            .await?;
            saved = Instant::now();
        }
        watermark = new_watermark;
        prev = cur;
        if (rows.len() as i64) < batch {
            if drained(&shared, &mut since) {
                return Ok(conn);
            }
            tokio::time::sleep(poll).await;
        }
    }
}

/// Candidate 4, PgQ's batch (`pgq.batch_event_sql`): between the previous snapshot `prev` and
/// the current `cur`, the transactions that became visible are those at or above `prev`'s
/// `xmax` that `cur` sees and `prev` does not, plus those in `prev`'s in-progress list that
/// are no longer in progress in `cur`. The latter are searched by exact id, except those
/// within 100 of `prev.xmax`, which lower the range's start instead; so a long transaction
/// costs one id in the list, not a rescan of everything since it began.
async fn read_snapshots(
    mut conn: AsyncPgConnection,
    poll: Duration,
    shared: Arc<Shared>,
) -> Result<AsyncPgConnection> {
    let mut prev = Snapshot::parse(
        &text_value(
            &mut conn,
            "SELECT snap::text AS v FROM relay_consumer WHERE part = 0",
        )
        .await?,
    )?;
    const COLUMNS: &str = "SELECT seq, id, aggregate_type, aggregate_id, event_type, payload, \
                           headers, created_at, attempts FROM outbox";
    let batch_sql = [
        &format!("{COLUMNS} WHERE txid >= "),
        "::xid8 AND txid < ",
        "::xid8 AND pg_visible_in_snapshot(txid, ",
        "::pg_snapshot) AND NOT pg_visible_in_snapshot(txid, ",
        &format!("::pg_snapshot) UNION ALL {COLUMNS} WHERE txid = ANY("),
        "::text[]::xid8[]) ORDER BY seq",
    ];
    let progress = [
        "UPDATE relay_consumer SET snap = ",
        "::pg_snapshot, at = now() WHERE part = 0",
    ];
    let mut since = None;
    let mut saved = Instant::now();
    loop {
        let cur = current_snapshot(&mut conn).await?;
        let (start, listed) = batch_bounds(&prev, &cur);
        let listed: Vec<String> = listed.iter().map(u64::to_string).collect();
        let (start, end) = (start.to_string(), cur.xmax.to_string());
        let rows: Vec<OutboxRow> = Stmt::new(
            &batch_sql,
            vec![
                Bind::Text(&start),
                Bind::Text(&end),
                Bind::Text(&cur.text),
                Bind::Text(&prev.text),
                Bind::Texts(&listed),
            ],
        )
        .load(&mut conn)
        .await?;
        consume(&shared, &rows);
        if !rows.is_empty() || saved.elapsed() > Duration::from_secs(1) {
            Stmt::new(&progress, vec![Bind::Text(&cur.text)])
                .execute(&mut conn)
                .await?;
            saved = Instant::now();
        }
        prev = cur;
        // a batch takes every row there is: wait for more after each
        if rows.is_empty() && drained(&shared, &mut since) {
            return Ok(conn);
        }
        tokio::time::sleep(poll).await;
    }
}

/// The start of the batch's id range and the ids searched one by one, as
/// `pgq.batch_event_sql` computes them.
fn batch_bounds(prev: &Snapshot, cur: &Snapshot) -> (u64, Vec<u64>) {
    let mut finished: Vec<u64> = prev
        .xip
        .iter()
        .copied()
        .filter(|x| !cur.xip.contains(x))
        .collect();
    finished.sort_unstable_by(|a, b| b.cmp(a));
    let mut start = prev.xmax;
    let mut listed = Vec::new();
    for x in finished {
        if start.saturating_sub(100) <= x {
            start = x;
        } else {
            listed.push(x);
        }
    }
    (start, listed)
}

/// The cleanup of kept rows and the `VACUUM` of the table, in one session.
struct Maintenance {
    candidate: Candidate,
    retention: Duration,
    interval: Duration,
    batch: i64,
    vacuum_every: Duration,
    span: u64,
}

/// A partition of the snapshot candidate: the transaction ids `[lo, hi)`.
struct Part {
    name: String,
    hi: u64,
    /// when every transaction below `hi` had finished and been read
    done_since: Option<Instant>,
    truncated: bool,
}

impl Maintenance {
    async fn run(
        self,
        mut conn: AsyncPgConnection,
        shared: Arc<Shared>,
    ) -> Result<(AsyncPgConnection, i64)> {
        let mut last_vacuum = Instant::now();
        let mut watermarks: VecDeque<(Instant, i64)> = VecDeque::new();
        let mut cleaned_to = 0i64;
        let mut parts = self.partitions(&mut conn).await?;
        let mut drain_start: Option<Instant> = None;
        loop {
            let draining = shared.drained();
            match self.candidate {
                Candidate::Marked => loop {
                    let n = relay::delete_published(
                        &mut conn,
                        &OutboxTable::default(),
                        self.retention,
                        self.batch,
                    )
                    .await?;
                    if (n as i64) < self.batch {
                        break;
                    }
                },
                Candidate::HotMark => {
                    let w: BigValue =
                        diesel::sql_query("SELECT watermark AS v FROM relay_cursor WHERE part = 0")
                            .get_result(&mut conn)
                            .await?;
                    watermarks.push_back((Instant::now(), w.v));
                    // the watermark of a retention ago: rows at or below it were published
                    // before then, unless they committed late
                    let mut upto = None;
                    while let Some(&(at, w)) = watermarks.front() {
                        if at.elapsed() >= self.retention {
                            upto = Some(w);
                            watermarks.pop_front();
                        } else {
                            break;
                        }
                    }
                    if let Some(upto) = upto {
                        while cleaned_to < upto {
                            let to = (cleaned_to + self.batch).min(upto);
                            diesel::sql_query(
                                "DELETE FROM outbox WHERE seq > $1 AND seq <= $2 \
                                 AND published_at < now() - make_interval(secs => $3)",
                            )
                            .bind::<BigInt, _>(cleaned_to)
                            .bind::<BigInt, _>(to)
                            .bind::<diesel::sql_types::Double, _>(self.retention.as_secs_f64())
                            .execute(&mut conn)
                            .await?;
                            cleaned_to = to;
                        }
                    }
                }
                Candidate::Snapshots => self.rotate(&mut conn, &mut parts, draining).await?,
                Candidate::Baseline | Candidate::Delete => {}
            }
            if last_vacuum.elapsed() >= self.vacuum_every {
                conn.batch_execute("VACUUM outbox").await?;
                last_vacuum = Instant::now();
            }
            if draining {
                // every kept row is past its retention one retention (and a pass) after the
                // drain: the pass just made removed it
                let since = *drain_start.get_or_insert_with(Instant::now);
                let nothing_kept =
                    matches!(self.candidate, Candidate::Baseline | Candidate::Delete);
                if nothing_kept || since.elapsed() > self.retention + self.interval {
                    conn.batch_execute("VACUUM outbox").await?;
                    let left: BigValue = diesel::sql_query("SELECT count(*) AS v FROM outbox")
                        .get_result(&mut conn)
                        .await?;
                    return Ok((conn, left.v));
                }
            }
            tokio::time::sleep(self.interval).await;
        }
    }

    async fn partitions(&self, conn: &mut AsyncPgConnection) -> Result<VecDeque<Part>> {
        if self.candidate != Candidate::Snapshots {
            return Ok(VecDeque::new());
        }
        #[derive(QueryableByName)]
        struct Bound {
            #[diesel(sql_type = Text)]
            name: String,
            #[diesel(sql_type = Text)]
            bound: String,
        }
        let bounds: Vec<Bound> = diesel::sql_query(
            "SELECT c.relname::text AS name, pg_get_expr(c.relpartbound, c.oid) AS bound \
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = 'outbox'::regclass ORDER BY c.relname",
        )
        .load(conn)
        .await?;
        let mut parts = VecDeque::new();
        for b in bounds {
            // FOR VALUES FROM (…) TO ('123')
            let hi = b
                .bound
                .rsplit('\'')
                .nth(1)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| anyhow!("unexpected partition bound {}", b.bound))?;
            parts.push_back(Part {
                name: b.name,
                hi,
                done_since: None,
                truncated: false,
            });
        }
        Ok(parts)
    }

    /// PgQ's rotation with partitions by `txid` range: a partition whose every transaction
    /// finished and was read (its upper bound at or below the consumer's `xmin`) and has been
    /// so for the retention is truncated; one is kept ready beyond the next transaction id.
    /// The truncated partitions stay attached (empty) until the run ends: detaching them
    /// (`DETACH … CONCURRENTLY`, then `DROP`) would be a rarer task of its own.
    async fn rotate(
        &self,
        conn: &mut AsyncPgConnection,
        parts: &mut VecDeque<Part>,
        draining: bool,
    ) -> Result<()> {
        let consumer_xmin: u64 = text_value(
            conn,
            "SELECT pg_snapshot_xmin(snap)::text AS v FROM relay_consumer WHERE part = 0",
        )
        .await?
        .parse()?;
        let next_xid: u64 = text_value(
            conn,
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text AS v",
        )
        .await?
        .parse()?;
        for p in parts.iter_mut() {
            // at the end of the run no writer is left and the reader has read every row
            let done = p.hi <= consumer_xmin || draining;
            if done && p.done_since.is_none() {
                p.done_since = Some(Instant::now());
            }
            if !p.truncated && p.done_since.is_some_and(|t| t.elapsed() >= self.retention) {
                conn.batch_execute(&format!("TRUNCATE {}", p.name)).await?;
                p.truncated = true;
            }
        }
        let top = parts.iter().map(|p| p.hi).max().unwrap_or(next_xid);
        if !draining && top < next_xid + self.span {
            // made beside the table, then attached: `ATTACH PARTITION` takes a lock that
            // writers do not wait for (`CREATE TABLE … PARTITION OF`, `DETACH` and `DROP` of a
            // partition would lock out every writer, and wait for every open transaction)
            let (lo, hi) = (top, top + self.span);
            let name = format!("outbox_p{}", parts.len());
            conn.batch_execute(&format!(
                "CREATE TABLE {name} (LIKE outbox INCLUDING DEFAULTS INCLUDING GENERATED \
                 INCLUDING CONSTRAINTS) WITH (autovacuum_enabled = false); \
                 ALTER TABLE outbox ATTACH PARTITION {name} FOR VALUES FROM ('{lo}') TO ('{hi}')"
            ))
            .await?;
            parts.push_back(Part {
                name,
                hi,
                done_since: None,
                truncated: false,
            });
        }
        Ok(())
    }
}
