//! The fault suite: the outbox's promise under kills, broker and database restarts, pauses,
//! and bad input, with real processes.
//!
//! The application is the writer example (`examples/writer.rs`), the relays are `outbox-relay`
//! processes, and after each run the checker (`support::checker`) reads the whole stream back
//! and compares it with the database: missing, orphaned, duplicated and reordered events,
//! half-committed transactions, rows marked (or, with `--delete-published`, deleted) without
//! being in the stream.
//!
//! The default (short) versions run in CI; the long ones (`cargo test --test faults --
//! --ignored`) run the same scenarios with 200,000 events and 50 faults. Build the binaries
//! first: `cargo build --workspace --bins --examples`. `OUTBOX_FAULT_SEED` replays the random
//! fault timings of a run (each test prints its seed); a failing test keeps its processes'
//! logs and prints where they are (`OUTBOX_FAULT_KEEP_LOGS=1` keeps them always).
//!
//! The tests of this file run one at a time (`SERIAL`): they measure handover times on a small
//! machine, and two fault runs side by side would measure each other.

mod support;

use std::fs::File;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use diesel::prelude::*;
use futures_util::StreamExt;
use outbox_diesel::{InboxExt, OutboxEvent, OutboxExt};
use serde::Serialize;
use support::checker::{self, DbEvent, Report, StreamMessage};
use support::proxy::NatsProxy;
use support::servers::{NatsCluster, NatsServer, PgCluster};
use support::slot::Slot;
use support::{Proc, TestDb, TestStream, example_bin, relay_bin, relay_command, wait_until};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ---------------------------------------------------------------------------------------------
// harness

/// The relay modes that claim something: ordered ones must also keep per-aggregate order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `--partitions 4`, two relays sharing them.
    Ordered,
    /// The same, deleting the acked rows instead of marking them (`--delete-published`).
    OrderedDeleting,
    /// Competing workers, two per relay.
    Unordered,
    /// One reader of a replication slot and one standby.
    LogTailing,
}

impl Mode {
    /// [`Mode::relay_args`], the partition index made first when the mode has it.
    fn table_args(self, db: &TestDb) -> Vec<String> {
        if self.indexed() {
            outbox_diesel::create_partition_index(
                &mut db.conn(),
                &outbox_diesel::OutboxTable::DEFAULT,
                4,
            )
            .expect("the partition index");
        }
        self.relay_args()
    }

    fn relay_args(self) -> Vec<String> {
        let args: &[&str] = match self {
            Mode::Ordered => &["--partitions", "4", "--batch-size", "50"],
            Mode::OrderedDeleting => &[
                "--partitions",
                "4",
                "--batch-size",
                "50",
                "--delete-published",
            ],
            Mode::Unordered => &[
                "--mode",
                "unordered",
                "--workers",
                "2",
                "--batch-size",
                "50",
            ],
            Mode::LogTailing => &["--mode", "log-tailing", "--batch-size", "50"],
        };
        args.iter().map(|s| s.to_string()).collect()
    }

    fn assert(self, report: &Report) {
        match self {
            Mode::Ordered | Mode::OrderedDeleting => report.assert_exact_and_ordered(),
            Mode::Unordered => report.assert_exact(),
            Mode::LogTailing => report.assert_captured_in_order(),
        }
    }

    /// The relays' arguments and, for log tailing, the slot they read: made now, before the
    /// writer starts, so that it captures every commit (declare it before the relays, so that
    /// it is dropped after them and before the database).
    fn setup(self, db: &TestDb) -> (Vec<String>, Option<Slot>) {
        let mut args = self.table_args(db);
        let slot = (self == Mode::LogTailing).then(|| Slot::create(db));
        if let Some(slot) = &slot {
            args.extend(["--slot".to_owned(), slot.name.clone()]);
        }
        (args, slot)
    }

    /// Whether its table has the partition index of its count (`outbox-relay index`): the
    /// marking relays read each partition they own by it, the deleting ones walk every
    /// partition's rows by `seq`. `OUTBOX_FAULT_PARTITION_INDEX=all` gives it to both,
    /// `none` to neither.
    fn indexed(self) -> bool {
        match std::env::var("OUTBOX_FAULT_PARTITION_INDEX").as_deref() {
            Err(_) => self == Mode::Ordered,
            Ok("all") => self.partitioned(),
            Ok("none") => false,
            Ok(v) => panic!("OUTBOX_FAULT_PARTITION_INDEX={v:?}: give all or none"),
        }
    }

    /// Whether its relays share partitions.
    fn partitioned(self) -> bool {
        matches!(self, Mode::Ordered | Mode::OrderedDeleting)
    }
}

/// A test database whose outbox keeps a record of every row a relay deletes: the checker and
/// the scenarios read [`checker::RECORD_VIEW`], the outbox rows and the deleted ones, so that
/// a deleting relay is held to the same promise as a marking one.
///
/// With `OUTBOX_FAULT_ROTATED=<rows>` set, the outbox is made a ring first
/// (`partition_table`: four partitions, blocks of that many rows, at least 1,000): every scenario
/// then runs on a rotated table.
fn fault_db(db: TestDb) -> TestDb {
    if let Ok(v) = std::env::var("OUTBOX_FAULT_ROTATED") {
        let block: i64 = v.parse().unwrap_or_else(|_| {
            panic!("OUTBOX_FAULT_ROTATED={v:?}: give the block size in rows, e.g. 1000")
        });
        outbox_diesel::partition_table(
            &mut db.conn(),
            &outbox_diesel::OutboxTable::DEFAULT,
            outbox_diesel::Rotation::default().block_rows(block),
        )
        .expect("the outbox made a ring of partitions");
    }
    checker::keep_deleted_rows(&db);
    db
}

/// How big a run is: the CI version or the long one.
#[derive(Debug, Clone, Copy)]
struct Size {
    events: u64,
    /// Writer transactions per second (0 = unlimited).
    rate: u64,
    faults: usize,
}

const SHORT: Size = Size {
    events: 3_000,
    rate: 1_000,
    faults: 8,
};
const LONG: Size = Size {
    events: 200_000,
    rate: 1_500,
    faults: 50,
};

impl Size {
    /// How long the writer should take at its rate.
    fn writing_time(self) -> Duration {
        Duration::from_secs_f64(self.events as f64 / self.rate.max(1) as f64)
    }

    /// A generous bound for anything that waits on the whole run: four times the writing
    /// time, or 100 events a second on a loaded machine.
    fn timeout(self) -> Duration {
        Duration::from_secs(60)
            + (self.writing_time() * 4).max(Duration::from_secs(self.events / 100))
    }
}

/// Waits until the run reaches fault `k` of `size.faults` (spread evenly over the events the
/// writer commits, whatever its speed), then a random moment more: the faults land anywhere
/// in the relays' loop (claiming, publishing, between ack and mark, starting).
async fn next_fault(db: &TestDb, size: Size, k: usize, rng: &mut Rng) {
    let target = size.events as i64 * k as i64 / (size.faults as i64 + 1);
    wait_until(
        size.timeout(),
        &format!("{target} rows written"),
        || async { db.scalar("SELECT COALESCE(max(seq), 0) FROM outbox_record") >= target },
    )
    .await;
    // the fault's timing, random on purpose: not a synchronisation
    tokio::time::sleep(rng.between(Duration::ZERO, Duration::from_millis(300))).await;
}

/// A small xorshift generator: the fault timings, reproducible through `OUTBOX_FAULT_SEED`.
struct Rng(u64);

impl Rng {
    fn new(test: &str) -> Self {
        let seed = std::env::var("OUTBOX_FAULT_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            })
            | 1;
        eprintln!("{test}: OUTBOX_FAULT_SEED={seed}");
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// A random duration between `lo` and `hi`.
    fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = hi.saturating_sub(lo).as_micros() as u64;
        lo + Duration::from_micros(self.below(span + 1))
    }
}

/// A directory for the processes' logs: removed after a passing test, kept (and printed) after
/// a failing one.
struct Logs {
    dir: PathBuf,
}

impl Logs {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "outbox-faults-{test}-{}",
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&dir).expect("a log directory");
        Logs { dir }
    }

    fn file(&self, name: &str) -> Stdio {
        File::options()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{name}.log")))
            .map(Stdio::from)
            .unwrap_or_else(|_| Stdio::null())
    }
}

