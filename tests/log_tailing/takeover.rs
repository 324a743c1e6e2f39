//! The reader killed or paused, and its standby taking over.

use super::*;

#[tokio::test]
async fn relay_killed_between_publish_and_slot_advance_repeats_but_never_skips() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let args = ["--batch-size", "100000", "--max-in-flight", "64"];
    let mut relay1 = relay("relay-1", &db, &stream, &slot, &args);
    wait_reader(&db, &slot).await;
    let before = slot.confirmed(&db);

    // one transaction of 8,000 events: the slot can only move past it once all are acked
    let events: Vec<Changed> = (0..8_000)
        .map(|n| changed(&format!("acct-{}", n % 50), n))
        .collect();
    let ids = db
        .conn()
        .transaction(|c| c.record_events(&events))
        .expect("commit");
    let commit_end = db.scalar("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint");
    wait_count(&stream, 1, Duration::from_secs(30)).await;
    relay1.kill(); // kill -9: published in part, not confirmed
    let published = stream.count().await;
    assert!(
        published > 0 && published < 8_000,
        "killed mid-transaction ({published} published)"
    );
    assert!(
        slot.confirmed(&db) < commit_end,
        "the slot did not move past an unacked transaction"
    );
    assert!(slot.confirmed(&db) >= before);

    let _relay2 = relay("relay-2", &db, &stream, &slot, &args);
    wait_count(&stream, 8_000, Duration::from_secs(240)).await;
    wait_until(
        Duration::from_secs(30),
        "the slot confirmed past the transaction",
        || async { slot.confirmed(&db) >= commit_end },
    )
    .await;
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    for (e, id) in events.iter().zip(&ids) {
        expected
            .entry(e.account.clone())
            .or_default()
            .push(id.to_string());
    }
    assert_exactly_once_in_order(&stream.read_all().await, &expected);
}

#[tokio::test]
async fn standby_takes_over_when_the_active_reader_dies() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let mut a = relay("relay-a", &db, &stream, &slot, &[]);
    let reader_a = wait_reader(&db, &slot).await;
    let _b = relay("relay-b", &db, &stream, &slot, &[]);
    // b connects and stands by: a keeps the slot
    wait_until(Duration::from_secs(30), "relay b connected", || async {
        db.scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' AND datname = current_database()") >= 2
    })
    .await;
    assert_eq!(slot.reader(&db), Some(reader_a));

    let mut conn = db.conn();
    let mut expected: Vec<String> = Vec::new();
    expected.extend(record_each(&mut conn, "S", 0..50));
    wait_count(&stream, 50, Duration::from_secs(30)).await;

    a.kill();
    expected.extend(record_each(&mut conn, "S", 50..100));
    wait_count(&stream, 100, Duration::from_secs(30)).await;
    let reader_b = slot.reader(&db).expect("b reads the slot");
    assert_ne!(reader_b, reader_a, "the standby took over");
    let got = stream_ids(&stream).await;
    assert_eq!(got, expected, "every event once, in commit order");
}

