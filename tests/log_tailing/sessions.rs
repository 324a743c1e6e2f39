//! The reader's session kept while nothing is sent on it: an idle reader, a slot waiting for a
//! long transaction, acks slower than the lease.

use super::*;

/// `--stats-interval` longer than `--lease`: an idle reader's only queries used to be the
/// stats, so PostgreSQL ended its session after the lease and the slot changed hands. The
/// reader renews its session while it waits.
#[tokio::test]
async fn an_idle_reader_keeps_its_session_when_stats_are_rarer_than_the_lease() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay(
        "relay",
        &db,
        &stream,
        &slot,
        &["--lease", "3s", "--stats-interval", "1h"],
    );
    let reader = wait_reader(&db, &slot).await;
    // idle for more than two leases
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(
        slot.reader(&db),
        Some(reader),
        "the same session still reads the slot"
    );
    let id = db
        .conn()
        .transaction(|c| c.record_event(&changed("I", 1)))
        .expect("record");
    wait_count(&stream, 1, Duration::from_secs(30)).await;
    assert_eq!(stream.read_all().await[0].msg_id, id.to_string());
    assert_eq!(slot.reader(&db), Some(reader));
}

/// Making the slot waits for every transaction running at that moment to end. A transaction
/// held open for more than two leases must not cost the reader its session (PostgreSQL ends a
/// session silent for the lease): the same session makes the slot, and every event comes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_keeps_its_session_while_making_its_slot_waits_for_a_long_transaction() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let before = db
        .conn()
        .transaction(|c| c.record_event(&changed("B", 1)))
        .expect("record");
    // a transaction with an id, held open across the slot's creation
    let (release, held) = std::sync::mpsc::channel::<()>();
    let (began, began_wait) = std::sync::mpsc::channel::<()>();
    let mut open = db.conn();
    let holder = std::thread::spawn(move || {
        open.transaction(|c| {
            c.record_event(&changed("H", 1))?;
            began.send(()).ok();
            held.recv().ok();
            Ok::<_, diesel::result::Error>(())
        })
        .expect("the held transaction commits");
    });
    began_wait.recv().expect("the transaction began");
    let _relay = relay("relay", &db, &stream, &slot, &["--lease", "3s"]);
    wait_until(Duration::from_secs(30), "the reader's lock", || async {
        slot.reader(&db).is_some()
    })
    .await;
    let reader = slot.reader(&db);
    // more than two leases while the slot waits for the held transaction
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert_eq!(
        slot.reader(&db),
        reader,
        "the session that began making the slot still holds it"
    );
    release.send(()).expect("end the held transaction");
    holder.join().expect("the holder");
    wait_count(&stream, 2, Duration::from_secs(60)).await;
    assert_eq!(slot.reader(&db), reader, "and reads it");
    let ids: Vec<String> = stream
        .read_all()
        .await
        .into_iter()
        .map(|m| m.msg_id)
        .collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert!(ids.contains(&before.to_string()), "{ids:?}");
}

/// Acks slower than the lease (the broker frozen for 4.5 s, within the client's 5 s ack
/// timeout, past a 3 s lease): the reader waiting for them keeps its session, which holds the
/// slot's lock, and its replication connection; PostgreSQL's idle timeout does not end them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reader_keeps_its_session_while_acks_are_slower_than_the_lease() {
    let nats = support::servers::NatsServer::start();
    let (db, stream) = (TestDb::new(), TestStream::on(&nats.url()));
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, &["--lease", "3s"]);
    let reader = wait_reader(&db, &slot).await;
    let sessions = || {
        db.strings(
            "SELECT pid::text FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
             AND datname = current_database() ORDER BY pid",
        )
    };
    let before = sessions();
    assert!(!before.is_empty());

    nats.pause();
    db.conn()
        .transaction(|c| {
            let events: Vec<Changed> = (0..20)
                .map(|i| changed(&format!("K{}", i % 5), i))
                .collect();
            c.record_events(&events)
        })
        .expect("commit");
    // the reader gets the transaction from the slot at once and sends it; the acks come
    // within the client's 5 s timeout
    tokio::time::sleep(Duration::from_millis(4500)).await;
    nats.resume();

    wait_count(&stream, 20, Duration::from_secs(30)).await;
    assert_eq!(
        (slot.reader(&db), sessions()),
        (Some(reader), before),
        "the reader's sessions were ended while it waited for acks"
    );
    assert_eq!(stream.count().await, 20);
}
