//! What arrives, and in which order: interleaved transactions in commit order, TOAST-sized
//! payloads, many events in one transaction, a transaction longer than the lease in bounded
//! memory, many small transactions, a rollback.

use super::*;

#[tokio::test]
async fn interleaved_transactions_arrive_in_commit_order_not_seq_order() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;

    // T1 records a1, a2 (lower seqs); T2 records a3 and commits first; T1 commits after
    let (mut c1, mut c2) = (db.conn(), db.conn());
    let mut t2_id = None;
    let t1_ids = c1
        .transaction(|c1| {
            let ids = c1.record_events(&[changed("A", 1), changed("A", 2)])?;
            t2_id = Some(c2.transaction(|c2| c2.record_event(&changed("A", 3)))?);
            Ok::<_, diesel::result::Error>(ids)
        })
        .expect("t1");
    let t2_id = t2_id.expect("t2");
    // a third transaction, after both
    let t3_id = db
        .conn()
        .transaction(|c| c.record_event(&changed("A", 4)))
        .expect("t3");
    let seq = |id: &uuid::Uuid| db.scalar(&format!("SELECT seq FROM outbox WHERE id = '{id}'"));
    assert!(seq(&t1_ids[0]) < seq(&t2_id), "T1 inserted first");

    wait_count(&stream, 4, Duration::from_secs(30)).await;
    let got = stream_ids(&stream).await;
    let commit_order = [t2_id, t1_ids[0], t1_ids[1], t3_id].map(|id| id.to_string());
    assert_eq!(got, commit_order, "commit order, not seq order");
}

#[tokio::test]
async fn toast_sized_payloads_arrive_whole() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;

    // random text does not compress, so PostgreSQL stores it out of line (TOAST)
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut noise = |bytes: usize| -> String {
        (0..bytes)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                char::from(b"0123456789abcdefghijklmnopqrstuv"[(state % 32) as usize])
            })
            .collect()
    };
    let sizes = [2_100, 9_000, 120_000, 700_000];
    let events: Vec<Changed> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| Changed {
            account: "T".into(),
            n: i as i64,
            blob: Some(noise(n)),
        })
        .collect();
    let mut conn = db.conn();
    conn.transaction(|c| c.record_events(&events[..2]))
        .expect("two in one transaction");
    conn.transaction(|c| c.record_event(&events[2]))
        .expect("one");
    conn.transaction(|c| c.record_event(&events[3]))
        .expect("one");
    assert!(
        db.scalar(
            "SELECT pg_total_relation_size(reltoastrelid) FROM pg_class WHERE relname = 'outbox'"
        ) > 100_000,
        "the payloads are TOASTed"
    );

    wait_count(&stream, 4, Duration::from_secs(30)).await;
    let got = stream.read_all().await;
    assert_eq!(got.len(), 4);
    for (m, e) in got.iter().zip(&events) {
        assert_eq!(m.payload["n"], e.n);
        assert_eq!(
            m.payload["blob"].as_str(),
            e.blob.as_deref(),
            "payload {} whole",
            e.n
        );
    }
}

#[tokio::test]
async fn many_events_in_one_transaction_arrive_whole_and_in_order() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    // a transaction larger than the batch size is handed to the publisher in parts
    let _relay = relay("relay", &db, &stream, &slot, &["--batch-size", "200"]);
    wait_reader(&db, &slot).await;

    let events: Vec<Changed> = (0..5_000)
        .map(|n| changed(&format!("acct-{}", n % 10), n))
        .collect();
    let ids = db
        .conn()
        .transaction(|c| c.record_events(&events))
        .expect("one transaction");
    wait_count(&stream, 5_000, Duration::from_secs(180)).await;
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    for (e, id) in events.iter().zip(&ids) {
        expected
            .entry(e.account.clone())
            .or_default()
            .push(id.to_string());
    }
    assert_exactly_once_in_order(&stream.read_all().await, &expected);
}

