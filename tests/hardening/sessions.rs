//! Sessions that wait on slow acks keep their work.

use super::*;

/// The backend pids of the relay's publishing sessions.
fn relay_sessions(db: &TestDb) -> Vec<i32> {
    #[derive(QueryableByName)]
    struct P {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
    }
    let rows: Vec<P> = diesel::sql_query(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
         AND datname = current_database() ORDER BY pid",
    )
    .load(&mut db.conn())
    .expect("sessions");
    rows.into_iter().map(|p| p.pid).collect()
}

// 12. Acks slower than the lease: a relay waiting for them keeps its session (the unordered
// mode's claim transaction holds its rows; the ordered mode's session holds its partitions),
// and the idle timeouts must not end it and hand its work to another relay.
async fn session_survives_acks_slower_than_the_lease(args: &[&str]) {
    let db = TestDb::new();
    let nats = NatsServer::start();
    let stream = TestStream::on(&nats.url());
    let mut all = vec!["--lease", "3s"];
    all.extend_from_slice(args);
    let unordered = args.contains(&"unordered");
    let _relay = Proc::spawn("relay", &mut relay_command(&db, &stream, &all));
    record(&mut db.conn(), 1, 1);
    wait_published(&db, 1, Duration::from_secs(30)).await;
    let before = relay_sessions(&db);
    assert_eq!(before.len(), 1, "{before:?}");

    // JetStream stalls for 4.5 s (within the client's 5 s ack timeout, past the 3 s lease)
    // right when the relay has sent a batch
    nats.pause();
    record(&mut db.conn(), 20, 5);
    if unordered {
        wait_until(Duration::from_secs(5), "the batch claimed", || async {
            db.scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' \
                 AND datname = current_database() AND state = 'idle in transaction'",
            ) == 1
        })
        .await;
    } else {
        // woken by the commit's notification, the relay reads and sends the rows at once
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_millis(4500)).await;
    nats.resume();

    wait_published(&db, 21, Duration::from_secs(30)).await;
    assert_eq!(
        relay_sessions(&db),
        before,
        "the relay's session was ended while it waited for acks"
    );
    assert_eq!(stream.count().await, 21);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unordered_claim_survives_acks_slower_than_the_lease() {
    session_survives_acks_slower_than_the_lease(&["--mode", "unordered", "--workers", "1"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_session_survives_acks_slower_than_the_lease() {
    session_survives_acks_slower_than_the_lease(&["--no-cleanup"]).await;
}
