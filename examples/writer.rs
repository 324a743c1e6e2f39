//! # A load writer for the fault tests
//!
//! A small application process that writes through the outbox the way a service should: each
//! transaction locks an account (an upsert of its row, which bumps the account's `version`),
//! records an `account.credited` event with `outbox_diesel`'s sync `record_event`, and writes
//! a ledger entry (`writer_entries`) keyed by the event's message id. The ledger entry is the
//! "business row" the fault suite's checker joins the outbox and the stream against: an event
//! in the stream without a committed entry is an orphan, a committed entry whose event never
//! reached the stream is missing.
//!
//! It creates its two tables when missing (`writer_accounts`, `writer_entries`); the outbox
//! table must exist already (outbox-diesel's migrations). It prints nothing per event, only a
//! final `committed N rolled_back N failed N` line on stdout; errors go to stderr.
//!
//! Fault modes, for the tests in `tests/faults/`:
//!
//! - `--pause-ms N` sleeps between the business write (and the recorded event) and the
//!   `COMMIT` of every transaction: the session is then `idle in transaction` with an xid, and
//!   a test SIGKILLs the process exactly there;
//! - `--fail-every K` makes every K-th transaction break a constraint after it recorded its
//!   event (a negative balance against a `CHECK`), so it rolls back with the event; such
//!   events carry `"doomed": true` and must never reach the stream;
//! - `--async-commit` turns off `synchronous_commit` for its sessions, for speed on a slow disk
//!   (a commit is then lost if the server crashes, so not with a crashing server);
//! - a lost connection (a restarted or unreachable PostgreSQL) is retried for `--retry-for-ms`,
//!   reconnecting, so a writer lives through a database restart.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1/app cargo run --example writer -- \
//!     --count 10000 --aggregates 200 --threads 4 --rate 2000
//! ```

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Text, Uuid as SqlUuid};
use outbox_diesel::{OutboxEvent, OutboxExt};
use serde::Serialize;