/// One transaction of `n` events of one aggregate, each with a 10 kB payload, relayed with
/// `--lease 3s` and a 1 MiB `--max-batch-bytes`, published one ack round trip at a time. The
/// reader used to read it whole (its memory grew with the
/// transaction) without a word to its session meanwhile, so PostgreSQL ended the session, the
/// reader read the same transaction again, and the slot never passed it. Returns what the
/// relay's peak RSS grew by from before the commit (its own, about 23 MiB in a debug build,
/// is left out) and how long the transaction took, from commit to the slot confirmed past it.
/// Publishing 20,000 events takes about 2.5 s in a debug build, under the lease: with
/// `stall_broker` the relay publishes to a broker of its own, frozen for a second after every
/// quarter of a second for the first four seconds from the commit, so that the transaction
/// takes longer than the lease however fast the relay and the machine are. Each freeze is shorter than half the lease, and
/// the relay queries its session before it sends once half the lease has passed.
async fn one_large_transaction(n: u32, check_order: bool, stall_broker: bool) -> (u64, Duration) {
    let nats = stall_broker.then(|| Arc::new(NatsServer::start()));
    let db = TestDb::new();
    let stream = match &nats {
        Some(nats) => TestStream::on(&nats.url()),
        None => TestStream::new(),
    };
    let slot = Slot::new(&db);
    let tail = relay(
        "relay",
        &db,
        &stream,
        &slot,
        &["--lease", "3s", "--max-batch-bytes", "1048576"],
    );
    let reader = wait_reader(&db, &slot).await;
    let before = tail.peak_rss();

    diesel::sql_query(format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'account', 'L', 'account.changed', \
         jsonb_build_object('n', i, 'blob', repeat(md5(i::text), 320)) \
         FROM generate_series(1, {n}) AS i"
    ))
    .execute(&mut db.conn())
    .expect("one transaction");
    let committed = Instant::now();
    let stalls = nats.map(|nats| {
        let done = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&done);
        let thread = std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) && committed.elapsed() < Duration::from_secs(4) {
                std::thread::sleep(Duration::from_millis(250));
                nats.pause();
                std::thread::sleep(Duration::from_secs(1));
                nats.resume();
            }
            nats
        });
        (done, thread)
    });
    let timeout = Duration::from_secs(60 + u64::from(n) / 100);
    let target = db.scalar("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint");
    wait_until(
        timeout,
        "the slot confirmed past the transaction",
        || async {
            // the lease holds: the session that read the slot at the start still does
            assert_eq!(
                slot.reader(&db),
                Some(reader),
                "the reader's session was ended and the slot changed hands"
            );
            slot.confirmed(&db) >= target
        },
    )
    .await;
    let took = committed.elapsed();
    // the broker answers again, and stays up until the stream is read
    let _nats = stalls.map(|(done, thread)| {
        done.store(true, Ordering::Relaxed);
        thread.join().expect("the thread freezing the broker")
    });
    let grown = tail.peak_rss().saturating_sub(before);
    assert_eq!(stream.count().await, u64::from(n), "exactly {n} messages");
    if check_order {
        let order: Vec<i64> = stream
            .read_all()
            .await
            .iter()
            .map(|m| m.payload["n"].as_i64().unwrap_or(-1))
            .collect();
        assert!(
            order.iter().copied().eq(1..=i64::from(n)),
            "the events in commit order"
        );
    }
    println!(
        "{n} events of 10 kB in one transaction: slot confirmed past it after {:.1} s, relay peak RSS {:.1} MiB, {:.1} MiB over its own before the commit ({})",
        took.as_secs_f64(),
        tail.peak_rss() as f64 / 1048576.0,
        grown as f64 / 1048576.0,
        tail.memory()
    );
    (grown, took)
}

/// What the relay's peak RSS may grow by with a 1 MiB budget, over its own before the commit:
/// the part being published and the next (2 MiB), the replication client's buffer of 64
/// received changes (0.7 MB), their decoded and published copies, and what the allocator keeps
/// of what was freed on each thread. Measured in a debug build: 4.4-9.5 MiB, alone, beside the
/// rest of its binary's tests or beside four busy loops; once 41.3 in CI (the bound was 40 MiB
/// of the whole process, which 41.4 passed once before). With a 64 MiB budget it grows by 255
/// MiB: holding the transaction (200 MB, 500 MB in the long version), or a third of it, goes
/// past the bound.
const LARGE_TRANSACTION_RSS_GROWTH: u64 = 64 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_longer_than_the_lease_passes_in_bounded_memory() {
    let (grown, took) = one_large_transaction(20_000, true, true).await;
    assert!(
        took > Duration::from_secs(3),
        "longer than the lease: {took:?}"
    );
    assert!(
        grown < LARGE_TRANSACTION_RSS_GROWTH,
        "peak RSS grew by {:.1} MiB",
        grown as f64 / 1048576.0
    );
}

