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
//! The harness is here; the scenarios are a module each: `kills` (1, 2), `outages` (3, 4),
//! `pauses` (5), `duplicate_window` (6, 9, 10), `bad_input` (7), `log_tailing` (8), and
//! `checker_tests`, the checker's own.
//!
//! The tests of this suite run one at a time (`SERIAL`): they measure handover times on a small
//! machine, and two fault runs side by side would measure each other.

#[path = "../support/mod.rs"]
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

/// The lease the pause tests run with, and the bound they hold the relays to: the documented
/// "within `--lease` plus a second" (the session timeout, then the survivor's next balance),
/// plus the time to publish what waited, with two seconds to spare for a loaded machine.
const LEASE: Duration = Duration::from_secs(3);
const HANDOVER_BOUND: Duration = Duration::from_secs(6);

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

// the scenarios, a module per subject, after the macro they use
mod bad_input;
mod checker_tests;
mod duplicate_window;
mod kills;
mod log_tailing;
mod outages;
mod pauses;
