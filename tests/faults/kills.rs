//! Relays SIGKILLed at random points (1), and writers SIGKILLed between their business write and
//! their commit, or failing (2).

use super::*;

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