/// The scenario: 50,000 events of 10 kB (about 500 MB) in one transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: 500 MB in one transaction; run with --ignored"]
async fn long_a_transaction_of_50000_events_longer_than_the_lease_passes_in_bounded_memory() {
    let (grown, _) = one_large_transaction(50_000, false, false).await;
    assert!(
        grown < LARGE_TRANSACTION_RSS_GROWTH,
        "peak RSS grew by {:.1} MiB",
        grown as f64 / 1048576.0
    );
}

/// Rows of 900 KB payloads (under NATS's default 1 MiB `max_payload`), each committed on its
/// own while the broker is frozen, read by a relay with a 1 MiB `--max-batch-bytes`: it holds
/// one in flight, and the replication client receives a count of messages ahead of its reads,
/// sized for small events. With 256 (each such transaction is three messages) the relay's
/// peak RSS grew by 50.9-58.7 MiB while the broker was frozen and by 67-74 in all; with 64, by
/// 13-17 and 27-36 (debug build).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_broker_leaves_few_large_rows_received_ahead() {
    const ROWS: u64 = 300;
    let nats = NatsServer::start();
    let (db, stream) = (TestDb::new(), TestStream::on(&nats.url()));
    let slot = Slot::new(&db);
    let tail = relay(
        "relay",
        &db,
        &stream,
        &slot,
        &["--max-batch-bytes", "1048576"],
    );
    wait_reader(&db, &slot).await;
    let before = tail.peak_rss();
    // the relay waits for an ack meanwhile: the rows wait in the WAL, or in what it received
    nats.pause();
    let mut conn = db.conn();
    for i in 0..ROWS {
        diesel::sql_query(format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), 'blob', 'b-{i}', 'blob.stored', \
             jsonb_build_object('n', {i}, 'data', repeat(md5('{i}'), 28125)))"
        ))
        .execute(&mut conn)
        .expect("a row of 900 KB");
    }
    // the fault itself: a second for the server to send what the relay will take
    tokio::time::sleep(Duration::from_secs(1)).await;
    let held = tail.peak_rss().saturating_sub(before);
    nats.resume();
    wait_count(&stream, ROWS, Duration::from_secs(120)).await;
    // the peak so far (VmHWM), while the relay runs on
    let grown = tail.peak_rss().saturating_sub(before);
    println!(
        "{ROWS} rows of 900 KB: relay peak RSS grew by {:.1} MiB while the broker was frozen, by {:.1} MiB in all ({})",
        held as f64 / 1048576.0,
        grown as f64 / 1048576.0,
        tail.memory()
    );
    assert_eq!(stream.count().await, ROWS);
    assert!(
        held < 40 << 20,
        "peak RSS grew by {:.1} MiB while the broker was frozen",
        held as f64 / 1048576.0
    );
    // the drain: the window, its copies, the client's read-ahead and what the allocator keeps;
    // the rows committed are 270 MB
    assert!(
        grown < 96 << 20,
        "peak RSS grew by {:.1} MiB",
        grown as f64 / 1048576.0
    );
}

#[tokio::test]
async fn many_small_transactions_arrive_exactly_once_in_commit_order() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;

    let ledger = Ledger::default();
    join_all(start_writers(&db, &Outbox::default(), 4, 750, 1, &ledger));
    wait_count(&stream, 3_000, Duration::from_secs(180)).await;
    assert_stream_holds(&stream, &ledger).await;
}

#[tokio::test]
async fn rolled_back_transaction_publishes_nothing() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay("relay", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;

    let mut conn = db.conn();
    let rolled_back = conn.transaction(|c| {
        c.record_events(&[changed("R", 1), changed("R", 2)])?;
        Err::<(), _>(diesel::result::Error::RollbackTransaction)
    });
    assert!(rolled_back.is_err());
    // a savepoint rolled back inside a committed transaction publishes nothing either
    let kept = conn
        .transaction(|c| {
            let inner = c.transaction(|c| {
                c.record_event(&changed("R", 3))?;
                Err::<(), _>(diesel::result::Error::RollbackTransaction)
            });
            assert!(inner.is_err());
            c.record_event(&changed("K", 1))
        })
        .expect("commit");

    wait_count(&stream, 1, Duration::from_secs(30)).await;
    // give a wrongly published event time to show up
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got = stream.read_all().await;
    assert_eq!(got.len(), 1, "only the committed event: {got:?}");
    assert_eq!(got[0].msg_id, kept.to_string());
}
