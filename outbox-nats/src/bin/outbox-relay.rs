//! `outbox-relay`: publishes the committed rows of a Diesel outbox table to NATS JetStream.
//!
//! `outbox-relay run` relays until SIGTERM/SIGINT (a second signal aborts);
//! `outbox-relay status` prints the backlog from the database alone;
//! `outbox-relay cleanup` deletes published rows once;
//! `outbox-relay rotate` turns the outbox table into a ring of partitions;
//! `outbox-relay index` makes the index by which each relay reads only its own partitions.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use diesel_async::AsyncPgConnection;
use outbox_diesel::OutboxTable;
use outbox_diesel::relay as db;
use outbox_nats::cli::{DbArgs, RelayArgs};
use outbox_nats::operations;
use outbox_nats::{ModeKind, NatsOptions, Relay, redact_url};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Publishes the committed rows of a Diesel outbox table to NATS JetStream.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Relay events until SIGTERM or SIGINT.
    Run(Box<RunArgs>),
    /// Print the outbox's backlog, its oldest row's age and the partition owners; exits 1
    /// when the oldest unpublished row is older than --stall-after.
    Status(StatusArgs),
    /// List the parked rows: rows the relay gave up on, with their errors.
    Parked(ParkedArgs),
    /// Release parked rows so the relay publishes them again.
    Retry(RetryArgs),
    /// Delete published rows older than --retention once, in batches, and print how many
    /// (the relay does the same on a schedule).
    Cleanup(CleanupCmdArgs),
    /// Turn the outbox table into a ring of partitions, which cleanup empties with one
    /// TRUNCATE each instead of deleting row by row (README, "Rotation"); a table turned
    /// already is left as it is. It copies the table's rows under an exclusive lock:
    /// writers and relays wait for it.
    Rotate(RotateArgs),
    /// Make the partition index of --partitions N, by which an ordered relay that owns some of
    /// the partitions reads only their rows (README, "Partitions"); the relays find it while
    /// they run. Built CONCURRENTLY: writers and relays go on (on a rotated table, writers
    /// wait for it). An index there already is left as it is.
    Index(IndexArgs),
}

#[derive(Debug, Args)]
struct IndexArgs {
    #[command(flatten)]
    db: DbArgs,
    /// The partition count the relays run with (their --partitions), 2 to 1024.
    #[arg(long, env = "OUTBOX_PARTITIONS",
          value_parser = clap::value_parser!(u32).range(2..=i64::from(db::MAX_PARTITIONS)))]
    partitions: u32,
}

#[derive(Debug, Args)]
struct RotateArgs {
    #[command(flatten)]
    db: DbArgs,
    /// How many partitions the ring has (at least 2). Each one more costs every statement
    /// that reads the table one more index probe.
    #[arg(long, env = "OUTBOX_RING_PARTITIONS", default_value_t = 4)]
    partitions: u16,
    /// How many consecutive `seq`s a partition's block holds (at least 1000). Make a block
    /// take longer to fill than --retention lasts, or cleanup deletes row by row in the
    /// partition being filled.
    #[arg(long, env = "OUTBOX_RING_BLOCK_ROWS", default_value_t = 1_000_000)]
    block_rows: i64,
}

#[derive(Debug, Args)]
struct CleanupCmdArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Delete rows published longer ago than this (`0` = every published row).
    #[arg(long, env = "OUTBOX_RETENTION", default_value = "5m", value_parser = humantime::parse_duration)]
    retention: Duration,
    /// Rows deleted per statement.
    #[arg(long, env = "OUTBOX_CLEANUP_BATCH", default_value_t = 5000)]
    batch: usize,
    /// Move the rows into this table instead of deleting them.
    #[arg(long, env = "OUTBOX_ARCHIVE_TABLE")]
    archive_table: Option<OutboxTable>,
}

#[derive(Debug, Args)]
struct ParkedArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
struct RetrySelection {
    /// The `seq` of the parked row to retry.
    #[arg(long)]
    seq: Option<i64>,
    /// Retry every parked row.
    #[arg(long)]
    all: bool,
}

#[derive(Debug, Args)]
struct RetryArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    which: RetrySelection,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    relay: RelayArgs,
    /// Serve /metrics, /healthz and /readyz on this address (e.g. 127.0.0.1:9187).
    #[arg(long, env = "OUTBOX_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// Log format.
    #[arg(long, env = "OUTBOX_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Args)]
