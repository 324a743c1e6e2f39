//! What a newcomer meets first: the relay's answer to a wrong `DATABASE_URL` (at once, exit 2,
//! with the server's reason) or to a server that is not up yet (retried, with the reason), its
//! logs when they go to a file, and its start-up line.
//!
//! Build the binaries first: `cargo build --workspace --bins --examples`.

mod support;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{Proc, TestDb, TestStream, free_port, pg_base, relay_bin, relay_command};

/// Runs `cmd` to its exit (within `timeout`): exit code, stdout, stderr, and how long it took.
fn run_to_exit(cmd: &mut Command, timeout: Duration) -> (Option<i32>, String, String, Duration) {
    let started = Instant::now();
    let mut p = Proc::spawn(
        "outbox-relay",
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()),
    );
    let out = support::read_in_background(p.child.stdout.take().expect("stdout"));
    let err = support::read_in_background(p.child.stderr.take().expect("stderr"));
    let code = p.wait_exit(timeout);
    p.kill();
    let elapsed = started.elapsed();
    (
        code,
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
        elapsed,
    )
}

/// `outbox-relay run` against `database_url`.
fn relay_against(database_url: &str, stream: &TestStream, startup_timeout: &str) -> Command {
    let mut cmd = Command::new(relay_bin());
    cmd.arg("run")
        .env_clear()
        .env("RUST_LOG", "info")
        .env("DATABASE_URL", database_url)
        .env("NATS_URL", &stream.nats_url)
        .args(["--stream", &stream.name, "--subject-prefix", &stream.prefix])
        .args(["--startup-timeout", startup_timeout]);
    cmd
}

/// The server's `postgres://user@host:port` with `path` appended.
fn on_server(path: &str) -> String {
    format!("{}/{path}", pg_base())
}

#[test]
fn a_database_that_does_not_exist_fails_at_once_with_exit_2_and_the_servers_reason() {
    let stream = TestStream::new();
    let name = format!("no_such_db_{}", uuid::Uuid::now_v7().simple());
    let (code, _, stderr, took) = run_to_exit(
        &mut relay_against(&on_server(&name), &stream, "30s"),
        Duration::from_secs(25),
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(took < Duration::from_secs(10), "not retried: took {took:?}");
    assert!(
        stderr.contains(&format!("database \"{name}\" does not exist")),
        "the server's reason: {stderr}"
    );
    assert!(stderr.contains("create it"), "what to do: {stderr}");
    assert!(!stderr.contains("retrying"), "not retried: {stderr}");
}

/// A newcomer's first start often has both wrong: a database name with a typo and a NATS
/// server not started yet. The database's answer comes at once, not after NATS's start-up
/// timeout.
#[test]
fn a_database_that_does_not_exist_fails_at_once_while_nats_is_not_up_yet() {
    let stream = TestStream::new();
    let name = format!("no_such_db_{}", uuid::Uuid::now_v7().simple());
    let mut cmd = relay_against(&on_server(&name), &stream, "60s");
    // nothing listens there
    cmd.env("NATS_URL", format!("nats://127.0.0.1:{}", free_port()));
    let (code, _, stderr, took) = run_to_exit(&mut cmd, Duration::from_secs(50));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(took < Duration::from_secs(10), "not retried: took {took:?}");
    assert!(
        stderr.contains(&format!("database \"{name}\" does not exist")),
        "the server's reason: {stderr}"
    );
}

#[test]
fn a_database_url_that_does_not_parse_fails_at_once_with_exit_2_saying_what_to_give() {
    let stream = TestStream::new();
    let (code, _, stderr, took) = run_to_exit(
        &mut relay_against("http://127.0.0.1:5432/app", &stream, "30s"),
        Duration::from_secs(25),
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(took < Duration::from_secs(10), "not retried: took {took:?}");
    assert!(stderr.contains("invalid connection string"), "{stderr}");
    assert!(
        stderr.contains("postgres://USER"),
        "the form to give: {stderr}"
    );
    assert!(!stderr.contains("retrying"), "not retried: {stderr}");
}

#[test]
fn a_role_that_does_not_exist_fails_at_once_with_exit_2_and_the_servers_reason() {
    let stream = TestStream::new();
    let db = TestDb::new();
    let role = format!(
        "no_such_role_{}",
        &uuid::Uuid::now_v7().simple().to_string()[20..]
    );
    let host = pg_base()
        .rsplit('@')
        .next()
        .unwrap_or("127.0.0.1:5432")
        .to_owned();
    let url = format!("postgres://{role}:pw@{host}/{}", db.name);
    let (code, _, stderr, took) = run_to_exit(
        &mut relay_against(&url, &stream, "30s"),
        Duration::from_secs(25),
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(took < Duration::from_secs(10), "not retried: took {took:?}");
    assert!(
        stderr.contains(&format!("role \"{role}\" does not exist")),
        "the server's reason: {stderr}"
    );
    assert!(stderr.contains("user name and password"), "{stderr}");
}

#[test]
fn a_refused_connection_is_retried_until_the_startup_timeout_and_keeps_the_reason() {
    let stream = TestStream::new();
    let port = free_port();
    let mut cmd = relay_against(
        &format!("postgres://postgres@127.0.0.1:{port}/app"),
        &stream,
        "2s",
    );
    let (code, _, stderr, took) = run_to_exit(&mut cmd, Duration::from_secs(25));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        took >= Duration::from_secs(2),
        "retried for the timeout: {took:?}"
    );
    assert!(stderr.contains("retrying"), "{stderr}");
    let reason = format!("connection to server at \"127.0.0.1\", port {port} failed");
    assert!(
        stderr.contains(&reason) && stderr.contains("Connection refused"),
        "the reason, as libpq gives it: {stderr}"
    );
    assert!(
        stderr.contains("cannot connect to PostgreSQL within 2s"),
        "{stderr}"
    );
}

#[tokio::test]
async fn one_shot_commands_fail_with_exit_2_and_the_servers_reason() {
    let name = format!("no_such_db_{}", uuid::Uuid::now_v7().simple());
    let out = Command::new(relay_bin())
        .env_clear()
        .args(["status", "--database-url", &on_server(&name)])
        .output()
        .expect("run status");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("database \"{name}\" does not exist")),
        "{stderr}"
    );
}

