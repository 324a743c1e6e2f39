//! Table names: longer than a channel name, and quoted under either string setting.

use super::*;

/// `outbox-relay run` for `table`, with the given timings (no defaults of `relay_command` to
/// override).
fn relay_for(db_url: &str, stream: &TestStream, table: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(support::relay_bin());
    cmd.arg("run")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env(
            "RUST_LOG",
            std::env::var("OUTBOX_TEST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .env("DATABASE_URL", db_url)
        .env("NATS_URL", &stream.nats_url)
        .args(["--stream", &stream.name, "--subject-prefix", &stream.prefix])
        .args(["--table", table, "--startup-timeout", "20s"])
        .args(args);
    cmd
}

fn count_published(db: &TestDb, table: &outbox_diesel::OutboxTable) -> i64 {
    db.scalar(&format!(
        "SELECT count(*) FROM {} WHERE published_at IS NOT NULL",
        table.audit_view()
    ))
}

// 3. A table whose `schema.table` is longer than PostgreSQL's 63-byte channel names: the
// wake-up never fails the business transaction, and it still wakes the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_table_name_never_fails_the_business_transaction_and_still_wakes_the_relay() {
    let db = TestDb::new();
    let stream = TestStream::new();
    let schema = format!("s{}", "x".repeat(39));
    let name = format!("t{}", "y".repeat(29));
    assert_eq!((schema.len(), name.len()), (40, 30));
    let table = outbox_diesel::OutboxTable::with_schema(&schema, &name).expect("valid names");
    assert!(table.channel().len() <= 63, "{}", table.channel());
    let mut conn = db.conn();
    diesel::sql_query(format!("CREATE SCHEMA {schema}"))
        .execute(&mut conn)
        .expect("schema");
    outbox_diesel::create_table(&mut conn, &table).expect("create the table");
    let outbox =
        outbox_diesel::Outbox::new(table.clone()).notify(outbox_diesel::Notify::EveryTransaction);
    let event = changed("a", 0);
    conn.transaction(|conn| outbox.record(conn, &event).map(drop))
        .expect("the business transaction commits");

    // the relay polls every 10 s: a publish within 3 s is the NOTIFY's doing
    let full = table.to_string();
    let _relay = Proc::spawn(
        "relay",
        &mut relay_for(
            &db.url,
            &stream,
            &full,
            &[
                "--mode",
                "unordered",
                "--workers",
                "1",
                "--poll-interval",
                "10s",
                "--lease",
                "40s",
            ],
        ),
    );
    wait_until(
        Duration::from_secs(20),
        "the first row published",
        || async { count_published(&db, &table) == 1 },
    )
    .await;
    // the relay has polled and now idles for 10 s; let it settle into the wait
    tokio::time::sleep(Duration::from_millis(500)).await;
    conn.transaction(|conn| outbox.record(conn, &event).map(drop))
        .expect("the business transaction commits");
    wait_until(
        Duration::from_secs(3),
        "the second row published on the NOTIFY, before the next poll",
        || async { count_published(&db, &table) == 2 },
    )
    .await;
}

// 13. A table name with a backslash and a quote, on a server with
// `standard_conforming_strings = off`: names reach SQL as bind parameters or through one
// quoting function that is right under either setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_name_with_a_backslash_and_a_quote_works_without_standard_conforming_strings() {
    let db = TestDb::new();
    let stream = TestStream::new();
    diesel::sql_query(format!(
        "ALTER DATABASE {} SET standard_conforming_strings = off",
        db.name
    ))
    .execute(&mut db.conn())
    .expect("set standard_conforming_strings");
    let name = r"we\'ird";
    let table = outbox_diesel::OutboxTable::new(name).expect("a valid name");
    let mut conn = db.conn();
    assert_eq!(
        db.scalar("SELECT (current_setting('standard_conforming_strings') = 'off')::int"),
        1
    );
    outbox_diesel::create_table(&mut conn, &table).expect("create the table");
    outbox_diesel::create_table(&mut conn, &table).expect("a second create finds it");
    let outbox =
        outbox_diesel::Outbox::new(table.clone()).notify(outbox_diesel::Notify::EveryTransaction);
    for n in 0..10 {
        let event = changed(&format!("a{}", n % 3), n);
        conn.transaction(|conn| outbox.record(conn, &event).map(drop))
            .expect("record");
    }
    let _relay = Proc::spawn(
        "relay",
        &mut relay_for(
            &db.url,
            &stream,
            name,
            &["--partitions", "2", "--poll-interval", "50ms"],
        ),
    );
    wait_until(Duration::from_secs(20), "10 rows published", || async {
        count_published(&db, &table) == 10
    })
    .await;
    // status reads the same table and sees the two partitions' owner
    let out = Command::new(support::relay_bin())
        .args(["status", "--json", "--table", name])
        .env_clear()
        .env("DATABASE_URL", &db.url)
        .output()
        .expect("status");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value = serde_json::from_str(&stdout).expect("status JSON");
    assert_eq!(
        status["relays"].as_array().map(Vec::len),
        Some(1),
        "{status}"
    );
    assert_eq!(stream.count().await, 10);
}
