//! A first start beside running writers, switching between ordered and log tailing under load,
//! a dropped slot, a retried row and cleanup.

use super::*;

/// Writers commit before, while and after the relay makes its slot: the rows committed
/// before the slot's consistent point come from its exported snapshot, the rest from the
/// slot, with no gap between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_start_beside_running_writers_publishes_every_event_once_in_order() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let ledger = Ledger::default();
    let pause = Duration::from_millis(2);
    let writers = start_paced_writers(&db, &Outbox::default(), 0, 4, 400, 2, pause, &ledger);
    wait_until(Duration::from_secs(30), "rows before the relay", || async {
        db.scalar("SELECT count(*) FROM outbox") >= 300
    })
    .await;
    let _relay = relay("relay", &db, &stream, &slot, &[]);
    join_all(writers);
    wait_count(&stream, 3_200, Duration::from_secs(120)).await;
    assert_stream_holds(&stream, &ledger).await;
}

/// The README's switch from `ordered` to `log-tailing`, writers committing throughout: start
/// the log-tailing relay, then stop the ordered one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_from_ordered_to_log_tailing_under_load_loses_nothing() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let mut ordered = Proc::spawn("ordered", &mut relay_command(&db, &stream, &[]));
    let ledger = Ledger::default();
    let pause = Duration::from_millis(2);
    let writers = start_paced_writers(&db, &Outbox::default(), 0, 4, 500, 2, pause, &ledger);
    wait_count(&stream, 400, Duration::from_secs(30)).await;
    let _tailing = relay("tailing", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;
    ordered.signal("TERM");
    assert_eq!(ordered.wait_exit(Duration::from_secs(30)), Some(0));
    assert!(
        writers.iter().any(|w| !w.is_finished()),
        "the writers still commit after the switch"
    );
    join_all(writers);
    wait_count(&stream, 4_000, Duration::from_secs(120)).await;
    assert_stream_holds(&stream, &ledger).await;
}

/// The README's switch from `log-tailing` back to `ordered`, writers committing throughout:
/// stop the log-tailing relay, start the ordered one, drop the slot and its record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_from_log_tailing_to_ordered_under_load_loses_nothing() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let mut tailing = relay("tailing", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;
    let ledger = Ledger::default();
    let pause = Duration::from_millis(2);
    let writers = start_paced_writers(&db, &Outbox::default(), 0, 4, 500, 2, pause, &ledger);
    wait_count(&stream, 400, Duration::from_secs(30)).await;
    tailing.signal("TERM");
    assert_eq!(tailing.wait_exit(Duration::from_secs(30)), Some(0));
    let _ordered = Proc::spawn("ordered", &mut relay_command(&db, &stream, &[]));
    support::slot::drop_slot(db.admin_url(), &slot.name);
    diesel::sql_query(format!(
        "DELETE FROM outbox_relay_slots WHERE slot_name = '{}'",
        slot.name
    ))
    .execute(&mut db.conn())
    .expect("the slot's record");
    assert!(
        writers.iter().any(|w| !w.is_finished()),
        "the writers still commit after the switch"
    );
    join_all(writers);
    wait_count(&stream, 4_000, Duration::from_secs(120)).await;
    assert_stream_holds(&stream, &ledger).await;
}

/// Runs the relay until it exits (within `timeout`); its exit code and what it logged.
fn run_to_exit(
    db: &TestDb,
    stream: &TestStream,
    args: &[&str],
    timeout: Duration,
) -> (i32, String) {
    let mut child = relay_command(db, stream, args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    let start = Instant::now();
    let code = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status.code().unwrap_or(-1);
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the relay did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    (code, err)
}

/// A slot dropped under a running reader (as a failover to a standby without it would lose
/// it): the relay stops with an error that says what may be lost and how to recover, a
/// restart refuses likewise, and `--recover-slot` publishes again what the table still
/// holds, so every event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_slot_stops_the_relay_and_recover_slot_publishes_what_may_be_missing() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let mut first = relay("relay", &db, &stream, &slot, &[]);
    wait_reader(&db, &slot).await;
    let ledger = Ledger::default();
    join_all(start_writers(&db, &Outbox::default(), 2, 50, 1, &ledger));
    wait_count(&stream, 100, Duration::from_secs(30)).await;
    support::slot::drop_slot(db.admin_url(), &slot.name);
    // recorded while the slot is gone: no slot will ever send these
    join_all(start_writers_from(
        &db,
        &Outbox::default(),
        2,
        2,
        25,
        1,
        &ledger,
    ));
    assert_eq!(
        first.wait_exit(Duration::from_secs(30)),
        Some(1),
        "the relay stops"
    );
    let args = ["--mode", "log-tailing", "--slot", &slot.name];
    let (code, err) = run_to_exit(&db, &stream, &args, Duration::from_secs(60));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("is missing") && err.contains("--recover-slot"),
        "{err}"
    );
    assert!(!slot.exists(&db), "no slot made silently");
    let _recovered = relay("recovered", &db, &stream, &slot, &["--recover-slot"]);
    wait_count(&stream, 150, Duration::from_secs(60)).await;
    assert_stream_holds(&stream, &ledger).await;
}

/// `outbox-relay retry` releases a parked row while the reader lags behind a backlog and the
/// cleanup of captured rows runs meanwhile: the row, old and below the confirmed `seq`, was
/// deleted before the reader read its release, and never published. It is published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_row_is_published_once_when_cleanup_runs_before_the_reader_sees_the_release() {
    use async_nats::jetstream::stream::Config;
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let config = |max_message_size| Config {
        max_message_size,
        ..stream.config()
    };
    let js = stream.js().await;
    js.create_stream(config(1000)).await.expect("stream");
    let _relay = relay(
        "relay",
        &db,
        &stream,
        &slot,
        &[
            "--max-attempts",
            "2",
            "--captured-retention",
            "0s",
            "--captured-cleanup-interval",
            "100ms",
        ],
    );
    wait_reader(&db, &slot).await;
    let mut conn = db.conn();
    let big = Changed {
        account: "P".into(),
        n: 1,
        blob: Some("x".repeat(2000)),
    };
    let poison = conn.transaction(|c| c.record_event(&big)).expect("record");
    wait_until(Duration::from_secs(60), "the event parked", || async {
        db.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL") == 1
    })
    .await;
    js.update_stream(config(-1)).await.expect("limit lifted");
    // a backlog the reader takes a while to publish, then the release behind it
    let ledger = Ledger::default();
    join_all(start_writers(&db, &Outbox::default(), 2, 40, 50, &ledger));
    let out = Command::new(relay_bin())
        .args(["retry", "--all"])
        .env("DATABASE_URL", &db.url)
        .output()
        .expect("retry");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_count(&stream, 4_001, Duration::from_secs(60)).await;
    let got = stream.read_all().await;
    let ids: Vec<&str> = got.iter().map(|m| m.msg_id.as_str()).collect();
    assert_eq!(
        ids.iter().filter(|id| **id == poison.to_string()).count(),
        1,
        "the retried event published once"
    );
    assert_eq!(got.len(), 4_001);
    wait_until(Duration::from_secs(30), "captured rows deleted", || async {
        db.scalar("SELECT count(*) FROM outbox") == 0
    })
    .await;
}