/// Starts a relay with `args` at info level, waits for its start-up line, stops it; returns
/// the start-up line, everything on stderr and everything on stdout.
fn start_up_line(db: &TestDb, stream: &TestStream, args: &[&str]) -> (String, String, String) {
    use std::io::BufRead;
    let mut cmd = relay_command(db, stream, args);
    cmd.env("RUST_LOG", "info");
    let mut p = Proc::spawn(
        "outbox-relay",
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()),
    );
    let out = support::read_in_background(p.child.stdout.take().expect("stdout"));
    let mut stderr = std::io::BufReader::new(p.child.stderr.take().expect("stderr"));
    let mut logs = String::new();
    let started = loop {
        let mut line = String::new();
        if stderr.read_line(&mut line).unwrap_or(0) == 0 {
            panic!("the relay exited before it started:\n{logs}");
        }
        logs.push_str(&line);
        if line.contains("outbox relay started") {
            break line;
        }
    };
    p.signal("TERM");
    assert_eq!(p.wait_exit(Duration::from_secs(20)), Some(0), "{logs}");
    let _ = stderr.read_to_string(&mut logs);
    (started, logs, out.join().unwrap_or_default())
}

#[test]
fn the_start_up_line_shows_the_settings_of_its_mode_only() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let (ordered, _, _) = start_up_line(&db, &stream, &["--partitions", "3"]);
    assert!(
        ordered.contains("mode=ordered") && ordered.contains("partitions=3"),
        "{ordered}"
    );
    assert!(!ordered.contains("workers"), "{ordered}");
    let (unordered, _, _) = start_up_line(&db, &stream, &["--mode", "unordered", "--workers", "2"]);
    assert!(
        unordered.contains("mode=unordered") && unordered.contains("workers=2"),
        "{unordered}"
    );
    assert!(!unordered.contains("partitions"), "{unordered}");
}

#[test]
fn logs_go_to_stderr_as_plain_text_when_not_on_a_terminal() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let (_, logs, stdout) = start_up_line(&db, &stream, &[]);
    assert!(logs.contains(" INFO "), "{logs}");
    assert!(
        !logs.contains('\u{1b}'),
        "no colour codes in a pipe: {logs:?}"
    );
    assert_eq!(stdout, "", "`run` prints nothing but logs, on stderr");
}

