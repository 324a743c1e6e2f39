//! The NATS server down, started after the relays or restarted mid-run (3), and PostgreSQL: the
//! relays' sessions terminated, a private cluster restarted (4).

use super::*;

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