impl Drop for Logs {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("OUTBOX_FAULT_KEEP_LOGS").is_some() {
            eprintln!("the processes' logs are in {}", self.dir.display());
            if std::thread::panicking() {
                // CI keeps only the test's output: the logs' last lines go there
                for name in ["relays", "writer"] {
                    let text = std::fs::read_to_string(self.dir.join(format!("{name}.log")))
                        .unwrap_or_default();
                    let lines: Vec<&str> = text.lines().collect();
                    let tail = &lines[lines.len().saturating_sub(150)..];
                    eprintln!("--- the last {} lines of {name}.log", tail.len());
                    for line in tail {
                        eprintln!("{line}");
                    }
                }
            }
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Relay processes on one database and stream, restarted under the same name.
struct Relays<'a> {
    db: &'a TestDb,
    stream: &'a TestStream,
    logs: &'a Logs,
    args: Vec<String>,
    nats_url: Option<String>,
    procs: Vec<Proc>,
    started: usize,
}

impl<'a> Relays<'a> {
    fn start(
        db: &'a TestDb,
        stream: &'a TestStream,
        logs: &'a Logs,
        args: Vec<String>,
        n: usize,
    ) -> Self {
        Self::start_via(db, stream, logs, args, n, None)
    }

    /// [`Relays::start`] with the relays reaching NATS at `nats_url` (e.g. a proxy) instead
    /// of the stream's server.
    fn start_via(
        db: &'a TestDb,
        stream: &'a TestStream,
        logs: &'a Logs,
        args: Vec<String>,
        n: usize,
        nats_url: Option<String>,
    ) -> Self {
        let mut relays = Relays {
            db,
            stream,
            logs,
            args,
            nats_url,
            procs: Vec::new(),
            started: 0,
        };
        for _ in 0..n {
            let p = relays.spawn();
            relays.procs.push(p);
        }
        relays
    }

    fn spawn(&mut self) -> Proc {
        self.started += 1;
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let mut cmd = relay_command(self.db, self.stream, &args);
        // the checker compares every row with the stream: keep the published rows
        if let Some(url) = &self.nats_url {
            cmd.env("NATS_URL", url);
        }
        // what the relays did, for a failure's report (see `Logs`)
        let level =
            std::env::var("OUTBOX_TEST_LOG").unwrap_or_else(|_| "info,async_nats=warn".into());
        cmd.arg("--no-cleanup")
            .env("NO_COLOR", "1")
            .env("RUST_LOG", level)
            .stdout(Stdio::null())
            .stderr(self.logs.file("relays"));
        Proc::spawn(&format!("relay-{}", self.started), &mut cmd)
    }