struct StatusArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Exit 1 when the oldest unpublished row (or, with a replication slot, the oldest
    /// unconfirmed transaction) is older than this.
    #[arg(long, env = "OUTBOX_STALL_AFTER", default_value = "30s", value_parser = humantime::parse_duration)]
    stall_after: Duration,
    /// The relay's mode: in log-tailing mode rows are never marked published, so only the
    /// slot's lag counts.
    #[arg(long, env = "OUTBOX_MODE", value_enum, default_value_t = ModeKind::Ordered)]
    mode: ModeKind,
    /// Replication slot to report on (default `{table}_slot`; shown when it exists).
    #[arg(long, env = "OUTBOX_SLOT")]
    slot: Option<String>,
    /// Publication of the slot (default `{table}_pub`).
    #[arg(long, env = "OUTBOX_PUBLICATION")]
    publication: Option<String>,
    /// Warn when the slot's unconfirmed WAL exceeds this many bytes.
    #[arg(long, env = "OUTBOX_SLOT_LAG_WARN_BYTES", default_value_t = 1 << 30)]
    slot_lag_warn_bytes: u64,
    /// The partition count to break the backlog down by (default: the running relays').
    #[arg(long)]
    partitions: Option<u32>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("outbox-relay: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match cli.command {
        Command::Run(args) => runtime.block_on(run(*args)),
        Command::Status(args) => runtime.block_on(status(args)),
        Command::Parked(args) => runtime.block_on(parked(args)),
        Command::Retry(args) => runtime.block_on(retry(args)),
        Command::Cleanup(args) => runtime.block_on(cleanup(args)),
        Command::Rotate(args) => runtime.block_on(rotate(args)),
        Command::Index(args) => runtime.block_on(index(args)),
    }
}