/// On a terminal (a pseudo-terminal made by util-linux's `script`), logs are coloured unless
/// `NO_COLOR` is set.
#[test]
fn logs_on_a_terminal_are_coloured_unless_no_color_is_set() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: util-linux `script` is not installed");
        return;
    }
    let port = free_port();
    let on_terminal = |no_color: Option<&str>| {
        let line = format!(
            "{} run --database-url postgres://postgres@127.0.0.1:{port}/x --startup-timeout 1s",
            relay_bin().display()
        );
        let mut cmd = Command::new("script");
        cmd.args(["-qec", &line, "/dev/null"])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .env("NATS_URL", format!("nats://127.0.0.1:{}", free_port()));
        if let Some(v) = no_color {
            cmd.env("NO_COLOR", v);
        }
        let out = cmd.output().expect("run under script");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let coloured = on_terminal(None);
    assert!(
        coloured.contains("\u{1b}["),
        "colours on a terminal: {coloured:?}"
    );
    let plain = on_terminal(Some("1"));
    assert!(plain.contains("NATS"), "{plain:?}");
    assert!(!plain.contains("\u{1b}["), "NO_COLOR: {plain:?}");
}

/// Replicas of a service starting together, each running the migrations (or making its
/// outbox table) at start: every one succeeds, and the table is made once.
#[test]
fn replicas_starting_together_migrate_the_outbox_once_and_all_succeed() {
    const REPLICAS: usize = 6;
    for round in 0..3 {
        let db = TestDb::empty();
        let table: outbox_diesel::OutboxTable = "billing_events".parse().expect("a valid name");
        let start = std::sync::Arc::new(std::sync::Barrier::new(REPLICAS));
        let replicas: Vec<_> = (0..REPLICAS)
            .map(|i| {
                let (url, start, table) = (db.url.clone(), start.clone(), table.clone());
                std::thread::spawn(move || -> Result<(), String> {
                    use diesel::Connection;
                    let mut conn =
                        diesel::PgConnection::establish(&url).map_err(|e| e.to_string())?;
                    start.wait();
                    if i % 2 == 0 {
                        outbox_diesel::run_migrations(&mut conn)
                            .map(drop)
                            .map_err(|e| format!("run_migrations: {e}"))
                    } else {
                        outbox_diesel::create_table(&mut conn, &table)
                            .map_err(|e| format!("create_table: {e}"))
                    }
                })
            })
            .collect();
        let failures: Vec<String> = replicas
            .into_iter()
            .filter_map(|r| r.join().expect("a replica thread").err())
            .collect();
        assert!(failures.is_empty(), "round {round}: {failures:?}");
        assert_eq!(
            db.scalar("SELECT count(*) FROM __diesel_schema_migrations"),
            5,
            "each migration recorded once"
        );
        assert_eq!(db.scalar("SELECT count(*) FROM outbox"), 0);
        assert_eq!(db.scalar("SELECT count(*) FROM billing_events"), 0);
    }
}

/// A relay's start checks that it can read the table with the backlog's statement: it ran
/// it, counting every unpublished row at every start (a relay restarted on a backlog of
/// millions read them all before it published, and each relay of a table did so). Now it
/// plans the statement without reading a row. The relay here stops at its next start-up step
/// (the stream captures other subjects: exit 1), so that the rows read are its checks'
/// alone: PostgreSQL's statistics show none of a 20,000-row backlog read.
#[tokio::test]
async fn a_relay_start_reads_no_row_of_the_backlog() {
    let stream = TestStream::new();
    let db = TestDb::new();
    db.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || (i % 100), 'order.placed', '{}' \
         FROM generate_series(1, 20000) AS i",
        "a backlog",
    );
    stream
        .js()
        .await
        .create_stream(async_nats::jetstream::stream::Config {
            name: stream.name.clone(),
            subjects: vec![format!("{}-other.>", stream.prefix)],
            ..Default::default()
        })
        .await
        .expect("a stream on other subjects");
    let rows_read = |db: &TestDb| {
        db.scalar(
            "SELECT (COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0))::int8 \
             FROM pg_stat_user_tables WHERE relname = 'outbox'",
        )
    };
    let before = rows_read(&db);
    let (code, _, stderr, _) = run_to_exit(
        &mut relay_against(&db.url, &stream, "5s"),
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1), "{stderr}");
    // the checks' session has ended; its statistics reach the views within a second
    std::thread::sleep(Duration::from_millis(1_500));
    let read = rows_read(&db) - before;
    assert!(read < 1_000, "{read} rows read at the start");
}
