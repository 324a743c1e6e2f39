//! A relay paused with SIGSTOP (5).

use super::*;

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