/// Writes business rows and their outbox events, in one transaction each.
#[derive(Debug, Parser)]
#[command(name = "writer")]
struct Args {
    /// PostgreSQL URL of the database holding the outbox.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Transactions to commit.
    #[arg(long, default_value_t = 1000)]
    count: u64,
    /// Accounts (aggregates) the transactions spread over.
    #[arg(long, default_value_t = 100)]
    aggregates: u64,
    /// Concurrent connections writing.
    #[arg(long, default_value_t = 1)]
    threads: u64,
    /// Transactions per second for the whole process; 0 = as fast as it can.
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Sleep this long between the business write and the commit of every transaction.
    #[arg(long, default_value_t = 0)]
    pause_ms: u64,
    /// Every K-th transaction breaks a constraint after recording, and rolls back; 0 = never.
    #[arg(long, default_value_t = 0)]
    fail_every: u64,
    /// Keep retrying a lost connection for this long before giving up.
    #[arg(long, default_value_t = 60_000)]
    retry_for_ms: u64,
    /// The session's application_name (tests find the writer's sessions by it).
    #[arg(long, default_value = "outbox-writer")]
    name: String,
    /// Commit without waiting for the WAL flush (`synchronous_commit = off`): faster on a
    /// slow disk, and safe while the server does not crash.
    #[arg(long)]
    async_commit: bool,
    /// Seed of the account choice.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// The event each transaction records.
#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(aggregate_type = "account", event_type = "account.credited")]
struct AccountCredited {
    #[outbox(aggregate_id)]
    account: String,
    /// The account's version after this change: its commit order.
    version: i64,
    amount: i64,
    writer: String,
    /// Set on the transactions made to fail: such an event must never be published.
    doomed: bool,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS writer_accounts (
    id      text   PRIMARY KEY,
    version bigint NOT NULL,
    balance bigint NOT NULL CONSTRAINT writer_balance_not_negative CHECK (balance >= 0)
);
CREATE TABLE IF NOT EXISTS writer_entries (
    event_id uuid   PRIMARY KEY,
    account  text   NOT NULL,
    version  bigint NOT NULL,
    amount   bigint NOT NULL
);";

#[derive(QueryableByName)]
struct Version {
    #[diesel(sql_type = BigInt)]
    version: i64,
}

#[derive(Default)]
struct Counts {
    committed: AtomicU64,
    rolled_back: AtomicU64,
    failed: AtomicU64,
}

fn main() -> ExitCode {
    let args = Arc::new(Args::parse());
    if args.aggregates == 0 || args.threads == 0 {
        eprintln!("writer: --aggregates and --threads must be at least 1");
        return ExitCode::from(2);
    }
    if let Err(e) = connect(&args).and_then(|mut c| create_tables(&mut c)) {
        eprintln!("writer: cannot prepare the database: {e}");
        return ExitCode::from(1);
    }
    let counts = Arc::new(Counts::default());
    let slots = Arc::new(AtomicU64::new(0));
    let attempts = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..args.threads)
        .map(|t| {
            let (args, counts, slots, attempts) = (
                args.clone(),
                counts.clone(),
                slots.clone(),
                attempts.clone(),
            );
            std::thread::spawn(move || write(t, &args, &counts, &slots, &attempts))
        })
        .collect();
    let mut ok = true;
    for t in threads {
        ok &= matches!(t.join(), Ok(Ok(())));
    }
    println!(
        "committed {} rolled_back {} failed {}",
        counts.committed.load(Ordering::Relaxed),
        counts.rolled_back.load(Ordering::Relaxed),
        counts.failed.load(Ordering::Relaxed)
    );
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn connect(args: &Args) -> Result<PgConnection, String> {
    let mut conn = PgConnection::establish(&args.database_url).map_err(|e| e.to_string())?;
    diesel::sql_query("SELECT set_config('application_name', $1, false)")
        .bind::<Text, _>(&args.name)
        .execute(&mut conn)
        .map_err(|e| e.to_string())?;
    if args.async_commit {
        conn.batch_execute("SET synchronous_commit = off")
            .map_err(|e| e.to_string())?;
    }
    Ok(conn)
}

/// Creates the tables under a lock, so that writers started together do not race.
fn create_tables(conn: &mut PgConnection) -> Result<(), String> {
    conn.transaction(|conn| {
        diesel::sql_query("SELECT pg_advisory_xact_lock(hashtext('outbox-writer-schema'))")
            .execute(conn)?;
        conn.batch_execute(SCHEMA)
    })
    .map_err(|e: DieselError| e.to_string())
}

/// One thread: commits transactions until `--count` are taken by all threads together.
fn write(
    thread: u64,
    args: &Args,
    counts: &Counts,
    slots: &AtomicU64,
    attempts: &AtomicU64,
) -> Result<(), ()> {
    let mut rng = args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (thread + 1);
    let interval = (args.rate > 0).then(|| Duration::from_secs(args.threads) / args.rate as u32);
    let mut next = Instant::now();
    let mut conn: Option<PgConnection> = None;
    let mut down_since: Option<Instant> = None;
    while slots.fetch_add(1, Ordering::Relaxed) < args.count {
        loop {
            if let Some(interval) = interval {
                // after an outage, resume the rate instead of bursting to catch up
                next = (next + interval).max(Instant::now() - interval);
                if let Some(wait) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
            let c = match conn.as_mut() {
                Some(c) => c,
                None => match connect(args) {
                    Ok(c) => {
                        down_since = None;
                        conn.insert(c)
                    }
                    Err(e) => {
                        give_up_after(args, &mut down_since, &e)?;
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                },
            };
            let attempt = attempts.fetch_add(1, Ordering::Relaxed);
            let doomed = args.fail_every > 0 && attempt % args.fail_every == args.fail_every - 1;
            rng = xorshift(rng);
            let account = format!("acct-{}", rng % args.aggregates);
            match transaction(c, args, &account, (rng >> 33) as i64 % 100 + 1, doomed) {
                Ok(()) => {
                    counts.committed.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(DieselError::DatabaseError(DatabaseErrorKind::CheckViolation, _)) if doomed => {
                    counts.rolled_back.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    // a lost connection, or a COMMIT whose outcome is unknown: the database
                    // is the truth, and the checker reads it; write another one
                    counts.failed.fetch_add(1, Ordering::Relaxed);
                    conn = None;
                    give_up_after(args, &mut down_since, &e.to_string())?;
                }
            }
        }
    }
    Ok(())
}

fn give_up_after(args: &Args, down_since: &mut Option<Instant>, error: &str) -> Result<(), ()> {
    let since = *down_since.get_or_insert_with(|| {
        eprintln!("writer: {error}; retrying");
        Instant::now()
    });
    if since.elapsed() > Duration::from_millis(args.retry_for_ms) {
        eprintln!("writer: giving up after {} ms: {error}", args.retry_for_ms);
        return Err(());
    }
    Ok(())
}

/// Lock the account (the ordering rule), record the event, write the ledger entry; then fail
/// on purpose, pause, or commit.
fn transaction(
    conn: &mut PgConnection,
    args: &Args,
    account: &str,
    amount: i64,
    doomed: bool,
) -> QueryResult<()> {
    conn.transaction(|conn| {
        let v: Version = diesel::sql_query(
            "INSERT INTO writer_accounts AS a (id, version, balance) VALUES ($1, 1, $2) \
             ON CONFLICT (id) DO UPDATE SET version = a.version + 1, balance = a.balance + $2 \
             RETURNING version",
        )
        .bind::<Text, _>(account)
        .bind::<BigInt, _>(amount)
        .get_result(conn)?;
        let event = AccountCredited {
            account: account.to_owned(),
            version: v.version,
            amount,
            writer: args.name.clone(),
            doomed,
        };
        let id = conn.record_event(&event)?;
        diesel::sql_query(
            "INSERT INTO writer_entries (event_id, account, version, amount) VALUES ($1, $2, $3, $4)",
        )
        .bind::<SqlUuid, _>(id)
        .bind::<Text, _>(account)
        .bind::<BigInt, _>(v.version)
        .bind::<BigInt, _>(amount)
        .execute(conn)?;
        if doomed {
            diesel::sql_query("UPDATE writer_accounts SET balance = -1 WHERE id = $1")
                .bind::<Text, _>(account)
                .execute(conn)?;
        }
        if args.pause_ms > 0 {
            std::thread::sleep(Duration::from_millis(args.pause_ms));
        }
        Ok(())
    })
}

fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}
