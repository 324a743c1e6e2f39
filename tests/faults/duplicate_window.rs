//! Past the duplicate window: the relay down after publishing and before marking (6), NATS
//! unreachable after storing messages whose acks were lost (9), a relay paused with publishes in
//! its buffers, and the fence (10).

use super::*;

diesel::table! {
    consumer_effects (event_id) {
        event_id -> Uuid,
        applied -> Integer,
    }
}

/// A consumer that applies each message in its own transaction, behind the inbox; returns
/// (applied, skipped as already processed).
async fn consume_with_inbox(db: &TestDb, stream: &TestStream, total: usize) -> (usize, usize) {
    let js = stream.js().await;
    let consumer = js
        .get_stream(&stream.name)
        .await
        .expect("the stream")
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("fault-consumer".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .expect("a durable consumer");
    let mut messages = consumer.messages().await.expect("consume");
    let mut conn = db.conn();
    let (mut applied, mut skipped) = (0, 0);
    for _ in 0..total {
        let m = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .expect("the next message in time")
            .expect("a message")
            .expect("no error");
        let id = m
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|v| v.as_str().to_owned())
            .expect("a message id");
        let event_id: uuid::Uuid = id.parse().expect("a UUID message id");
        let new = conn
            .transaction(|c| {
                if !c.mark_processed("fault-consumer", &id)? {
                    return Ok::<_, diesel::result::Error>(false);
                }
                diesel::insert_into(consumer_effects::table)
                    .values((
                        consumer_effects::event_id.eq(event_id),
                        consumer_effects::applied.eq(1),
                    ))
                    .on_conflict(consumer_effects::event_id)
                    .do_update()
                    .set(consumer_effects::applied.eq(consumer_effects::applied + 1))
                    .execute(c)?;
                Ok(true)
            })
            .expect("the consumer's transaction");
        m.ack().await.expect("ack after commit");
        if new {
            applied += 1;
        } else {
            skipped += 1;
        }
    }
    (applied, skipped)
}

/// A stream of `stream`'s name capturing its prefix, with a 1 s duplicate window: what a
/// re-publish after it would store twice unless the relay reconciles.
async fn short_window_stream(stream: &TestStream) -> Duration {
    let window = Duration::from_secs(1);
    stream
        .js()
        .await
        .create_stream(jetstream::stream::Config {
            duplicate_window: window,
            ..stream.config()
        })
        .await
        .expect("a stream with a 1 s duplicate window");
    window
}

