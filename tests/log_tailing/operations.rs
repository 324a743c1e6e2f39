//! What operators see and set: `status`, roles without `REPLICATION`, a poison event parked and
//! retried, a publication name that needs quoting, the slot's lag as a metric.

use super::*;

#[tokio::test]
async fn status_reports_the_slot_lag_and_its_reader() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let relay_proc = relay("relay", &db, &stream, &slot, &[]);
    let reader = wait_reader(&db, &slot).await;
    db.conn()
        .transaction(|c| c.record_event(&changed("X", 1)))
        .expect("commit");
    wait_count(&stream, 1, Duration::from_secs(30)).await;

    let status = |extra: &[&str]| {
        let out = Command::new(relay_bin())
            .env("DATABASE_URL", &db.url)
            .args(["status", "--mode", "log-tailing", "--slot", &slot.name])
            .args(extra)
            .output()
            .expect("run outbox-relay status");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, out) = status(&["--json"]);
    assert_eq!(code, 0, "{out}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(json["slot"]["slot"], slot.name.as_str());
    assert!(json["slot"]["lag_bytes"].as_i64().is_some(), "{out}");
    assert_eq!(json["slot"]["reader_pid"].as_i64(), Some(reader), "{out}");
    assert_eq!(json["stalled"], false);
    let (code, out) = status(&[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("slot lag"), "{out}");

    // no reader: events wait in the slot, and status says it stalls
    drop(relay_proc);
    db.conn()
        .transaction(|c| c.record_event(&changed("X", 2)))
        .expect("commit");
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let (code, out) = status(&["--json", "--stall-after", "1s"]);
    let json: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(code, 1, "{out}");
    assert!(
        json["slot"]["lag_seconds"]
            .as_f64()
            .is_some_and(|s| s >= 1.0),
        "{out}"
    );
    assert_eq!(json["slot"]["reader_pid"], serde_json::Value::Null, "{out}");
}

#[tokio::test]
async fn a_role_without_replication_gets_a_clear_error() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let (role, url) = role_without_replication(&db, &slot);
    let mut conn = db.conn();
    diesel::sql_query("CREATE PUBLICATION lt_pub FOR TABLE outbox")
        .execute(&mut conn)
        .expect("publication");
    let out = relay_command(
        &db,
        &stream,
        &[
            "--mode",
            "log-tailing",
            "--slot",
            &slot.name,
            "--publication",
            "lt_pub",
        ],
    )
    .env("DATABASE_URL", &url)
    .output()
    .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("REPLICATION"), "{err}");
    drop(conn);
    drop_role(&db, &role);
}

/// The slot and the publication made beforehand by a superuser: the relay's role still needs
/// `REPLICATION` to stream the slot, and hears so at start-up instead of retrying for ever.
#[tokio::test]
async fn a_role_without_replication_cannot_stream_a_slot_made_for_it() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::create(&db);
    let (role, url) = role_without_replication(&db, &slot);
    let out = relay_command(
        &db,
        &stream,
        &["--mode", "log-tailing", "--slot", &slot.name],
    )
    .env("DATABASE_URL", &url)
    .output()
    .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("refused a replication connection") && err.contains("REPLICATION"),
        "{err}"
    );
    assert_eq!(stream.count().await, 0);
    drop_role(&db, &role);
}

/// A login role named after the slot (roles are cluster-wide) with the table rights of a
/// log-tailing relay but not `REPLICATION`, and the test database's URL as that role.
fn role_without_replication(db: &TestDb, slot: &Slot) -> (String, String) {
    let role = format!("lt_role_{}", &slot.name[3..]);
    let mut conn = db.conn();
    diesel::sql_query(format!("CREATE ROLE {role} LOGIN"))
        .execute(&mut conn)
        .expect("role");
    diesel::sql_query(format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO {role}"
    ))
    .execute(&mut conn)
    .expect("grant");
    let url = db.url.replacen("postgres@", &format!("{role}@"), 1);
    (role, url)
}

fn drop_role(db: &TestDb, role: &str) {
    let _ = diesel::sql_query(format!("DROP OWNED BY {role}")).execute(&mut db.conn());
    let mut admin = PgConnection::establish(db.admin_url()).expect("admin");
    let _ = diesel::sql_query(format!("DROP ROLE IF EXISTS {role}")).execute(&mut admin);
}