fn init_tracing(format: LogFormat) {
    // the replication client reports a lost connection itself, at ERROR, where the relay
    // logs the same event once with what it does about it: quiet by default
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,pgwire_replication=off"));
    // colours only on a terminal, and not with NO_COLOR (https://no-color.org): piped logs
    // stay plain text
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn run(args: RunArgs) -> ExitCode {
    init_tracing(args.log_format);
    let config = match args.relay.config() {
        Ok(config) => config,
        Err(e) => {
            error!("invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = config.validate() {
        error!("invalid configuration: {e}");
        return ExitCode::from(2);
    }
    let nats = args.relay.nats.options();
    info!(
        database = %redact_url(&args.relay.db.database_url),
        nats = %redact_url(&args.relay.nats.nats_url),
        "connecting"
    );
    // what the operator must change on the database's side (no such database or role,
    // refused credentials) is said at once, not after NATS's start-up timeout; a server not up
    // yet is waited for by the relay below
    if let Err(e) = outbox_diesel::connect(&config.database_url).await
        && !e.can_heal()
    {
        error!("{}", outbox_nats::RelayError::DatabaseRefused(e));
        return ExitCode::from(2);
    }
    let client = match connect_nats(&nats, args.relay.startup_timeout).await {
        Ok(c) => c,
        Err(e) => {
            error!("{e}");
            return ExitCode::from(if e.can_heal() { 1 } else { 2 });
        }
    };

    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    let relay = Relay::new(config, client);
    let mut admin = None;
    if let Some(addr) = args.metrics_addr {
        let handle = match outbox_nats::admin::install_recorder() {
            Ok(h) => h,
            Err(e) => {
                error!("cannot install the metrics recorder: {e}");
                return ExitCode::from(1);
            }
        };
        let listener = outbox_nats::admin::serve(addr, handle, relay.health(), shutdown.clone());
        info!(%addr, "serving /metrics, /healthz and /readyz");
        admin = Some(tokio::spawn(listener));
    }
    let result = relay.run(shutdown.clone()).await;
    shutdown.cancel();
    if let Some(admin) = admin {
        match admin.await {
            Ok(Err(e)) => error!("admin listener failed: {e}"),
            Err(e) => error!("admin listener failed: {e}"),
            Ok(Ok(())) => {}
        }
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::from(exit_code(&e))
        }
    }
}

/// 2 for what the operator must change (flags, a URL that does not parse, a database or role
/// that does not exist, refused credentials), 1 for every other failure.
fn exit_code(e: &outbox_nats::RelayError) -> u8 {
    use outbox_nats::RelayError as E;
    match e {
        E::Config(_) | E::DatabaseRefused(_) => 2,
        _ => 1,
    }
}

/// Connects to NATS, retrying until `timeout` (the server may start after the relay).
async fn connect_nats(
    options: &NatsOptions,
    timeout: Duration,
) -> Result<async_nats::Client, outbox_nats::ConnectError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut backoff =
        outbox_nats::backoff::Backoff::starting(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        match options.connect().await {
            Ok(c) => return Ok(c),
            Err(e) if !e.can_heal() => return Err(e),
            Err(e) => {
                let delay = backoff.next_delay();
                if tokio::time::Instant::now() + delay >= deadline {
                    return Err(e);
                }
                tracing::warn!("{e}; retrying");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// The first SIGTERM/SIGINT drains; a second one exits at once.
fn spawn_signal_handler(shutdown: CancellationToken) {
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    error!("cannot install the SIGTERM handler: {e}");
                    return;
                }
            };
        for n in 0..2 {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            if n == 0 {
                info!("shutting down: finishing the acks in flight (signal again to abort)");
                shutdown.cancel();
            } else {
                error!("aborted");
                std::process::exit(130);
            }
        }
    });
}

fn fail(command: &str, msg: String) -> ExitCode {
    eprintln!("outbox-relay {command}: {msg}");
    ExitCode::from(2)
}

/// What to check when a one-shot command cannot connect and the error names no fix.
const CONNECT_HINT: &str = "is PostgreSQL running, and is --database-url (DATABASE_URL) right?";

/// Connects for a one-shot command and checks the table exists.
async fn open(command: &str, db: &DbArgs) -> Result<AsyncPgConnection, ExitCode> {
    let mut conn = outbox_diesel::connect(&db.database_url)
        .await
        .map_err(|e| {
            let fix = e.fix().unwrap_or(CONNECT_HINT);
            fail(
                command,
                format!(
                    "cannot connect to PostgreSQL at {}: {e}; {fix}",
                    redact_url(&db.database_url)
                ),
            )
        })?;
    // the operations' statements (the backlog by cursor, the parked rows) are estimated far
    // above `jit_above_cost`: compiling them would take longer than running them
    if let Err(e) = db::prepare_side_session(&mut conn).await {
        return Err(fail(command, format!("{e}")));
    }
    match db::table_exists(&mut conn, &db.table).await {
        Ok(true) => Ok(conn),
        Ok(false) => Err(fail(
            command,
            format!(
                "the outbox table {} does not exist; pass --table or apply outbox-diesel's migrations",
                db.table
            ),
        )),
        Err(e) => Err(fail(command, format!("{e}"))),
    }
}

async fn parked(args: ParkedArgs) -> ExitCode {
    let mut conn = match open("parked", &args.db).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let rows = match operations::parked(&mut conn, &args.db.table).await {
        Ok(r) => r,
        Err(e) => return fail("parked", format!("cannot read {}: {e}", args.db.table)),
    };
    if args.json {
        match serde_json::to_string_pretty(&rows) {
            Ok(s) => println!("{s}"),
            Err(e) => return fail("parked", format!("{e}")),
        }
    } else if rows.is_empty() {
        println!("no parked rows");
    } else {
        for r in &rows {
            println!(
                "seq {}  id {}  {}/{}  {}  attempts {}  held back {}  parked {}\n    error: {}",
                r.seq,
                r.id,
                r.aggregate_type,
                r.aggregate_id,
                r.event_type,
                r.attempts,
                r.held_back,
                r.parked_at.to_rfc3339(),
                r.last_error.as_deref().unwrap_or("-")
            );
        }
        println!(
            "retry one with `outbox-relay retry --seq SEQ`, or all with `outbox-relay retry --all`"
        );
    }
    ExitCode::SUCCESS
}

async fn retry(args: RetryArgs) -> ExitCode {
    let mut conn = match open("retry", &args.db).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let which = match args.which.seq {
        Some(seq) if !args.which.all => operations::Retry::Seq(seq),
        _ => operations::Retry::All,
    };
    match operations::retry(&mut conn, &args.db.table, which).await {
        Ok(n) => {
            println!(
                "released {n} parked row(s); the relays were notified and publish them at once \
                 (one that does not listen, at its next poll)"
            );
            ExitCode::SUCCESS
        }
        Err(e @ operations::RetryError::NotParked(_)) => fail("retry", e.to_string()),
        Err(e) => fail("retry", format!("cannot update {}: {e}", args.db.table)),
    }
}

async fn status(args: StatusArgs) -> ExitCode {
    let mut conn = match open("status", &args.db).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let mut options = operations::StatusOptions::new(args.db.table.clone())
        .mode(args.mode)
        .stall_after(args.stall_after)
        .slot_lag_warn_bytes(args.slot_lag_warn_bytes);
    options.slot = args.slot;
    options.publication = args.publication;
    options.partitions = args.partitions;
    let status = match operations::status(&mut conn, &options).await {
        Ok(s) => s,
        Err(e) => return fail("status", format!("cannot read {}: {e}", args.db.table)),
    };
    if args.json {
        match serde_json::to_string_pretty(&status) {
            Ok(s) => println!("{s}"),
            Err(e) => return fail("status", format!("{e}")),
        }
    } else {
        print!("{status}");
    }
    if status.stalled {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

async fn cleanup(args: CleanupCmdArgs) -> ExitCode {
    let mut conn = match open("cleanup", &args.db).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let never = CancellationToken::new();
    match outbox_nats::cleanup::sweep(
        &mut conn,
        &args.db.table,
        args.archive_table.as_ref(),
        args.retention,
        args.batch,
        &never,
    )
    .await
    {
        Ok(n) => {
            let verb = if args.archive_table.is_some() {
                "archived"
            } else {
                "deleted"
            };
            println!(
                "{verb} {n} published row(s) older than {}",
                humantime::format_duration(args.retention)
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(
            "cleanup",
            format!("cannot delete from {}: {e}", args.db.table),
        ),
    }
}

/// Runs `work` on a blocking connection of its own to `url` (synchronous Diesel, as `rotate` and
/// `index` are; the URL's TLS settings are libpq's): its outcome, or why it did not run.
async fn on_blocking_connection<T: Send + 'static>(
    url: String,
    work: impl FnOnce(&mut diesel::PgConnection) -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    use diesel::Connection;
    tokio::task::spawn_blocking(move || {
        let mut conn = diesel::PgConnection::establish(&url).map_err(|e| {
            format!(
                "cannot connect to PostgreSQL at {}: {e}; {CONNECT_HINT}",
                redact_url(&url)
            )
        })?;
        work(&mut conn)
    })
    .await
    .unwrap_or_else(|e| Err(format!("it stopped: {e}")))
}

/// `outbox-relay index`: [`outbox_diesel::create_partition_index`].
async fn index(args: IndexArgs) -> ExitCode {
    let (table, n) = (args.db.table.clone(), args.partitions);
    let done = on_blocking_connection(args.db.database_url.clone(), move |conn| {
        outbox_diesel::create_partition_index(conn, &table, n)
            .map_err(|e| format!("cannot make the partition index of {table}: {e}"))
    })
    .await;
    let name = outbox_diesel::partition_index_name(&args.db.table, n);
    match done {
        Ok(true) => {
            println!(
                "{name} made on {}: relays with --partitions {n} read each partition they own by it",
                args.db.table
            );
            ExitCode::SUCCESS
        }
        Ok(false) => {
            println!("{name} is on {} already: left as it is", args.db.table);
            ExitCode::SUCCESS
        }
        Err(msg) => fail("index", msg),
    }
}

/// `outbox-relay rotate`: [`outbox_diesel::partition_table`], over a blocking connection of
/// its own (the conversion is synchronous Diesel; the URL's TLS settings are libpq's).
async fn rotate(args: RotateArgs) -> ExitCode {
    let rotation = outbox_diesel::Rotation::default()
        .partitions(args.partitions)
        .block_rows(args.block_rows);
    let table = args.db.table.clone();
    let done = on_blocking_connection(args.db.database_url.clone(), move |conn| {
        outbox_diesel::partition_table(conn, &table, rotation)
            .map_err(|e| format!("cannot turn {table} into a ring of partitions: {e}"))
    })
    .await;
    match done {
        Ok(true) => {
            println!(
                "{} is now a ring of {} partitions ({}_r0 to {}_r{}) of {} rows each",
                args.db.table,
                args.partitions,
                args.db.table.name(),
                args.db.table.name(),
                args.partitions - 1,
                args.block_rows
            );
            ExitCode::SUCCESS
        }
        Ok(false) => {
            println!(
                "{} is a partitioned table already: left as it is",
                args.db.table
            );
            ExitCode::SUCCESS
        }
        Err(msg) => fail("rotate", msg),
    }
}
