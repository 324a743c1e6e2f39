//! The streaming reader's reads against a real slot: a read of what has arrived does not go
//! on with a steady stream, and a wait for the next message loses nothing.

use diesel_async::AsyncPgConnection;
use outbox_diesel::OutboxTable;
use outbox_diesel::wal::{WalBatch, WalReader};

use super::*;

/// A streaming reader of `slot` (made with [`Slot::create`]), set up, and its session.
async fn streaming_reader(db: &TestDb, slot: &Slot) -> (WalReader, AsyncPgConnection) {
    let mut conn = db.async_conn().await;
    let mut reader = WalReader::new(OutboxTable::DEFAULT, slot.name.clone(), "outbox_pub")
        .streaming(&db.url, Duration::from_millis(100))
        .expect("a streaming reader");
    reader.setup(&mut conn).await.expect("the slot set up");
    (reader, conn)
}

/// Reads until a transaction has come whole; its events' ids. The slot is confirmed past it
/// (a slot's server pings a reader that confirms nothing).
async fn read_transaction(reader: &mut WalReader, conn: &mut AsyncPgConnection) -> Vec<String> {
    let mut ids = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let batch: WalBatch = reader
            .read_within(conn, 1_000, usize::MAX, Duration::from_millis(200))
            .await
            .expect("a read");
        for t in batch.transactions {
            ids.extend(t.rows.iter().map(|r| r.id.to_string()));
            if let Some(end) = t.end_lsn {
                reader.advance(conn, end).await.expect("confirmed");
                return ids;
            }
        }
    }
    panic!("no whole transaction within 10 s (read so far: {ids:?})");
}

/// A read of what has arrived (`wait` zero) while commits keep coming, a fraction of a
/// millisecond apart: it returns what was there and what came within a millisecond. It took
/// each message that came within a timer's tick of the one before, with no bound, so a read
/// went on for as long as the messages kept coming that close, up to its limits, and held the
/// first transactions it had read for that long.
#[tokio::test(flavor = "multi_thread")]
async fn a_read_of_what_has_arrived_returns_while_commits_keep_coming() {
    let db = TestDb::new();
    let slot = Slot::create(&db);
    let (mut reader, mut conn) = streaming_reader(&db, &slot).await;
    // four writers commit one event per transaction as fast as they can (about 2,700 a
    // second here): the stream's messages come a fraction of a millisecond apart
    let writing = Duration::from_secs(3);
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let url = db.url.clone();
            std::thread::spawn(move || {
                let mut conn = PgConnection::establish(&url).expect("connect");
                let until = Instant::now() + writing;
                let mut n = 0;
                while Instant::now() < until {
                    conn.transaction(|c| c.record_event(&changed(&format!("acct-{w}"), n)))
                        .expect("commit");
                    n += 1;
                }
                n
            })
        })
        .collect();
    // the writers' first commits
    read_transaction(&mut reader, &mut conn).await;
    let mut slowest = Duration::ZERO;
    let mut reading = Duration::ZERO;
    let mut reads = 0;
    let mut read = 1;
    let until = Instant::now() + writing;
    while Instant::now() < until {
        // a few milliseconds of commits arrive meanwhile
        tokio::time::sleep(Duration::from_millis(5)).await;
        let started = Instant::now();
        let batch = reader
            .read_within(&mut conn, 100_000, usize::MAX, Duration::ZERO)
            .await
            .expect("a read");
        slowest = slowest.max(started.elapsed());
        reading += started.elapsed();
        reads += 1;
        read += batch.transactions.len();
    }
    let committed: i64 = writers.into_iter().map(|w| w.join().expect("writer")).sum();
    assert!(
        committed > 1_000 && read > 500,
        "the writers kept committing ({committed} transactions, {read} read)"
    );
    // about 1.7 ms on this machine (a read takes what comes within a millisecond of its first
    // message; the slowest 4-5 ms); 6-7 ms (the slowest 35-69 ms) when a read took each
    // message that came within a timer's tick of the one before, with no bound
    let mean = reading / reads;
    assert!(
        mean < Duration::from_micros(3_500),
        "a read of what had arrived took {mean:?} on average, the slowest {slowest:?} ({reads} reads, {read} transactions) while commits kept coming"
    );
    reader.close(&mut conn).await.expect("closed");
}

/// [`WalReader::wait_readable`] returns by its deadline on a quiet slot (the server's
/// keepalives may make it true: nothing is read then), and once a commit arrives, whose
/// events the next reads return whole; a wait dropped before anything came loses nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_wait_for_the_next_message_keeps_it_for_the_read() {
    let db = TestDb::new();
    let slot = Slot::create(&db);
    let (mut reader, mut conn) = streaming_reader(&db, &slot).await;
    // the first read connects; nothing has committed
    let empty = reader
        .read_within(&mut conn, 1_000, usize::MAX, Duration::from_millis(200))
        .await
        .expect("a read");
    assert!(empty.transactions.is_empty());
    let started = Instant::now();
    reader
        .wait_readable(tokio::time::Instant::now() + Duration::from_millis(300))
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "by its deadline"
    );
    let empty = reader
        .read_within(&mut conn, 1_000, usize::MAX, Duration::ZERO)
        .await
        .expect("a read");
    assert!(empty.transactions.is_empty(), "nothing was committed");

    let mut writer = db.conn();
    let a = writer
        .transaction(|c| c.record_event(&changed("acct-a", 1)))
        .expect("commit")
        .to_string();
    let readable = reader
        .wait_readable(tokio::time::Instant::now() + Duration::from_secs(10))
        .await;
    assert!(readable, "the commit arrives");
    assert_eq!(read_transaction(&mut reader, &mut conn).await, vec![a]);

    // a wait dropped before a commit came (or ended by a keepalive), then a commit
    tokio::select! {
        _ = reader.wait_readable(tokio::time::Instant::now() + Duration::from_secs(10)) => {}
        () = tokio::time::sleep(Duration::from_millis(100)) => {}
    }
    let b = writer
        .transaction(|c| c.record_event(&changed("acct-b", 1)))
        .expect("commit")
        .to_string();
    assert_eq!(read_transaction(&mut reader, &mut conn).await, vec![b]);
    reader.close(&mut conn).await.expect("closed");
}