/// The relay (one, `args`) killed between ack and mark, its last 100 rows unmarked, and kept
/// down longer than the window: it must reconcile them, and a consumer behind the inbox sees
/// each event once.
async fn relay_down_past_the_window(test: &str, args: &[&str]) -> Report {
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let window = short_window_stream(&stream).await;
    diesel::sql_query(
        "CREATE TABLE consumer_effects (event_id uuid PRIMARY KEY, applied integer NOT NULL)",
    )
    .execute(&mut db.conn())
    .expect("the consumer's table");

    let args = args.iter().map(|a| a.to_string()).collect();
    let mut relays = Relays::start(&db, &stream, &logs, args, 1);
    let size = Size {
        events: 500,
        rate: 0,
        faults: 1,
    };
    let mut w = writer(
        &db,
        &logs,
        "writer",
        &["--count", "500", "--aggregates", "50", "--async-commit"],
    );
    assert_eq!(finished(&mut w, size).await, 500);
    drained(&db, None, size.timeout()).await;

    // the relay dies after JetStream acked its last batch and before it marked it
    relays.procs[0].kill();
    let unmarked = diesel::sql_query(
        "UPDATE outbox SET published_at = NULL WHERE seq IN \
         (SELECT seq FROM outbox ORDER BY seq DESC LIMIT 100)",
    )
    .execute(&mut db.conn())
    .expect("unmark the last batch");
    assert_eq!(unmarked, 100);
    // the ordered relay's record of it: its cursor goes back before the last 100 rows
    diesel::sql_query(
        "INSERT INTO outbox_progress (partitions, partition, upto_seq, snap) \
         SELECT DISTINCT ON (partitions, partition) partitions, partition, \
         (SELECT seq FROM outbox ORDER BY seq DESC OFFSET 100 LIMIT 1), pg_current_snapshot() \
         FROM outbox_progress ORDER BY partitions, partition, id DESC",
    )
    .execute(&mut db.conn())
    .expect("rewind the progress");
    // and stays down longer than the duplicate window (the fault itself, not a synchronisation)
    tokio::time::sleep(window * 2).await;
    relays.kill_and_restart(0);
    drained(&db, None, size.timeout()).await;
    drop(relays);

    let r = report(test, &db, &stream).await;
    r.assert_exact();
    assert_eq!(r.in_stream, 500, "{r}");

    let (applied, skipped) = consume_with_inbox(&db, &stream, r.in_stream).await;
    eprintln!("{test}: the inbox consumer applied {applied}, skipped {skipped} duplicates");
    assert_eq!((applied, skipped), (500, 0));
    assert_eq!(
        db.scalar("SELECT max(applied) FROM consumer_effects"),
        1,
        "no event applied twice"
    );
    assert_eq!(db.scalar("SELECT count(*) FROM consumer_effects"), 500);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_down_past_the_duplicate_window_reconciles_instead_of_republishing_ordered() {
    let r = relay_down_past_the_window("past_duplicate_window", &[]).await;
    assert_eq!(r.order_violations, 0, "per-aggregate order: {r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_down_past_the_duplicate_window_reconciles_instead_of_republishing_unordered() {
    relay_down_past_the_window(
        "past_duplicate_window_unordered",
        &["--mode", "unordered", "--workers", "2"],
    )
    .await;
}

/// Log tailing's reader SIGKILLed `kills` times while a writer commits, each time kept down
/// longer than the duplicate window: the transactions acked and not confirmed are read again
/// after the restart, and must be reconciled, not stored twice.
async fn reader_down_past_the_window(test: &str, size: Size, kills: usize) {
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let window = short_window_stream(&stream).await;
    let (args, slot) = Mode::LogTailing.setup(&db);
    let mut relays = Relays::start(&db, &stream, &logs, args, 1);
    let mut w = steady_writer(&db, &logs, size);
    let mut rng = Rng::new(test);
    for k in 1..=kills {
        next_fault(
            &db,
            Size {
                faults: kills,
                ..size
            },
            k,
            &mut rng,
        )
        .await;
        relays.procs[0].kill();
        // down longer than the window: the fault itself, not a synchronisation
        tokio::time::sleep(window * 2).await;
        relays.kill_and_restart(0);
    }
    let committed = finished(&mut w, size).await;
    assert_eq!(committed, size.events);
    drained(&db, slot.as_ref(), size.timeout()).await;
    drop(relays);
    let r = report(test, &db, &stream).await;
    Mode::LogTailing.assert(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reader_killed_and_down_past_the_duplicate_window_duplicates_nothing_log_tailing() {
    reader_down_past_the_window("reader_down_past_window", SHORT, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: 200,000 events, 20 kills each past the window"]
async fn long_reader_killed_20_times_past_the_duplicate_window_log_tailing() {
    reader_down_past_the_window("long_reader_down_past_window", LONG, 20).await;
}

// ---------------------------------------------------------------------------------------------
// 9. NATS unreachable longer than the duplicate window after storing messages whose acks
// were lost

/// The short run of scenario 9: slow enough that the writer still commits during each outage.
const SLOW: Size = Size {
    events: 3_000,
    rate: 200,
    faults: 2,
};

/// The relays reach NATS through a proxy. `outages` times, while a writer commits, the proxy
/// drops what the server sends for a second (the messages are stored, their acks lost), then
/// cuts the connections and refuses new ones for twice the duplicate window. The relays must
/// reconcile those messages, not store them again.
async fn acks_lost_past_the_window(test: &str, mode: Mode, size: Size, outages: usize) {
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let window = short_window_stream(&stream).await;
    let proxy = NatsProxy::start(&stream.nats_url);
    let (args, slot) = mode.setup(&db);
    let relays = Relays::start_via(&db, &stream, &logs, args, 1, Some(proxy.url()));
    let mut w = steady_writer(&db, &logs, size);
    let mut rng = Rng::new(test);
    let mut lost = 0;
    for k in 1..=outages {
        next_fault(
            &db,
            Size {
                faults: outages,
                ..size
            },
            k,
            &mut rng,
        )
        .await;
        // caught up, so that the rows sent next are fresh and go out without a look-up (the
        // replies to which the proxy would drop too)
        wait_until(size.timeout(), "the relay caught up", || async {
            stream.count().await as i64 >= db.scalar("SELECT count(*) FROM outbox_record") - 100
        })
        .await;
        let before = stream.count().await as i64;
        proxy.lose_replies();
        // what the relays send now is stored, its acks lost (the fault itself, not a
        // synchronisation: its length)
        tokio::time::sleep(Duration::from_secs(1)).await;
        proxy.down();
        lost += stream.count().await as i64 - before;
        // unreachable longer than the window: the fault itself, not a synchronisation
        tokio::time::sleep(window * 2).await;
        proxy.up();
    }
    eprintln!("{test}: {lost} messages stored while their acks were lost");
    assert!(
        lost > 0,
        "the outages lost no ack: the scenario did not happen"
    );
    let committed = finished(&mut w, size).await;
    assert_eq!(committed, size.events);
    drained(&db, slot.as_ref(), size.timeout()).await;
    drop(relays);
    let r = report(test, &db, &stream).await;
    mode.assert(&r);
}

per_mode! {
    acks_lost_past_the_window(SLOW, 2):
    nats_unreachable_past_the_duplicate_window_with_acks_lost_duplicates_nothing_ordered("acks_lost_ordered", Ordered),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_unreachable_past_the_duplicate_window_with_acks_lost_duplicates_nothing_log_tailing()
{
    acks_lost_past_the_window("acks_lost_log_tailing", Mode::LogTailing, SLOW, 2).await;
}

per_mode! {
    acks_lost_past_the_window(LONG, 10):
    #[ignore = "long: 200,000 events, 10 outages with acks lost"]
    long_nats_unreachable_10_times_with_acks_lost_duplicates_nothing_ordered("long_acks_lost_ordered", Ordered),
    #[ignore = "long: 200,000 events, 10 outages with acks lost"]
    long_nats_unreachable_10_times_with_acks_lost_duplicates_nothing_log_tailing("long_acks_lost_log_tailing", LogTailing),
}

// ---------------------------------------------------------------------------------------------
// 10. a relay paused past the duplicate window with publishes in its buffers, and the fence

/// Two relays share four partitions (ordered, lease 3 s) on a stream with a 1 s duplicate
/// window; relay A reaches NATS through a proxy. While a writer commits, the proxy holds what A
/// sends (standing for the buffers of a process stopped between its lease check and the
/// socket) and A is SIGSTOPped; B takes A's partitions over and publishes A's unacked rows and
/// newer ones; longer than the window after that, A resumes and what it had sent reaches the
/// server. Returns the checker's report and the publishes A had held.
async fn paused_past_the_window(test: &str, fence: bool) -> (Report, usize) {
    let _serial = SERIAL.lock().await;
    let (db, stream, logs) = (fault_db(TestDb::new()), TestStream::new(), Logs::new(test));
    let window = short_window_stream(&stream).await;
    let proxy = NatsProxy::start(&stream.nats_url);
    let mut rng = Rng::new(test);
    let mut args = Mode::Ordered.table_args(&db);
    args.extend(["--lease".to_string(), format!("{}s", LEASE.as_secs())]);
    if fence {
        args.push("--fence".into());
    }
    let a = Relays::start_via(&db, &stream, &logs, args.clone(), 1, Some(proxy.url()));
    let b = Relays::start(&db, &stream, &logs, args, 1);
    let size = Size {
        events: 3_000,
        rate: 500,
        faults: 1,
    };
    let mut w = steady_writer(&db, &logs, size);
    wait_until(
        Duration::from_secs(30),
        "two relays sharing the four partitions",
        || async { distinct_owners(&db) == (4, 2) },
    )
    .await;
    next_fault(&db, Size { faults: 2, ..size }, 1, &mut rng).await;
    // what A sends from now on stays in the proxy: A is paused once some of its publishes are
    // there. A may be between steps for a while (reading, waiting for a wake-up), or, with
    // the fence, waiting for the look-up of its subjects' last sequences, which the proxy
    // holds too: then the look-up is let through and the hold begins again as its answer
    // comes (each hold shorter than the lease, so A keeps its partitions meanwhile)
    let mut holds = 0;
    loop {
        proxy.hold();
        holds += 1;
        let until = Instant::now() + Duration::from_secs(1);
        while proxy.held_publishes() == 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if proxy.held_publishes() > 0 {
            break;
        }
        assert!(
            holds < 8,
            "relay A published nothing in {holds} holds of a second"
        );
        proxy.up();
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let stopped = Instant::now();
    a.procs[0].signal("STOP");
    let last = db.scalar("SELECT COALESCE(max(seq), 0) FROM outbox_record");
    wait_until(
        HANDOVER_BOUND * 2,
        "the paused relay's work taken over",
        || async {
            let left = db.scalar(&format!(
                "SELECT count(*) FROM outbox_audit WHERE seq <= {last} AND published_at IS NULL"
            ));
            left == 0 && distinct_owners(&db) == (4, 1)
        },
    )
    .await;
    // B has published A's unacked rows: A stays paused longer than the window after that
    // (the fault itself, not a synchronisation)
    tokio::time::sleep(window * 2).await;
    let held = proxy.held_publishes();
    proxy.up();
    a.procs[0].signal("CONT");
    eprintln!(
        "{test}: relay A paused {:?} with {held} publishes in its buffers (hold {holds})",
        stopped.elapsed()
    );
    assert!(
        held > 0,
        "relay A sent nothing while held: the scenario did not happen"
    );
    wait_until(
        Duration::from_secs(30),
        "the resumed relay back in the balance",
        || async { distinct_owners(&db) == (4, 2) },
    )
    .await;
    let committed = finished(&mut w, size).await;
    assert_eq!(committed, size.events);
    drained(&db, None, size.timeout()).await;
    drop((a, b));
    (report(test, &db, &stream).await, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_paused_past_the_duplicate_window_while_a_newer_owner_publishes_is_fenced_ordered() {
    let (r, _) = paused_past_the_window("paused_past_window_fenced", true).await;
    Mode::Ordered.assert(&r);
}

/// The same scenario without the fence (the default): what the paused relay had sent is
/// stored a second time, after newer events of its aggregates (the checker counts a second
/// copy as a duplicate only, not also as a reordering). It shows that the scenario happens,
/// and that the fence is what closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_paused_past_the_duplicate_window_without_the_fence_stores_duplicates() {
    if std::env::var_os("OUTBOX_TEST_FENCE").is_some() {
        eprintln!("OUTBOX_TEST_FENCE runs every relay with --fence: nothing to show here");
        return;
    }
    let (r, held) = paused_past_the_window("paused_past_window_unfenced", false).await;
    assert!(
        r.duplicates > 0 && r.duplicates <= held,
        "the held publishes stored again: {r}"
    );
}

/// The relay (ordered, one partition, `args` with `--fence`) publishes an event of aggregate `a1`; another
/// publisher then stores a message on `a1`'s subject, so that the sequence the relay expects
/// there is stale; the relay's next event of `a1` is refused by JetStream, and must be
/// published after all, once, neither counted as a failure of the row nor parked.
async fn stale_expected_sequence(test: &str, stream: &TestStream, args: &[&str]) {
    let db = TestDb::new();
    let relay = support::Relay::start(relay_command(&db, stream, args));
    let record = |account: &str, amount: i64| {
        db.conn()
            .transaction(|c| {
                c.record_event(&Credited {
                    account: account.into(),
                    amount,
                })
            })
            .expect("record");
    };
    let unpublished = || db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL");
    record("a1", 1);
    wait_until(
        Duration::from_secs(30),
        "the first event published",
        || async { unpublished() == 0 },
    )
    .await;
    let js = stream.js().await;
    js.publish(format!("{}.account.a1", stream.prefix), "{}".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    record("a1", 2);
    record("a2", 3);
    record("a1", 4);
    wait_until(Duration::from_secs(30), "every event published", || async {
        unpublished() == 0
    })
    .await;
    let logs = relay.logs();
    assert!(
        logs.contains("JetStream refused the event"),
        "the fence did not refuse the stale publish: {logs}"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL OR attempts > 0"),
        0,
        "a fenced row counted as failing: {logs}"
    );
    let ids: Vec<String> = {
        let mut conn = db.conn();
        diesel::sql_query("SELECT id::text AS id FROM outbox ORDER BY seq")
            .load::<IdRow>(&mut conn)
            .expect("ids")
            .into_iter()
            .map(|r| r.id)
            .collect()
    };
    let messages = stream.read_all().await;
    for id in &ids {
        let n = messages.iter().filter(|m| &m.msg_id == id).count();
        assert_eq!(n, 1, "event {id} stored {n} times");
    }
    assert_eq!(
        messages.len(),
        ids.len() + 1,
        "the relay's events and the other one"
    );
    // a1's events in their order, after the other publisher's message
    let a1: Vec<i64> = messages
        .iter()
        .filter(|m| m.aggregate_id == "a1")
        .map(|m| m.payload["amount"].as_i64().unwrap_or(-1))
        .collect();
    assert_eq!(a1, [1, 2, 4], "{test}: a1's events in order");
    eprintln!("{test}: the stale publish was refused, read again and published once");
}

#[derive(QueryableByName)]
struct IdRow {
    #[diesel(sql_type = diesel::sql_types::Text)]
    id: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_with_a_stale_expected_sequence_is_refused_and_the_row_neither_parked_nor_lost() {
    let stream = TestStream::new();
    stale_expected_sequence("stale_expected_sequence", &stream, &["--fence"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_refuses_a_stale_publish_on_a_replicated_stream() {
    let cluster = NatsCluster::start();
    let stream = TestStream::on(&cluster.urls());
    stale_expected_sequence(
        "stale_expected_sequence_r3",
        &stream,
        &["--fence", "--stream-replicas", "3"],
    )
    .await;
    let info = stream
        .js()
        .await
        .get_stream(&stream.name)
        .await
        .expect("the stream")
        .info()
        .await
        .expect("its info")
        .config
        .num_replicas;
    assert_eq!(info, 3, "the stream is replicated");
}
