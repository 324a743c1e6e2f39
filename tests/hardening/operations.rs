//! Operations: retry, status without the lock table, errors in another language.

use super::*;

// 10. `retry` releases the parked row and the rows held back behind it, which are published
// in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_releases_the_rows_held_back_behind_a_parked_one_in_order() {
    let db = TestDb::new();
    let stream = TestStream::new();
    record(&mut db.conn(), 1, 1);
    db.execute(
        "UPDATE outbox SET parked_at = now(), attempts = 5, last_error = 'rejected'",
        "park",
    );
    let parked_seq = db.scalar("SELECT min(seq) FROM outbox");
    record(&mut db.conn(), 30, 3); // acct-0 (behind the parked row), acct-1, acct-2
    let relay = Proc::spawn("relay", &mut relay_command(&db, &stream, &[]));
    wait_published(&db, 20, Duration::from_secs(30)).await;
    wait_until(
        Duration::from_secs(20),
        "acct-0's rows held back",
        || async { db.scalar("SELECT count(*) FROM outbox WHERE parked_at = '-infinity'") == 10 },
    )
    .await;
    let mut conn = db.async_conn().await;
    let released = outbox_diesel::relay::retry_parked(
        &mut conn,
        &outbox_diesel::OutboxTable::DEFAULT,
        Some(parked_seq),
    )
    .await
    .expect("retry");
    assert_eq!(
        released, 1,
        "one parked row released, with the 10 held back behind it"
    );
    // the relay's cursor had read past them: released (`'infinity'`), read apart
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL AND parked_at < 'infinity'"
        ),
        0
    );
    wait_published(&db, 31, Duration::from_secs(30)).await;
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL"),
        0,
        "published, the released rows are marked and no longer released"
    );
    drop(relay);
    let msgs = stream.read_all().await;
    let acct0: Vec<i64> = msgs
        .iter()
        .filter(|m| m.aggregate_id == "acct-0")
        .map(|m| m.payload["n"].as_i64().unwrap_or(-1))
        .collect();
    assert_eq!(acct0, vec![0, 0, 3, 6, 9, 12, 15, 18, 21, 24, 27]);
}

