//! Bad input (7): malformed configuration, a missing table, a stream that does not capture the
//! subjects, an empty aggregate id, unreachable servers.

use super::*;

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