#[tokio::test]
async fn a_poison_event_is_parked_passed_over_and_published_again_on_retry() {
    use async_nats::jetstream::stream::Config;
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    // a stream that refuses messages over 1,000 bytes, as a server's limits can
    let config = |max_message_size| Config {
        max_message_size,
        ..stream.config()
    };
    let js = stream.js().await;
    js.create_stream(config(1000)).await.expect("stream");
    let _relay = relay("relay", &db, &stream, &slot, &["--max-attempts", "2"]);
    wait_reader(&db, &slot).await;

    // recorded with delete-after-insert: the parked event is written back to the table
    let outbox = Outbox::default().delete_after_insert(true);
    let mut conn = db.conn();
    let big = Changed {
        account: "P".into(),
        n: 1,
        blob: Some("x".repeat(2000)),
    };
    let poison = conn
        .transaction(|c| c.record_event_in(&outbox, &big))
        .expect("p1");
    let mut expected = Vec::new();
    for (agg, n) in [("P", 2), ("Q", 1), ("Q", 2)] {
        expected.push(
            conn.transaction(|c| c.record_event_in(&outbox, &changed(agg, n)))
                .expect("commit")
                .to_string(),
        );
    }
    wait_count(&stream, 3, Duration::from_secs(30)).await;
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) FROM outbox WHERE id = '{poison}' AND parked_at IS NOT NULL \
             AND last_error IS NOT NULL AND attempts = 2"
        )),
        1,
        "the poison event is parked in the table"
    );
    let got = stream_ids(&stream).await;
    assert_eq!(got, expected, "the log passed over it");

    let cli = |args: &[&str]| {
        let out = Command::new(relay_bin())
            .env("DATABASE_URL", &db.url)
            .args(args)
            .output()
            .expect("run outbox-relay");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let parked: serde_json::Value =
        serde_json::from_str(&cli(&["parked", "--json"])).expect("json");
    assert_eq!(parked[0]["id"], poison.to_string().as_str());

    js.update_stream(config(-1))
        .await
        .expect("allow big messages");
    assert!(cli(&["retry", "--all"]).contains("released 1"));
    wait_count(&stream, 4, Duration::from_secs(30)).await;
    let got = stream.read_all().await;
    assert_eq!(got[3].msg_id, poison.to_string(), "published once released");
    assert_eq!(got[3].payload["blob"].as_str().map(str::len), Some(2000));
}

/// A publication whose name needs quoting (capitals, a hyphen) is created and streamed
/// under that exact name.
#[tokio::test]
async fn a_publication_name_that_needs_quoting_is_streamed() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let slot = Slot::new(&db);
    let _relay = relay(
        "relay",
        &db,
        &stream,
        &slot,
        &["--publication", "Outbox-Pub"],
    );
    wait_reader(&db, &slot).await;
    assert_eq!(
        db.scalar("SELECT count(*) FROM pg_publication WHERE pubname = 'Outbox-Pub'"),
        1,
        "the publication under its exact name"
    );
    let id = db
        .conn()
        .transaction(|c| c.record_event(&changed("Q", 1)))
        .expect("record");
    wait_count(&stream, 1, Duration::from_secs(30)).await;
    assert_eq!(stream.read_all().await[0].msg_id, id.to_string());
}

/// The value of the unlabelled metric `name` on the relay's `/metrics` at `addr`.
async fn metric(addr: &str, name: &str) -> Option<f64> {
    let (_, body) = support::http_get(addr, "/metrics").await?;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_lag_in_seconds_is_the_age_of_the_oldest_unconfirmed_commit() {
    let mut nats = support::servers::NatsServer::start();
    let (db, stream) = (TestDb::new(), TestStream::on(&nats.url()));
    let slot = Slot::new(&db);
    let addr = format!("127.0.0.1:{}", support::free_port());
    let _relay = relay(
        "relay",
        &db,
        &stream,
        &slot,
        &["--metrics-addr", &addr, "--stats-interval", "200ms"],
    );
    wait_reader(&db, &slot).await;
    // NATS gone: the commit is read and never acked, so the slot is not confirmed past it
    nats.stop();
    let committed = Instant::now();
    db.conn()
        .transaction(|c| c.record_event(&changed("L", 1)))
        .expect("commit");
    wait_until(
        Duration::from_secs(30),
        "a slot lag of a second",
        || async {
            metric(&addr, "outbox_slot_lag_seconds")
                .await
                .is_some_and(|s| s >= 1.0)
        },
    )
    .await;
    let lag = metric(&addr, "outbox_slot_lag_seconds")
        .await
        .unwrap_or_default();
    let age = committed.elapsed().as_secs_f64();
    assert!(
        lag <= age + 1.0,
        "the slot lags {lag} s behind a commit made {age} s ago"
    );
    nats.restart();
    wait_count(&stream, 1, Duration::from_secs(30)).await;
}