#[tokio::test]
async fn a_paused_reader_is_replaced_and_does_not_publish_after_it_wakes() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let args = ["--lease", "3s"];
    let a = relay("relay-a", &db, &stream, &slot, &args);
    let reader_a = wait_reader(&db, &slot).await;
    let _b = relay("relay-b", &db, &stream, &slot, &args);
    tokio::time::sleep(Duration::from_millis(500)).await;

    a.signal("STOP");
    let mut conn = db.conn();
    let mut expected = Vec::new();
    expected.extend(record_each(&mut conn, "P", 0..20));
    // PostgreSQL ends a's silent session after the lease; b takes the slot
    wait_count(&stream, 20, Duration::from_secs(30)).await;
    let reader_b = slot.reader(&db).expect("b reads");
    assert_ne!(reader_b, reader_a);

    a.signal("CONT");
    tokio::time::sleep(Duration::from_secs(1)).await;
    expected.extend(record_each(&mut conn, "P", 20..40));
    wait_count(&stream, 40, Duration::from_secs(30)).await;
    assert_eq!(
        slot.reader(&db),
        Some(reader_b),
        "b keeps the slot after a wakes"
    );
    let got = stream_ids(&stream).await;
    assert_eq!(got, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_kills_during_twenty_thousand_events_deliver_each_exactly_once_in_commit_order() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let args = ["--batch-size", "2000"];
    let mut current = relay("relay-0", &db, &stream, &slot, &args);
    wait_reader(&db, &slot).await;

    // 4 writers x 1,250 transactions x 4 events; half of them delete right after inserting
    let ledger = Ledger::default();
    let mut writers = start_writers(&db, &Outbox::default(), 2, 1_250, 4, &ledger);
    writers.extend(start_writers_from(
        &db,
        &Outbox::default().delete_after_insert(true),
        2,
        2,
        1_250,
        4,
        &ledger,
    ));
    let start = Instant::now();
    let mut kills = 0;
    for k in 1..=10u64 {
        wait_count(&stream, k * 1_800, Duration::from_secs(120)).await;
        current.kill();
        kills += 1;
        current = relay(&format!("relay-{k}"), &db, &stream, &slot, &args);
    }
    join_all(writers);
    wait_count(&stream, 20_000, Duration::from_secs(180)).await;
    eprintln!(
        "{kills} kills, 20,000 events in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    drop(current);
    assert_stream_holds(&stream, &ledger).await;
}

/// A reader that stops cleanly tells the relays standing by (`NOTIFY` on the table's members'
/// channel), and one takes the slot at once, not at its next look. In-process relays: the
/// CLI does not set the look's interval, here 20 s.
#[tokio::test]
async fn a_standby_takes_the_slot_at_once_when_the_reader_stops() {
    type InProcessRelay = support::task::Running<outbox_nats::RelayError>;
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let relay = || async {
        let mut config = outbox_nats::RelayConfig::new(db.url.clone())
            .stream(stream.name.clone())
            .subject_prefix(stream.prefix.clone())
            .poll_interval(Duration::from_millis(20))
            .startup_timeout(Duration::from_secs(10))
            .lease(Duration::from_secs(60));
        config.mode = outbox_nats::LogTailing::default()
            .slot(slot.name.clone())
            .into();
        config.standby_interval = Duration::from_secs(20);
        let nats = async_nats::connect(&stream.nats_url)
            .await
            .expect("connect to NATS");
        let relay = outbox_nats::Relay::new(config, nats);
        InProcessRelay::spawn("relay", move |shutdown| relay.run(shutdown))
    };
    let sessions = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
                    AND backend_type = 'client backend' AND datname = current_database()";
    let a = relay().await;
    let reader_a = wait_reader(&db, &slot).await;
    let before = db.scalar(sessions);
    let b = relay().await;
    wait_until(Duration::from_secs(30), "b connected", || async {
        db.scalar(sessions) > before
    })
    .await;
    // past b's first look at the slot: its next is 20 s away
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(slot.reader(&db), Some(reader_a), "a keeps the slot");

    a.stop().await;
    wait_until(
        Duration::from_secs(5),
        "the relay standing by reads the slot at once",
        || async { slot.reader(&db).is_some_and(|r| r != reader_a) && slot.streaming(&db) },
    )
    .await;
    let mut conn = db.conn();
    let mut expected = Vec::new();
    expected.extend(record_each(&mut conn, "H", 0..20));
    wait_count(&stream, 20, Duration::from_secs(30)).await;
    b.stop().await;
    let got = stream_ids(&stream).await;
    assert_eq!(got, expected);
}

/// A relay standing by tries the slot's lock at each look (every second): the try is
/// prepared once per session and runs on its cached plan, where each was a statement of
/// `sql_query`, sent, parsed and planned again at every look.
#[tokio::test]
async fn a_standby_tries_the_slots_lock_on_its_cached_plan() {
    let (_cluster, db) = TestDb::counting_statements();
    let stream = TestStream::new();
    let slot = Slot::new(&db);
    let _a = relay("relay-a", &db, &stream, &slot, &[]);
    let reader = wait_reader(&db, &slot).await;
    let _b = relay("relay-b", &db, &stream, &slot, &[]);
    let tries = || db.calls_and_plans("SELECT pg_try_advisory_lock(%hashtext(%");
    wait_until(
        Duration::from_secs(30),
        "b tries the slot's lock",
        || async { tries().0 >= 2 },
    )
    .await;
    let (calls, plans) = tries();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (calls, plans) = (tries().0 - calls, tries().1 - plans);
    assert!(
        calls >= 2 && plans == 0,
        "the standby's tries: {calls} calls, {plans} plans in 3 s"
    );
    assert_eq!(slot.reader(&db), Some(reader), "a keeps the slot");
}