// ---------------------------------------------------------------------------------------------
// 21. `outbox-relay status` as a role that may not read the lock table (its database revoked
// `pg_lock_status` from PUBLIC, as a hardened one may): the membership and ownership queries
// failed, and status printed `relays 0` and "no relay holds a partition" while a relay held
// it. Now it says that those figures are unknown, and why (`unread` in the JSON).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_the_figures_it_cannot_read_instead_of_reporting_none() {
    let (db, stream) = (TestDb::new(), TestStream::new());
    let _relay = Relay::start(relay_command(&db, &stream, &[]));
    wait_until(
        Duration::from_secs(20),
        "the relay owns its partition",
        || async { support::partition_owners(&db).len() == 1 },
    )
    .await;
    let role = Role::relay(&db);
    db.execute(
        "REVOKE EXECUTE ON FUNCTION pg_lock_status() FROM PUBLIC",
        "revoke the lock table from PUBLIC in this database",
    );
    let status = |args: &[&str]| {
        let out = Command::new(support::relay_bin())
            .env_clear()
            .arg("status")
            .args(["--database-url", &role.url()])
            .args(args)
            .output()
            .expect("run outbox-relay status");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, text, err) = status(&[]);
    assert_eq!(code, Some(0), "the backlog is readable: {text}{err}");
    for line in ["relays           unknown: ", "owners           unknown: "] {
        assert!(text.contains(line), "{line:?} in:\n{text}");
    }
    assert!(
        text.contains("pg_lock_status"),
        "the server's reason:\n{text}"
    );
    assert!(!text.contains("relays           0"), "{text}");
    let (_, json, _) = status(&["--json"]);
    let json: serde_json::Value = serde_json::from_str(&json).expect("status --json");
    let unread: Vec<&str> = json["unread"]
        .as_array()
        .map(|a| a.iter().filter_map(|u| u["figure"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(unread, ["owners", "relays"], "{json}");
    // the table's owner reads everything: no `unread`
    let out = Command::new(support::relay_bin())
        .env_clear()
        .args(["status", "--json", "--database-url", &db.url])
        .output()
        .expect("run outbox-relay status");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json");
    assert!(json.get("unread").is_none(), "{json}");
    assert_eq!(json["relays"].as_array().map(Vec::len), Some(1), "{json}");
}

// 14. decisions on the server's state and codes, not on its words

/// Connects to `url` for the reader (diesel-async).
async fn reader_conn(url: &str) -> diesel_async::AsyncPgConnection {
    use diesel_async::AsyncConnection;
    diesel_async::AsyncPgConnection::establish(url)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_tailing_sorts_its_errors_alike_when_the_server_speaks_german() {
    use outbox_diesel::OutboxTable;
    use outbox_diesel::wal::{WalError, WalReader, pending_age_seconds};
    use support::servers::PgCluster;

    let mut cluster = PgCluster::start_german();
    let db = TestDb::on(&cluster.base_url());
    let mut admin = db.conn();
    let said = diesel::sql_query("SELECT 1/0")
        .execute(&mut admin)
        .expect_err("a division by zero")
        .to_string();
    assert!(
        said.contains("Division durch Null"),
        "the server speaks German: {said}"
    );
    // a role with the README's grants only: neither the table's owner nor REPLICATION, no
    // CREATE on the schema
    diesel::connection::SimpleConnection::batch_execute(
        &mut admin,
        &format!(
            "CREATE ROLE plain LOGIN; GRANT CONNECT ON DATABASE {} TO plain; \
             GRANT SELECT, UPDATE, DELETE ON outbox TO plain",
            db.name
        ),
    )
    .expect("a plain role");
    let plain_url = db.url.replacen("postgres@", "plain@", 1);
    let mut plain = reader_conn(&plain_url).await;
    let reader = || WalReader::new(OutboxTable::DEFAULT, "german_slot", "german_pub");

    let e = reader()
        .setup(&mut plain)
        .await
        .expect_err("no publication right");
    assert!(
        matches!(e, WalError::PublicationRight { .. }),
        "not the table's owner: {e:?}"
    );
    diesel::sql_query(
        "CREATE PUBLICATION german_pub FOR TABLE outbox WITH (publish = 'insert, update')",
    )
    .execute(&mut admin)
    .expect("the publication, made by the owner");
    let e = reader()
        .setup(&mut plain)
        .await
        .expect_err("no record right");
    assert!(
        matches!(e, WalError::RecordRight { .. }),
        "no CREATE on the schema: {e:?}"
    );
    // the owner's reader makes the record and the slot; the plain role may write the record
    let mut owner = reader_conn(&db.url).await;
    reader()
        .setup(&mut owner)
        .await
        .expect("the owner's set-up");
    diesel::sql_query("GRANT SELECT, INSERT, UPDATE ON outbox_relay_slots TO plain")
        .execute(&mut admin)
        .expect("grant the record");
    let e = WalReader::new(OutboxTable::DEFAULT, "german_other_slot", "german_pub")
        .setup(&mut plain)
        .await
        .expect_err("no replication right");
    assert!(
        matches!(e, WalError::ReplicationRight { .. }),
        "a role without REPLICATION makes a slot: {e:?}"
    );

    // the slot held by another session (as by a running reader) is busy, not a failure
    let mut holder = support::Proc::spawn(
        "pg_recvlogical",
        Command::new("pg_recvlogical")
            .args([
                "-d",
                &db.url,
                "--slot",
                "german_slot",
                "--start",
                "-f",
                "/dev/null",
            ])
            .args([
                "-o",
                "proto_version=1",
                "-o",
                "publication_names=german_pub",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    wait_until(Duration::from_secs(10), "the slot to be active", || async {
        db.scalar(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'german_slot' AND active",
        ) == 1
    })
    .await;
    let e = pending_age_seconds(&mut owner, "german_slot", "german_pub")
        .await
        .expect_err("the slot is in use");
    assert!(matches!(e, WalError::SlotBusy { .. }), "a busy slot: {e:?}");
    holder.kill();
    wait_until(Duration::from_secs(10), "the slot to be let go", || async {
        db.scalar("SELECT count(*) FROM pg_replication_slots WHERE active") == 0
    })
    .await;

    // wal_level below logical: the level, whatever the words (logical slots must go first)
    drop((plain, owner));
    diesel::sql_query("SELECT pg_drop_replication_slot('german_slot')")
        .execute(&mut admin)
        .expect("drop the slot");
    drop(admin);
    cluster.settings.push("wal_level=replica".into());
    cluster.restart();
    let mut owner = reader_conn(&db.url).await;
    let e = WalReader::new(OutboxTable::DEFAULT, "german_third_slot", "german_pub")
        .setup(&mut owner)
        .await
        .expect_err("wal_level replica");
    assert!(matches!(e, WalError::WalLevel(_)), "wal_level: {e:?}");
    drop(owner);
}