    /// SIGKILLs relay `i` and starts a new one in its place.
    fn kill_and_restart(&mut self, i: usize) {
        self.procs[i].kill();
        let p = self.spawn();
        self.procs[i] = p;
    }
}

/// The writer example on `db`, its session named `name`, its stdout piped.
fn writer(db: &TestDb, logs: &Logs, name: &str, args: &[&str]) -> Proc {
    let mut cmd = Command::new(example_bin("writer"));
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("DATABASE_URL", &db.url)
        .args(["--name", name])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(logs.file(name));
    Proc::spawn(name, &mut cmd)
}

/// A writer of `size.events` transactions over 200 accounts, at `size.rate`. On the shared
/// server, which no test crashes, it commits without waiting for the WAL flush (the machine's
/// disk would otherwise set the pace); on a private cluster that a test crashes, durably.
fn steady_writer(db: &TestDb, logs: &Logs, size: Size) -> Proc {
    let (count, rate) = (size.events.to_string(), size.rate.to_string());
    let mut args = vec![
        "--count",
        &count,
        "--rate",
        &rate,
        "--threads",
        "2",
        "--aggregates",
        "200",
    ];
    if db.url.starts_with(&support::pg_base()) {
        args.push("--async-commit");
    }
    writer(db, logs, "writer", &args)
}

/// Waits for `p` to exit; returns its exit code and its stdout.
async fn exit_of(p: &mut Proc, timeout: Duration) -> (i32, String) {
    let start = Instant::now();
    let code = loop {
        if let Ok(Some(status)) = p.child.try_wait() {
            break status.code().unwrap_or(-1);
        }
        assert!(
            start.elapsed() < timeout,
            "{} did not exit within {timeout:?}",
            p.name
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut out = String::new();
    if let Some(mut stdout) = p.child.stdout.take() {
        let _ = stdout.read_to_string(&mut out);
    }
    (code, out)
}

/// A writer's final `committed N rolled_back N failed N` line, as numbers.
fn writer_counts(out: &str) -> (u64, u64, u64) {
    let n = |key: &str| {
        out.split_whitespace()
            .skip_while(|w| *w != key)
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no `{key}` in the writer's output {out:?}"))
    };
    (n("committed"), n("rolled_back"), n("failed"))
}

/// Waits for a writer to finish cleanly; returns what it committed.
async fn finished(p: &mut Proc, size: Size) -> u64 {
    let (code, out) = exit_of(p, size.timeout()).await;
    assert_eq!(code, 0, "{} failed: {out}", p.name);
    writer_counts(&out).0
}

/// Rows marked published or deleted after their ack.
fn published(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) FROM outbox_record WHERE published_at IS NOT NULL")
}

/// Waits until every committed row is marked published (or deleted); with log tailing, until
/// the slot is confirmed past every commit.
async fn drained(db: &TestDb, slot: Option<&Slot>, timeout: Duration) {
    if let Some(slot) = slot {
        return slot.confirmed_past_now(db, timeout).await;
    }
    wait_until(timeout, "every outbox row published", || async {
        db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL") == 0
    })
    .await;
}

/// Waits until at least `n` rows are published: marked or deleted, or with log tailing
/// (which marks nothing) in the stream.
async fn published_at_least(
    db: &TestDb,
    stream: &TestStream,
    slot: Option<&Slot>,
    n: i64,
    timeout: Duration,
) {
    wait_until(timeout, &format!("{n} rows published"), || async {
        if slot.is_some() {
            stream.count().await as i64 >= n
        } else {
            published(db) >= n
        }
    })
    .await;
}

fn distinct_owners(db: &TestDb) -> (usize, usize) {
    let o = support::partition_owners(db);
    let pids: std::collections::HashSet<i32> = o.iter().map(|(_, pid)| *pid).collect();
    (o.len(), pids.len())
}

/// Reads the run back, prints the checker's line and returns it.
async fn report(test: &str, db: &TestDb, stream: &TestStream) -> Report {
    let r = checker::check(db, stream).await;
    eprintln!("{test}: {r}");
    if !r.missing_seqs.is_empty() {
        // what the failure's reader needs: the missing rows' transactions and the slot's record
        let seqs = format!("{:?}", r.missing_seqs)
            .trim_matches(['[', ']'])
            .to_owned();
        for sql in [
            format!(
                "SELECT seq || ' txid ' || txid || ' created ' || created_at || \
                 ' parked ' || COALESCE(parked_at::text, '-') FROM outbox WHERE seq IN ({seqs})"
            ),
            "SELECT slot_name || ' ' || state || ' confirmed ' || COALESCE(confirmed_lsn::text, '-') \
             || ' updated ' || updated_at FROM outbox_relay_slots"
                .to_owned(),
            "SELECT slot_name || ' confirmed ' || COALESCE(confirmed_flush_lsn::text, '-') || \
             ' restart ' || COALESCE(restart_lsn::text, '-') FROM pg_replication_slots"
                .to_owned(),
        ] {
            for line in db.strings(&sql) {
                eprintln!("{test}: {line}");
            }
        }
    }
    r
}

// ---------------------------------------------------------------------------------------------
// 1. relays SIGKILLed at random points

/// Relays SIGKILLed at random moments (while starting, claiming, publishing, between ack and
/// mark) and restarted at once, while a writer commits.
async fn relay_kills(test: &str, mode: Mode, size: Size) {
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let mut rng = Rng::new(test);
    let (args, slot) = mode.setup(&db);
    let mut relays = Relays::start(&db, &stream, &logs, args, 2);
    let mut w = steady_writer(&db, &logs, size);
    for k in 1..=size.faults {
        next_fault(&db, size, k, &mut rng).await;
        let i = rng.below(2) as usize;
        relays.kill_and_restart(i);
    }
    let committed = finished(&mut w, size).await;
    assert_eq!(committed, size.events);
    drained(&db, slot.as_ref(), size.timeout()).await;
    drop(relays);
    let r = report(test, &db, &stream).await;
    assert_eq!(r.committed as u64, size.events, "{r}");
    mode.assert(&r);
}

/// The tests of one scenario, one per mode and size: each `test("log name", Mode)` calls
/// `scenario("log name", Mode::…, args…)`, the log name naming its log directory and seeding
/// its faults.
macro_rules! per_mode {
    ($scenario:ident $args:tt: $($(#[$attr:meta])* $name:ident($log:literal, $mode:ident),)+) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            $(#[$attr])*
            async fn $name() {
                per_mode!(@call $scenario $log $mode $args);
            }
        )+
    };
    (@call $scenario:ident $log:literal $mode:ident ($($arg:expr),*)) => {
        $scenario($log, Mode::$mode $(, $arg)*).await
    };
}

per_mode! {
    relay_kills(SHORT):
    relay_killed_at_random_points_loses_and_duplicates_nothing_ordered("relay_kills_ordered", Ordered),
    relay_killed_at_random_points_loses_and_duplicates_nothing_unordered("relay_kills_unordered", Unordered),
    relay_killed_at_random_points_loses_and_duplicates_nothing_deleting("relay_kills_deleting", OrderedDeleting),
    relay_killed_at_random_points_loses_and_duplicates_nothing_log_tailing("relay_kills_log_tailing", LogTailing),
}

per_mode! {
    relay_kills(LONG):
    #[ignore = "long: 200,000 events, 50 kills"]
    long_relay_killed_50_times_loses_and_duplicates_nothing_ordered("long_relay_kills_ordered", Ordered),
    #[ignore = "long: 200,000 events, 50 kills"]
    long_relay_killed_50_times_loses_and_duplicates_nothing_unordered("long_relay_kills_unordered", Unordered),
    #[ignore = "long: 200,000 events, 50 kills"]
    long_relay_killed_50_times_loses_and_duplicates_nothing_deleting("long_relay_kills_deleting", OrderedDeleting),
    #[ignore = "long: 200,000 events, 50 kills"]
    long_relay_killed_50_times_loses_and_duplicates_nothing_log_tailing("long_relay_kills_log_tailing", LogTailing),
}

// ---------------------------------------------------------------------------------------------
// 2. writers SIGKILLed between their business write and their commit; failing writers

/// Sessions of `name` that wrote (hold an xid) and wait before their commit.
fn idle_in_transaction(db: &TestDb, name: &str) -> i64 {
    db.scalar(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND application_name = '{name}' AND state = 'idle in transaction' \
         AND backend_xid IS NOT NULL"
    ))
}

async fn writer_kills(test: &str, mode: Mode, size: Size) {
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let mut rng = Rng::new(test);
    let (args, slot) = mode.setup(&db);
    let _relays = Relays::start(&db, &stream, &logs, args, 2);
    let mut steady = steady_writer(&db, &logs, size);
    let mut killed_in_flight = 0;
    for k in 1..=size.faults {
        next_fault(&db, size, k, &mut rng).await;
        let (name, seed) = (format!("paused-writer-{k}"), (k + 1).to_string());
        let mut w = writer(
            &db,
            &logs,
            &name,
            &["--count", "1000", "--pause-ms", "200", "--seed", &seed],
        );
        // let it commit a few transactions first, sometimes
        tokio::time::sleep(rng.between(Duration::ZERO, Duration::from_millis(500))).await;
        wait_until(
            Duration::from_secs(20),
            "the writer between its business write and its commit",
            || async { idle_in_transaction(&db, &name) == 1 },
        )
        .await;
        w.kill();
        killed_in_flight += 1;
    }
    let committed = finished(&mut steady, size).await;
    assert_eq!(committed, size.events);

    // every third transaction breaks a CHECK after recording its event, and rolls back
    let doomed_count = (size.events / 10).max(300);
    let mut doomed = writer(
        &db,
        &logs,
        "failing-writer",
        &[
            "--count",
            &doomed_count.to_string(),
            "--fail-every",
            "3",
            "--threads",
            "2",
            "--async-commit",
        ],
    );
    let (code, out) = exit_of(&mut doomed, size.timeout()).await;
    assert_eq!(code, 0, "{out}");
    let (_, rolled_back, failed) = writer_counts(&out);
    assert!(
        rolled_back >= doomed_count / 3,
        "every third transaction rolls back: {out}"
    );
    assert_eq!(failed, 0, "{out}");

    drained(&db, slot.as_ref(), size.timeout()).await;
    let r = report(test, &db, &stream).await;
    eprintln!(
        "{test}: {killed_in_flight} writers killed between write and commit, {rolled_back} transactions rolled back after recording"
    );
    mode.assert(&r);
}

per_mode! {
    writer_kills(SHORT):
    writer_killed_before_commit_or_rolled_back_publishes_nothing_ordered("writer_kills_ordered", Ordered),
    writer_killed_before_commit_or_rolled_back_publishes_nothing_deleting("writer_kills_deleting", OrderedDeleting),
    writer_killed_before_commit_or_rolled_back_publishes_nothing_log_tailing("writer_kills_log_tailing", LogTailing),
    writer_killed_before_commit_or_rolled_back_publishes_nothing_unordered("writer_kills_unordered", Unordered),
}

per_mode! {
    writer_kills(LONG):
    #[ignore = "long: 200,000 events, 50 writer kills"]
    long_writer_killed_50_times_before_commit_publishes_nothing_ordered("long_writer_kills_ordered", Ordered),
    #[ignore = "long: 200,000 events, 50 writer kills"]
    long_writer_killed_50_times_before_commit_publishes_nothing_unordered("long_writer_kills_unordered", Unordered),
}

// ---------------------------------------------------------------------------------------------
// 3. the NATS server down: started after the relays, restarted mid-run

async fn nats_outages(test: &str, mode: Mode, size: Size, restarts: usize) {
    let _serial = SERIAL.lock().await;
    // a private server with a file store, not running yet: the relays start first
    let mut nats = NatsServer::start();
    nats.stop();
    let (db, stream, logs) = (
        fault_db(TestDb::new()),
        TestStream::on(&nats.url()),
        Logs::new(test),
    );
    let (args, slot) = mode.setup(&db);
    let _relays = Relays::start(&db, &stream, &logs, args, 2);
    let mut w = steady_writer(&db, &logs, size);
    wait_until(
        Duration::from_secs(15),
        "rows committed while NATS is down",
        || async { db.scalar("SELECT count(*) FROM outbox_record") >= 200 },
    )
    .await;
    // (log tailing marks nothing; what it must not do, confirm the slot without an ack, the
    // checker sees as events missing from the stream)
    assert_eq!(published(&db), 0, "nothing is marked while NATS is down");
    nats.restart();

    let step = size.events as i64 / (restarts as i64 + 2);
    for r in 1..=restarts {
        published_at_least(&db, &stream, slot.as_ref(), step * r as i64, size.timeout()).await;
        nats.stop(); // SIGKILL
        let before = db.scalar("SELECT count(*) FROM outbox_record");
        wait_until(
            Duration::from_secs(15),
            "rows committed while NATS is down",
            || async { db.scalar("SELECT count(*) FROM outbox_record") >= before + 200 },
        )
        .await;
        nats.restart();
    }
    let committed = finished(&mut w, size).await;
    assert_eq!(committed, size.events);
    drained(&db, slot.as_ref(), size.timeout()).await;
    let r = report(test, &db, &stream).await;
    mode.assert(&r);
}

per_mode! {
    nats_outages(SHORT, 1):
    nats_started_late_and_restarted_mid_run_loses_nothing_ordered("nats_outages_ordered", Ordered),
    nats_started_late_and_restarted_mid_run_loses_nothing_unordered("nats_outages_unordered", Unordered),
    nats_started_late_and_restarted_mid_run_loses_nothing_deleting("nats_outages_deleting", OrderedDeleting),
    nats_started_late_and_restarted_mid_run_loses_nothing_log_tailing("nats_outages_log_tailing", LogTailing),
}

per_mode! {
    nats_outages(LONG, 10):
    #[ignore = "long: 200,000 events, 10 NATS restarts"]
    long_nats_restarted_10_times_loses_nothing_ordered("long_nats_outages_ordered", Ordered),
    #[ignore = "long: 200,000 events, 10 NATS restarts"]
    long_nats_restarted_10_times_loses_nothing_unordered("long_nats_outages_unordered", Unordered),
}

// ---------------------------------------------------------------------------------------------
// 4. PostgreSQL: the relays' sessions terminated; a private cluster restarted

async fn sessions_terminated(test: &str, mode: Mode, size: Size) {
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let mut rng = Rng::new(test);
    let (args, slot) = mode.setup(&db);
    let _relays = Relays::start(&db, &stream, &logs, args, 2);
    let mut w = steady_writer(&db, &logs, size);
    let mut terminated = 0;
    for k in 1..=size.faults {
        next_fault(&db, size, k, &mut rng).await;
        terminated += db.scalar(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = 'outbox-relay'",
        );
    }
    assert!(
        terminated >= size.faults as i64,
        "terminated {terminated} sessions"
    );
    let committed = finished(&mut w, size).await;
    assert_eq!(committed, size.events);
    drained(&db, slot.as_ref(), size.timeout()).await;
    let r = report(test, &db, &stream).await;
    eprintln!("{test}: {terminated} relay sessions terminated");
    mode.assert(&r);
}

per_mode! {
    sessions_terminated(SHORT):
    relay_sessions_terminated_lose_and_duplicate_nothing_ordered("sessions_terminated_ordered", Ordered),
    relay_sessions_terminated_lose_and_duplicate_nothing_unordered("sessions_terminated_unordered", Unordered),
    relay_sessions_terminated_lose_and_duplicate_nothing_deleting("sessions_terminated_deleting", OrderedDeleting),
    /// With log tailing the terminated sessions include the reader's replication connection.
    relay_sessions_terminated_lose_and_duplicate_nothing_log_tailing("sessions_terminated_log_tailing", LogTailing),
}

per_mode! {
    sessions_terminated(LONG):
    #[ignore = "long: 200,000 events, 50 terminations"]
    long_relay_sessions_terminated_50_times_lose_nothing_ordered("long_sessions_terminated_ordered", Ordered),
    #[ignore = "long: 200,000 events, 50 terminations"]
    long_relay_sessions_terminated_50_times_lose_nothing_unordered("long_sessions_terminated_unordered", Unordered),
}

async fn postgres_restarts(test: &str, mode: Mode, size: Size, restarts: usize) {
    let _serial = SERIAL.lock().await;
    let mut cluster = PgCluster::start();
    let (db, stream, logs) = (
        fault_db(TestDb::on(&cluster.base_url())),
        TestStream::new(),
        Logs::new(test),
    );
    let (args, slot) = mode.setup(&db);
    let _relays = Relays::start(&db, &stream, &logs, args, 2);
    let mut w = steady_writer(&db, &logs, size);
    let step = size.events as i64 / (restarts as i64 + 2);
    for r in 1..=restarts {
        published_at_least(&db, &stream, slot.as_ref(), step * r as i64, size.timeout()).await;
        cluster.restart(); // an immediate stop (a crash) and a start with recovery
    }
    let committed = finished(&mut w, size).await;
    assert!(committed >= size.events, "{committed}");
    drained(&db, slot.as_ref(), size.timeout()).await;
    let r = report(test, &db, &stream).await;
    mode.assert(&r);
}

per_mode! {
    postgres_restarts(SHORT, 1):
    postgres_restarted_mid_run_loses_and_duplicates_nothing_ordered("postgres_restarts_ordered", Ordered),
    postgres_restarted_mid_run_loses_and_duplicates_nothing_unordered("postgres_restarts_unordered", Unordered),
    postgres_restarted_mid_run_loses_and_duplicates_nothing_deleting("postgres_restarts_deleting", OrderedDeleting),
    postgres_restarted_mid_run_loses_and_duplicates_nothing_log_tailing("postgres_restarts_log_tailing", LogTailing),
}

per_mode! {
    postgres_restarts(LONG, 10):
    #[ignore = "long: 200,000 events, 10 PostgreSQL restarts"]
    long_postgres_restarted_10_times_loses_nothing_ordered("long_postgres_restarts_ordered", Ordered),
    #[ignore = "long: 200,000 events, 10 PostgreSQL restarts"]
    long_postgres_restarted_10_times_loses_nothing_unordered("long_postgres_restarts_unordered", Unordered),
}

// ---------------------------------------------------------------------------------------------
// 5. a relay paused with SIGSTOP

/// The lease the pause tests run with, and the bound they hold the relays to: the documented
/// "within `--lease` plus a second" (the session timeout, then the survivor's next balance),
/// plus the time to publish what waited, with two seconds to spare for a loaded machine.
const LEASE: Duration = Duration::from_secs(3);
const HANDOVER_BOUND: Duration = Duration::from_secs(6);

async fn paused_relay(test: &str, mode: Mode, size: Size, pauses: usize) {
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let mut rng = Rng::new(test);
    let mut args = mode.table_args(&db);
    args.extend(["--lease".to_string(), format!("{}s", LEASE.as_secs())]);
    let relays = Relays::start(&db, &stream, &logs, args, 2);
    let mut w = steady_writer(&db, &logs, size);
    let mut handovers = Vec::new();
    let size = Size {
        faults: pauses,
        ..size
    };
    for k in 1..=pauses {
        if mode.partitioned() {
            wait_until(
                Duration::from_secs(30),
                "two relays sharing the four partitions",
                || async { distinct_owners(&db) == (4, 2) },
            )
            .await;
        }
        next_fault(&db, size, k, &mut rng).await;
        let i = rng.below(2) as usize;
        // the check below reads outbox_audit every 50 ms: with the statistics of a young
        // progress table the planner reads every progress row for each outbox row (1.8 s a
        // check, so the handover measured moved in steps of seconds); fresh ones take 20 ms
        db.execute("ANALYZE outbox_progress", "analyze the progress table");
        // rows committed before the pause: the other relay must publish them while it lasts
        let last = db.scalar("SELECT COALESCE(max(seq), 0) FROM outbox_record");
        let stopped = Instant::now();
        relays.procs[i].signal("STOP");
        wait_until(
            HANDOVER_BOUND * 2,
            "the paused relay's work taken over",
            || async {
                let left = db.scalar(&format!(
                    "SELECT count(*) FROM outbox_audit WHERE seq <= {last} AND published_at IS NULL"
                ));
                left == 0 && (!mode.partitioned() || distinct_owners(&db) == (4, 1))
            },
        )
        .await;
        let handover = stopped.elapsed();
        handovers.push(handover);
        assert!(
            handover <= HANDOVER_BOUND,
            "the paused relay's work passed over after {handover:?}, beyond {HANDOVER_BOUND:?}"
        );
        // stay paused a little longer than the lease, then resume
        tokio::time::sleep((LEASE + Duration::from_millis(500)).saturating_sub(stopped.elapsed()))
            .await;
        relays.procs[i].signal("CONT");
        if mode.partitioned() {
            wait_until(
                Duration::from_secs(30),
                "the resumed relay back in the balance",
                || async { distinct_owners(&db) == (4, 2) },
            )
            .await;
        }
    }
    let committed = finished(&mut w, size).await;
    assert_eq!(committed, size.events);
    drained(&db, None, size.timeout()).await;
    let r = report(test, &db, &stream).await;
    eprintln!("{test}: handovers after {handovers:?} (lease {LEASE:?})");
    mode.assert(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_relay_hands_over_within_the_lease_and_resumes_without_duplicates_ordered() {
    let size = Size {
        events: 8_000,
        ..SHORT
    };
    paused_relay("paused_relay_ordered", Mode::Ordered, size, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_relay_hands_over_within_the_lease_and_resumes_without_duplicates_unordered() {
    let size = Size {
        events: 8_000,
        ..SHORT
    };
    paused_relay("paused_relay_unordered", Mode::Unordered, size, 1).await;
}

per_mode! {
    paused_relay(LONG, 10):
    #[ignore = "long: 200,000 events, 10 pauses"]
    long_paused_relay_hands_over_10_times_without_duplicates_ordered("long_paused_relay_ordered", Ordered),
    #[ignore = "long: 200,000 events, 10 pauses"]
    long_paused_relay_hands_over_10_times_without_duplicates_unordered("long_paused_relay_unordered", Unordered),
}

// ---------------------------------------------------------------------------------------------
// 6. the relay down longer than the duplicate window, after publishing and before marking

diesel::table! {
    consumer_effects (event_id) {
        event_id -> Uuid,
        applied -> Integer,
    }
}

/// A consumer that applies each message in its own transaction, behind the inbox; returns
/// (applied, skipped as already processed).
async fn consume_with_inbox(db: &TestDb, stream: &TestStream, total: usize) -> (usize, usize) {
    let js = stream.js().await;
    let consumer = js
        .get_stream(&stream.name)
        .await
        .expect("the stream")
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("fault-consumer".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .expect("a durable consumer");
    let mut messages = consumer.messages().await.expect("consume");
    let mut conn = db.conn();
    let (mut applied, mut skipped) = (0, 0);
    for _ in 0..total {
        let m = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .expect("the next message in time")
            .expect("a message")
            .expect("no error");
        let id = m
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|v| v.as_str().to_owned())
            .expect("a message id");
        let event_id: uuid::Uuid = id.parse().expect("a UUID message id");
        let new = conn
            .transaction(|c| {
                if !c.mark_processed("fault-consumer", &id)? {
                    return Ok::<_, diesel::result::Error>(false);
                }
                diesel::insert_into(consumer_effects::table)
                    .values((
                        consumer_effects::event_id.eq(event_id),
                        consumer_effects::applied.eq(1),
                    ))
                    .on_conflict(consumer_effects::event_id)
                    .do_update()
                    .set(consumer_effects::applied.eq(consumer_effects::applied + 1))
                    .execute(c)?;
                Ok(true)
            })
            .expect("the consumer's transaction");
        m.ack().await.expect("ack after commit");
        if new {
            applied += 1;
        } else {
            skipped += 1;
        }
    }
    (applied, skipped)
}

/// A stream of `stream`'s name capturing its prefix, with a 1 s duplicate window: what a
/// re-publish after it would store twice unless the relay reconciles.
async fn short_window_stream(stream: &TestStream) -> Duration {
    let window = Duration::from_secs(1);
    stream
        .js()
        .await
        .create_stream(jetstream::stream::Config {
            duplicate_window: window,
            ..stream.config()
        })
        .await
        .expect("a stream with a 1 s duplicate window");
    window
}

/// The relay (one, `args`) killed between ack and mark, its last 100 rows unmarked, and kept
/// down longer than the window: it must reconcile them, and a consumer behind the inbox sees
/// each event once.
async fn relay_down_past_the_window(test: &str, args: &[&str]) -> Report {
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let window = short_window_stream(&stream).await;
    diesel::sql_query(
        "CREATE TABLE consumer_effects (event_id uuid PRIMARY KEY, applied integer NOT NULL)",
    )
    .execute(&mut db.conn())
    .expect("the consumer's table");

    let args = args.iter().map(|a| a.to_string()).collect();
    let mut relays = Relays::start(&db, &stream, &logs, args, 1);
    let size = Size {
        events: 500,
        rate: 0,
        faults: 1,
    };
    let mut w = writer(
        &db,
        &logs,
        "writer",
        &["--count", "500", "--aggregates", "50", "--async-commit"],
    );
    assert_eq!(finished(&mut w, size).await, 500);
    drained(&db, None, size.timeout()).await;

    // the relay dies after JetStream acked its last batch and before it marked it
    relays.procs[0].kill();
    let unmarked = diesel::sql_query(
        "UPDATE outbox SET published_at = NULL WHERE seq IN \
         (SELECT seq FROM outbox ORDER BY seq DESC LIMIT 100)",
    )
    .execute(&mut db.conn())
    .expect("unmark the last batch");
    assert_eq!(unmarked, 100);
    // the ordered relay's record of it: its cursor goes back before the last 100 rows
    diesel::sql_query(
        "INSERT INTO outbox_progress (partitions, partition, upto_seq, snap) \
         SELECT DISTINCT ON (partitions, partition) partitions, partition, \
         (SELECT seq FROM outbox ORDER BY seq DESC OFFSET 100 LIMIT 1), pg_current_snapshot() \
         FROM outbox_progress ORDER BY partitions, partition, id DESC",
    )
    .execute(&mut db.conn())
    .expect("rewind the progress");
    // and stays down longer than the duplicate window (the fault itself, not a synchronisation)
    tokio::time::sleep(window * 2).await;
    relays.kill_and_restart(0);
    drained(&db, None, size.timeout()).await;
    drop(relays);

    let r = report(test, &db, &stream).await;
    r.assert_exact();
    assert_eq!(r.in_stream, 500, "{r}");

    let (applied, skipped) = consume_with_inbox(&db, &stream, r.in_stream).await;
    eprintln!("{test}: the inbox consumer applied {applied}, skipped {skipped} duplicates");
    assert_eq!((applied, skipped), (500, 0));
    assert_eq!(
        db.scalar("SELECT max(applied) FROM consumer_effects"),
        1,
        "no event applied twice"
    );
    assert_eq!(db.scalar("SELECT count(*) FROM consumer_effects"), 500);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_down_past_the_duplicate_window_reconciles_instead_of_republishing_ordered() {
    let r = relay_down_past_the_window("past_duplicate_window", &[]).await;
    assert_eq!(r.order_violations, 0, "per-aggregate order: {r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_down_past_the_duplicate_window_reconciles_instead_of_republishing_unordered() {
    relay_down_past_the_window(
        "past_duplicate_window_unordered",
        &["--mode", "unordered", "--workers", "2"],
    )
    .await;
}

/// Log tailing's reader SIGKILLed `kills` times while a writer commits, each time kept down
/// longer than the duplicate window: the transactions acked and not confirmed are read again
/// after the restart, and must be reconciled, not stored twice.
async fn reader_down_past_the_window(test: &str, size: Size, kills: usize) {
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let window = short_window_stream(&stream).await;
    let (args, slot) = Mode::LogTailing.setup(&db);
    let mut relays = Relays::start(&db, &stream, &logs, args, 1);
    let mut w = steady_writer(&db, &logs, size);
    let mut rng = Rng::new(test);
    for k in 1..=kills {
        next_fault(
            &db,
            Size {
                faults: kills,
                ..size
            },
            k,
            &mut rng,
        )
        .await;
        relays.procs[0].kill();
        // down longer than the window: the fault itself, not a synchronisation
        tokio::time::sleep(window * 2).await;
        relays.kill_and_restart(0);
    }
    let committed = finished(&mut w, size).await;
    assert_eq!(committed, size.events);
    drained(&db, slot.as_ref(), size.timeout()).await;
    drop(relays);
    let r = report(test, &db, &stream).await;
    Mode::LogTailing.assert(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reader_killed_and_down_past_the_duplicate_window_duplicates_nothing_log_tailing() {
    reader_down_past_the_window("reader_down_past_window", SHORT, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: 200,000 events, 20 kills each past the window"]
async fn long_reader_killed_20_times_past_the_duplicate_window_log_tailing() {
    reader_down_past_the_window("long_reader_down_past_window", LONG, 20).await;
}

// ---------------------------------------------------------------------------------------------
// 9. NATS unreachable longer than the duplicate window after storing messages whose acks
// were lost

/// The short run of scenario 9: slow enough that the writer still commits during each outage.
const SLOW: Size = Size {
    events: 3_000,
    rate: 200,
    faults: 2,
};

/// The relays reach NATS through a proxy. `outages` times, while a writer commits, the proxy
/// drops what the server sends for a second (the messages are stored, their acks lost), then
/// cuts the connections and refuses new ones for twice the duplicate window. The relays must
/// reconcile those messages, not store them again.
async fn acks_lost_past_the_window(test: &str, mode: Mode, size: Size, outages: usize) {
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let window = short_window_stream(&stream).await;
    let proxy = NatsProxy::start(&stream.nats_url);
    let (args, slot) = mode.setup(&db);
    let relays = Relays::start_via(&db, &stream, &logs, args, 1, Some(proxy.url()));
    let mut w = steady_writer(&db, &logs, size);
    let mut rng = Rng::new(test);
    let mut lost = 0;
    for k in 1..=outages {
        next_fault(
            &db,
            Size {
                faults: outages,
                ..size
            },
            k,
            &mut rng,
        )
        .await;
        // caught up, so that the rows sent next are fresh and go out without a look-up (the
        // replies to which the proxy would drop too)
        wait_until(size.timeout(), "the relay caught up", || async {
            stream.count().await as i64 >= db.scalar("SELECT count(*) FROM outbox_record") - 100
        })
        .await;
        let before = stream.count().await as i64;
        proxy.lose_replies();
        // what the relays send now is stored, its acks lost (the fault itself, not a
        // synchronisation: its length)
        tokio::time::sleep(Duration::from_secs(1)).await;
        proxy.down();
        lost += stream.count().await as i64 - before;
        // unreachable longer than the window: the fault itself, not a synchronisation
        tokio::time::sleep(window * 2).await;
        proxy.up();
    }
    eprintln!("{test}: {lost} messages stored while their acks were lost");
    assert!(
        lost > 0,
        "the outages lost no ack: the scenario did not happen"
    );
    let committed = finished(&mut w, size).await;
    assert_eq!(committed, size.events);
    drained(&db, slot.as_ref(), size.timeout()).await;
    drop(relays);
    let r = report(test, &db, &stream).await;
    mode.assert(&r);
}

per_mode! {
    acks_lost_past_the_window(SLOW, 2):
    nats_unreachable_past_the_duplicate_window_with_acks_lost_duplicates_nothing_ordered("acks_lost_ordered", Ordered),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_unreachable_past_the_duplicate_window_with_acks_lost_duplicates_nothing_log_tailing()
{
    acks_lost_past_the_window("acks_lost_log_tailing", Mode::LogTailing, SLOW, 2).await;
}

per_mode! {
    acks_lost_past_the_window(LONG, 10):
    #[ignore = "long: 200,000 events, 10 outages with acks lost"]
    long_nats_unreachable_10_times_with_acks_lost_duplicates_nothing_ordered("long_acks_lost_ordered", Ordered),
    #[ignore = "long: 200,000 events, 10 outages with acks lost"]
    long_nats_unreachable_10_times_with_acks_lost_duplicates_nothing_log_tailing("long_acks_lost_log_tailing", LogTailing),
}

// ---------------------------------------------------------------------------------------------
// 10. a relay paused past the duplicate window with publishes in its buffers, and the fence

/// Two relays share four partitions (ordered, lease 3 s) on a stream with a 1 s duplicate
/// window; relay A reaches NATS through a proxy. While a writer commits, the proxy holds what A
/// sends (standing for the buffers of a process stopped between its lease check and the
/// socket) and A is SIGSTOPped; B takes A's partitions over and publishes A's unacked rows and
/// newer ones; longer than the window after that, A resumes and what it had sent reaches the
/// server. Returns the checker's report and the publishes A had held.
async fn paused_past_the_window(test: &str, fence: bool) -> (Report, usize) {
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let window = short_window_stream(&stream).await;
    let proxy = NatsProxy::start(&stream.nats_url);
    let mut rng = Rng::new(test);
    let mut args = Mode::Ordered.table_args(&db);
    args.extend(["--lease".to_string(), format!("{}s", LEASE.as_secs())]);
    if fence {
        args.push("--fence".into());
    }
    let a = Relays::start_via(&db, &stream, &logs, args.clone(), 1, Some(proxy.url()));
    let b = Relays::start(&db, &stream, &logs, args, 1);
    let size = Size {
        events: 3_000,
        rate: 500,
        faults: 1,
    };
    let mut w = steady_writer(&db, &logs, size);
    wait_until(
        Duration::from_secs(30),
        "two relays sharing the four partitions",
        || async { distinct_owners(&db) == (4, 2) },
    )
    .await;
    next_fault(&db, Size { faults: 2, ..size }, 1, &mut rng).await;
    // what A sends from now on stays in the proxy: A is paused once some of its publishes are
    // there. A may be between steps for a while (reading, waiting for a wake-up), or, with
    // the fence, waiting for the look-up of its subjects' last sequences, which the proxy
    // holds too: then the look-up is let through and the hold begins again as its answer
    // comes (each hold shorter than the lease, so A keeps its partitions meanwhile)
    let mut holds = 0;
    loop {
        proxy.hold();
        holds += 1;
        let until = Instant::now() + Duration::from_secs(1);
        while proxy.held_publishes() == 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if proxy.held_publishes() > 0 {
            break;
        }
        assert!(
            holds < 8,
            "relay A published nothing in {holds} holds of a second"
        );
        proxy.up();
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let stopped = Instant::now();
    a.procs[0].signal("STOP");
    let last = db.scalar("SELECT COALESCE(max(seq), 0) FROM outbox_record");
    wait_until(
        HANDOVER_BOUND * 2,
        "the paused relay's work taken over",
        || async {
            let left = db.scalar(&format!(
                "SELECT count(*) FROM outbox_audit WHERE seq <= {last} AND published_at IS NULL"
            ));
            left == 0 && distinct_owners(&db) == (4, 1)
        },
    )
    .await;
    // B has published A's unacked rows: A stays paused longer than the window after that
    // (the fault itself, not a synchronisation)
    tokio::time::sleep(window * 2).await;
    let held = proxy.held_publishes();
    proxy.up();
    a.procs[0].signal("CONT");
    eprintln!(
        "{test}: relay A paused {:?} with {held} publishes in its buffers (hold {holds})",
        stopped.elapsed()
    );
    assert!(
        held > 0,
        "relay A sent nothing while held: the scenario did not happen"
    );
    wait_until(
        Duration::from_secs(30),
        "the resumed relay back in the balance",
        || async { distinct_owners(&db) == (4, 2) },
    )
    .await;
    let committed = finished(&mut w, size).await;
    assert_eq!(committed, size.events);
    drained(&db, None, size.timeout()).await;
    drop((a, b));
    (report(test, &db, &stream).await, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_paused_past_the_duplicate_window_while_a_newer_owner_publishes_is_fenced_ordered() {
    let (r, _) = paused_past_the_window("paused_past_window_fenced", true).await;
    Mode::Ordered.assert(&r);
}

/// The same scenario without the fence (the default): what the paused relay had sent is
/// stored a second time, after newer events of its aggregates (the checker counts a second
/// copy as a duplicate only, not also as a reordering). It shows that the scenario happens,
/// and that the fence is what closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_paused_past_the_duplicate_window_without_the_fence_stores_duplicates() {
    if std::env::var_os("OUTBOX_TEST_FENCE").is_some() {
        eprintln!("OUTBOX_TEST_FENCE runs every relay with --fence: nothing to show here");
        return;
    }
    let (r, held) = paused_past_the_window("paused_past_window_unfenced", false).await;
    assert!(
        r.duplicates > 0 && r.duplicates <= held,
        "the held publishes stored again: {r}"
    );
}

/// The relay (ordered, one partition, `args` with `--fence`) publishes an event of aggregate `a1`; another
/// publisher then stores a message on `a1`'s subject, so that the sequence the relay expects
/// there is stale; the relay's next event of `a1` is refused by JetStream, and must be
/// published after all, once, neither counted as a failure of the row nor parked.
async fn stale_expected_sequence(test: &str, stream: &TestStream, args: &[&str]) {
    let db = TestDb::new();
    let relay = support::Relay::start(relay_command(&db, stream, args));
    let record = |account: &str, amount: i64| {
        db.conn()
            .transaction(|c| {
                c.record_event(&Credited {
                    account: account.into(),
                    amount,
                })
            })
            .expect("record");
    };
    let unpublished = || db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL");
    record("a1", 1);
    wait_until(
        Duration::from_secs(30),
        "the first event published",
        || async { unpublished() == 0 },
    )
    .await;
    let js = stream.js().await;
    js.publish(format!("{}.account.a1", stream.prefix), "{}".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    record("a1", 2);
    record("a2", 3);
    record("a1", 4);
    wait_until(Duration::from_secs(30), "every event published", || async {
        unpublished() == 0
    })
    .await;
    let logs = relay.logs();
    assert!(
        logs.contains("JetStream refused the event"),
        "the fence did not refuse the stale publish: {logs}"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL OR attempts > 0"),
        0,
        "a fenced row counted as failing: {logs}"
    );
    let ids: Vec<String> = {
        let mut conn = db.conn();
        diesel::sql_query("SELECT id::text AS id FROM outbox ORDER BY seq")
            .load::<IdRow>(&mut conn)
            .expect("ids")
            .into_iter()
            .map(|r| r.id)
            .collect()
    };
    let messages = stream.read_all().await;
    for id in &ids {
        let n = messages.iter().filter(|m| &m.msg_id == id).count();
        assert_eq!(n, 1, "event {id} stored {n} times");
    }
    assert_eq!(
        messages.len(),
        ids.len() + 1,
        "the relay's events and the other one"
    );
    // a1's events in their order, after the other publisher's message
    let a1: Vec<i64> = messages
        .iter()
        .filter(|m| m.aggregate_id == "a1")
        .map(|m| m.payload["amount"].as_i64().unwrap_or(-1))
        .collect();
    assert_eq!(a1, [1, 2, 4], "{test}: a1's events in order");
    eprintln!("{test}: the stale publish was refused, read again and published once");
}

#[derive(QueryableByName)]
struct IdRow {
    #[diesel(sql_type = diesel::sql_types::Text)]
    id: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_with_a_stale_expected_sequence_is_refused_and_the_row_neither_parked_nor_lost() {
    let stream = TestStream::new();
    stale_expected_sequence("stale_expected_sequence", &stream, &["--fence"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_refuses_a_stale_publish_on_a_replicated_stream() {
    let cluster = NatsCluster::start();
    let stream = TestStream::on(&cluster.urls());
    stale_expected_sequence(
        "stale_expected_sequence_r3",
        &stream,
        &["--fence", "--stream-replicas", "3"],
    )
    .await;
    let info = stream
        .js()
        .await
        .get_stream(&stream.name)
        .await
        .expect("the stream")
        .info()
        .await
        .expect("its info")
        .config
        .num_replicas;
    assert_eq!(info, 3, "the stream is replicated");
}

// ---------------------------------------------------------------------------------------------
// 7. bad input

#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(aggregate_type = "account", event_type = "account.credited")]
struct Credited {
    #[outbox(aggregate_id)]
    account: String,
    amount: i64,
}

/// Commits `n` events, for the bad-input tests to show that nothing gets marked.
fn seed_rows(db: &TestDb, n: i64) {
    let mut conn = db.conn();
    for i in 0..n {
        conn.transaction(|c| {
            c.record_event(&Credited {
                account: format!("a{i}"),
                amount: i,
            })
        })
        .expect("record");
    }
}

/// `outbox-relay run` with exactly `args` (no test defaults, so that any flag can be given
/// wrong), against `db_url`, `nats_url` and `stream` (set through the environment).
fn relay_run(db_url: &str, nats_url: &str, stream: &TestStream, args: &[&str]) -> Command {
    let mut cmd = Command::new(relay_bin());
    cmd.arg("run")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "info")
        .env("DATABASE_URL", db_url)
        .env("NATS_URL", nats_url)
        .env("OUTBOX_STREAM", &stream.name)
        .env("OUTBOX_SUBJECT_PREFIX", &stream.prefix)
        .args(args);
    cmd
}

/// Runs `cmd` to its exit (within 15 s); returns its exit code and stderr.
async fn run_to_exit(cmd: &mut Command) -> (i32, String) {
    let mut p = Proc::spawn(
        "outbox-relay",
        cmd.stdout(Stdio::null()).stderr(Stdio::piped()),
    );
    let reader = support::read_in_background(p.child.stderr.take().expect("stderr"));
    let (code, _) = exit_of(&mut p, Duration::from_secs(15)).await;
    (code, reader.join().unwrap_or_default())
}

/// Asserts that a refused start left every row unpublished and the stream without messages.
async fn nothing_marked(db: &TestDb, stream: &TestStream, rows: i64) {
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NOT NULL"),
        0,
        "a refused relay marked rows"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL"),
        rows
    );
    assert_eq!(stream.count().await, 0, "a refused relay published");
}

#[tokio::test]
async fn malformed_configuration_is_refused_with_a_clear_error_and_marks_nothing() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    seed_rows(&db, 5);
    let nats = stream.nats_url.clone();
    let cases: &[(&[&str], &str)] = &[
        (&["--lease", "soon"], "--lease"),
        (&["--poll-interval", "10 parsecs"], "--poll-interval"),
        (&["--partitions", "0"], "--partitions 0 is out of range"),
        (&["--partitions", "many"], "--partitions"),
        (&["--workers", "0", "--mode", "unordered"], "--workers 0"),
        (&["--mode", "sideways"], "--mode"),
        (&["--subject-prefix", "a.b"], "subject prefix \"a.b\""),
        (&["--subject-prefix", "a>"], "subject prefix \"a>\""),
        (&["--stream", "no.dots"], "stream name"),
        (
            &["--lease", "1s"],
            "--lease 1s must be at least three times",
        ),
    ];
    for (args, expected) in cases {
        let mut cmd = relay_run(&db.url, &nats, &stream, args);
        let (code, stderr) = run_to_exit(&mut cmd).await;
        assert_ne!(code, 0, "{args:?} was accepted: {stderr}");
        assert!(
            stderr.contains(expected),
            "{args:?}: the error should mention {expected:?}: {stderr}"
        );
        assert!(
            stderr.lines().count() <= 8,
            "{args:?}: a short message: {stderr}"
        );
    }
    nothing_marked(&db, &stream, 5).await;
}

#[tokio::test]
async fn a_missing_outbox_table_is_a_clear_startup_error() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    seed_rows(&db, 3);
    let mut cmd = relay_run(
        &db.url,
        &stream.nats_url,
        &stream,
        &["--table", "billing.outbox", "--startup-timeout", "5s"],
    );
    let (code, stderr) = run_to_exit(&mut cmd).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("the outbox table billing.outbox does not exist"),
        "{stderr}"
    );
    assert!(
        stderr.contains("migrations"),
        "it says how to fix it: {stderr}"
    );
    nothing_marked(&db, &stream, 3).await;
}

#[tokio::test]
async fn a_stream_that_does_not_capture_the_subjects_is_a_clear_startup_error_and_marks_nothing() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    seed_rows(&db, 3);
    stream
        .js()
        .await
        .create_stream(jetstream::stream::Config {
            name: stream.name.clone(),
            subjects: vec![format!("{}-other.>", stream.prefix)],
            ..Default::default()
        })
        .await
        .expect("a stream on other subjects");
    let mut cmd = relay_run(
        &db.url,
        &stream.nats_url,
        &stream,
        &["--startup-timeout", "5s"],
    );
    let (code, stderr) = run_to_exit(&mut cmd).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains(&stream.name) && stderr.contains(&format!("{}.", stream.prefix)),
        "the error names the stream and the subjects: {stderr}"
    );
    nothing_marked(&db, &stream, 3).await;
}

#[test]
fn an_empty_aggregate_id_is_refused_at_record_time_and_by_the_tables_check() {
    let db = TestDb::new();
    let mut conn = db.conn();
    let refused = conn.transaction(|c| {
        c.record_event(&Credited {
            account: String::new(),
            amount: 1,
        })
    });
    let e = refused.expect_err("an empty aggregate id is refused");
    assert!(
        e.to_string().contains("aggregate id is empty"),
        "a clear error: {e}"
    );

    // a row written around the library meets the table's CHECK
    let raw = diesel::sql_query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'account', '', 'account.credited', '{}')",
    )
    .execute(&mut conn);
    match raw {
        Err(diesel::result::Error::DatabaseError(kind, info)) => {
            assert!(
                matches!(kind, diesel::result::DatabaseErrorKind::CheckViolation),
                "{kind:?}: {}",
                info.message()
            );
            assert_eq!(
                info.constraint_name(),
                Some("outbox_aggregate_id_is_a_header_value"),
                "{}",
                info.message()
            );
        }
        other => panic!("the CHECK should refuse an empty aggregate id: {other:?}"),
    }
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 0);
}

#[tokio::test]
async fn an_unreachable_database_or_nats_is_a_clear_error_after_the_startup_timeout() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    seed_rows(&db, 3);
    let nowhere = support::free_port();

    let dead_db = format!("postgres://postgres@127.0.0.1:{nowhere}/outbox");
    let mut cmd = relay_run(
        &dead_db,
        &stream.nats_url,
        &stream,
        &["--startup-timeout", "1s"],
    );
    let started = Instant::now();
    let (code, stderr) = run_to_exit(&mut cmd).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("cannot connect to PostgreSQL within 1s"),
        "{stderr}"
    );
    assert!(stderr.contains("--database-url"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "gave up in time"
    );

    let dead_nats = format!("nats://127.0.0.1:{nowhere}");
    let mut cmd = relay_run(&db.url, &dead_nats, &stream, &["--startup-timeout", "1s"]);
    let (code, stderr) = run_to_exit(&mut cmd).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("cannot connect to NATS") && stderr.contains("--nats-url"),
        "{stderr}"
    );
    nothing_marked(&db, &stream, 3).await;
}

// ---------------------------------------------------------------------------------------------
// the checker itself

fn db_event(seq: i64, id: u128, aggregate: &str) -> DbEvent {
    DbEvent {
        seq: Some(seq),
        id: uuid::Uuid::from_u128(id),
        aggregate: aggregate.into(),
        in_outbox: true,
        in_business: true,
        marked: true,
    }
}

fn stream_message(n: u64, id: u128, aggregate: &str) -> StreamMessage {
    StreamMessage {
        stream_seq: n,
        msg_id: uuid::Uuid::from_u128(id).to_string(),
        aggregate: aggregate.into(),
        created_nanos: Some(0),
        stored_nanos: n as i128 * 1_000_000,
    }
}

#[test]
fn the_checker_counts_each_kind_of_fault() {
    let mut half = db_event(5, 5, "a/2");
    half.in_business = false;
    let events = [
        db_event(1, 1, "a/1"),
        db_event(2, 2, "a/1"),
        db_event(3, 3, "a/2"),
        db_event(4, 4, "a/1"),
        half,
    ];
    let messages = [
        stream_message(1, 2, "a/1"),
        stream_message(2, 1, "a/1"), // after seq 2 of its aggregate
        stream_message(3, 2, "a/1"), // a duplicate
        stream_message(4, 9, "a/1"), // never committed
        stream_message(5, 3, "a/2"),
    ];
    let r = checker::compare(&events, &messages);
    assert_eq!(
        (
            r.committed,
            r.torn,
            r.in_stream,
            r.missing,
            r.orphaned,
            r.duplicates,
            r.order_violations
        ),
        (4, 1, 5, 1, 1, 1, 1),
        "{r}"
    );
    assert_eq!(r.marked_not_in_stream, 2, "seq 4 and the torn seq 5: {r}");
    assert_eq!(r.max_wait, Duration::from_millis(5));
}

/// The record a deleting relay is checked against: a row deleted after its ack counts as
/// published; one deleted without a message in the stream is caught as marked but not in the
/// stream (and missing); a deletion that rolls back leaves no record.
#[tokio::test]
async fn the_checker_holds_deleted_rows_to_the_promise_of_marked_ones() {
    let (db, stream) = (fault_db(TestDb::new()), TestStream::new());
    seed_rows(&db, 4);
    // a relay's work, by hand: the first two rows published and deleted after their acks
    let js = stream.js().await;
    js.create_stream(jetstream::stream::Config {
        name: stream.name.clone(),
        subjects: vec![format!("{}.>", stream.prefix)],
        ..Default::default()
    })
    .await
    .expect("the stream");
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        seq: i64,
        #[diesel(sql_type = diesel::sql_types::Uuid)]
        id: uuid::Uuid,
        #[diesel(sql_type = diesel::sql_types::Text)]
        aggregate_id: String,
    }
    let mut conn = db.conn();
    let rows: Vec<Row> =
        diesel::sql_query("SELECT seq, id, aggregate_id FROM outbox ORDER BY seq LIMIT 2")
            .load(&mut conn)
            .expect("the oldest rows");
    for row in &rows {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", row.id.to_string().as_str());
        headers.insert("Outbox-Aggregate-Type", "account");
        headers.insert("Outbox-Aggregate-Id", row.aggregate_id.as_str());
        js.publish_with_headers(format!("{}.account.x", stream.prefix), headers, "{}".into())
            .await
            .expect("publish")
            .await
            .expect("ack");
    }
    let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
    diesel::sql_query("DELETE FROM outbox WHERE seq = ANY($1)")
        .bind::<diesel::sql_types::Array<diesel::sql_types::BigInt>, _>(&seqs)
        .execute(&mut conn)
        .expect("delete the acked rows");
    // a deletion that rolls back is no deletion
    let _ = conn.transaction::<(), diesel::result::Error, _>(|c| {
        diesel::sql_query("DELETE FROM outbox").execute(c)?;
        Err(diesel::result::Error::RollbackTransaction)
    });
    let r = checker::check(&db, &stream).await;
    assert_eq!(
        (
            r.committed,
            r.outbox_rows,
            r.unpublished,
            r.missing,
            r.marked_not_in_stream
        ),
        (4, 4, 2, 2, 0),
        "{r}"
    );
    // a relay that deletes a row it never published breaks the promise, and the checker says so
    diesel::sql_query("DELETE FROM outbox WHERE seq = (SELECT max(seq) FROM outbox)")
        .execute(&mut conn)
        .expect("delete an unpublished row");
    let r = checker::check(&db, &stream).await;
    assert_eq!(
        (
            r.committed,
            r.unpublished,
            r.missing,
            r.marked_not_in_stream
        ),
        (4, 1, 2, 1),
        "{r}"
    );
    assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 1);
}

// ---------------------------------------------------------------------------------------------
// 8. log tailing at its edges: the first start under load, a dropped slot

/// The log-tailing relays start for the first time while the writer commits, and both are
/// SIGKILLed once soon after: the rows committed before the slot come from its exported
/// snapshot (published again from a new slot when the kill struck during it), the rest from
/// the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_first_start_under_load_loses_and_duplicates_nothing() {
    let test = "first_start_log_tailing";
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let slot = Slot::new(&db);
    let mut args = Mode::LogTailing.relay_args();
    args.extend(["--slot".to_owned(), slot.name.clone()]);
    let mut w = steady_writer(&db, &logs, SHORT);
    let before = SHORT.events as i64 / 3;
    wait_until(SHORT.timeout(), "rows before the relays", || async {
        db.scalar("SELECT count(*) FROM outbox_record") >= before
    })
    .await;
    let mut relays = Relays::start(&db, &stream, &logs, args, 2);
    wait_until(SHORT.timeout(), "the first rows published", || async {
        stream.count().await >= 100
    })
    .await;
    relays.kill_and_restart(0);
    relays.kill_and_restart(1);
    let committed = finished(&mut w, SHORT).await;
    assert_eq!(committed, SHORT.events);
    drained(&db, Some(&slot), SHORT.timeout()).await;
    drop(relays);
    let r = report(test, &db, &stream).await;
    assert_eq!(r.committed as u64, SHORT.events, "{r}");
    Mode::LogTailing.assert(&r);
}

/// The slot dropped mid-run, as a failover to a standby without it loses it: the reader and
/// the standby stop (exit 1) instead of making a new slot at the current position, and
/// restarted with `--recover-slot` they publish again what the table holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_dropped_slot_stops_the_relays_and_recovery_loses_nothing() {
    let test = "dropped_slot_log_tailing";
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let (args, slot) = Mode::LogTailing.setup(&db);
    let slot = slot.expect("a slot");
    let mut relays = Relays::start(&db, &stream, &logs, args, 2);
    let mut w = steady_writer(&db, &logs, SHORT);
    wait_until(SHORT.timeout(), "a third of the rows published", || async {
        stream.count().await >= SHORT.events / 3
    })
    .await;
    support::slot::drop_slot(db.admin_url(), &slot.name);
    for p in &mut relays.procs {
        assert_eq!(
            p.wait_exit(Duration::from_secs(60)),
            Some(1),
            "{} stops on the lost slot",
            p.name
        );
    }
    assert!(!slot.exists(&db), "no slot made silently");
    relays.args.push("--recover-slot".into());
    relays.kill_and_restart(0);
    relays.kill_and_restart(1);
    let committed = finished(&mut w, SHORT).await;
    assert_eq!(committed, SHORT.events);
    drained(&db, Some(&slot), SHORT.timeout()).await;
    drop(relays);
    let r = report(test, &db, &stream).await;
    assert_eq!(r.committed as u64, SHORT.events, "{r}");
    Mode::LogTailing.assert(&r);
}
