//! Failure paths found by reading the code, each with the behaviour users need (see
//! RELIABILITY.md, "Hardening: failure paths and their tests").
//!
//! Relays run as real `outbox-relay` processes: build them first with
//! `cargo build --workspace --bins`. The 100,000-row variants are `#[ignore]`d:
//! `cargo test --test hardening -- --ignored`.

#[path = "../support/mod.rs"]
mod support;

mod idle;
mod late_rows;
mod names;
mod operations;
mod partition_reads;
mod partitions;
mod plans;
mod publishing;
mod sessions;

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use diesel::prelude::*;
use outbox_diesel::OutboxExt;
use support::events::{Changed, changed};
use support::servers::NatsServer;
use support::{
    Proc, Relay, TestDb, TestStream, by_aggregate, http_get, relay_command, relay_with_metrics,
    wait_published, wait_until,
};

/// Inserts `n` rows of `n` distinct aggregates with plain SQL, in one statement.
fn insert_rows(db: &TestDb, n: i64) {
    diesel::sql_query(format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || i, 'order.placed', jsonb_build_object('n', i) \
         FROM generate_series(1, {n}) AS i"
    ))
    .execute(&mut db.conn())
    .expect("insert rows");
}

/// Inserts `n` rows over `aggregates` aggregates (`o-0`, `o-1`, ...) with plain SQL, in one
/// statement.
fn insert_rows_over(db: &TestDb, n: i64, aggregates: i64) {
    diesel::sql_query(format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || (i % {aggregates}), 'order.placed', \
         jsonb_build_object('n', i) FROM generate_series(1, {n}) AS i"
    ))
    .execute(&mut db.conn())
    .expect("insert rows");
}

fn unpublished(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL")
}

fn parked(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL")
}

/// Waits until no row is unpublished, or panics with the relay's log.
async fn drained(db: &TestDb, relay: &Relay, timeout: Duration) {
    let start = std::time::Instant::now();
    loop {
        let left = unpublished(db);
        if left == 0 {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "{left} rows still unpublished after {timeout:?}; relay log:\n{}",
            relay.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// what more than one module uses

fn record(conn: &mut PgConnection, n: usize, aggregates: usize) {
    conn.transaction(|conn| {
        let events: Vec<Changed> = (0..n)
            .map(|i| changed(&format!("acct-{}", i % aggregates), i as i64))
            .collect();
        conn.record_events(&events)
    })
    .expect("record");
}

/// A login role of its own, with only the README's GRANTs on the outbox of `db`; dropped on
/// `Drop` (roles are cluster-wide: the name is unique, and its grants go first).
struct Role {
    name: String,
    db_url: String,
}

impl Role {
    fn relay(db: &TestDb) -> Role {
        let name = format!(
            "outbox_hard_{}",
            &uuid::Uuid::now_v7().simple().to_string()[16..]
        );
        let mut admin = db.conn();
        for sql in [
            format!("CREATE ROLE {name} LOGIN"),
            format!("GRANT USAGE ON SCHEMA public TO {name}"),
            format!("GRANT SELECT, UPDATE, DELETE ON outbox TO {name}"),
            format!("GRANT SELECT, INSERT, DELETE ON outbox_progress TO {name}"),
        ] {
            diesel::sql_query(sql)
                .execute(&mut admin)
                .expect("set up the role");
        }
        Role {
            name,
            db_url: db.url.clone(),
        }
    }

    /// `db`'s URL with this role as the user.
    fn url(&self) -> String {
        let base = support::pg_base();
        let host = base.rsplit('@').next().unwrap_or("127.0.0.1:5432");
        let db = self.db_url.rsplit('/').next().unwrap_or_default();
        format!("postgres://{}@{host}/{db}", self.name)
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        if let Ok(mut conn) = PgConnection::establish(&self.db_url) {
            let _ = diesel::sql_query(format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{}'",
                self.name
            ))
            .execute(&mut conn);
            let _ = diesel::sql_query(format!("DROP OWNED BY {}", self.name)).execute(&mut conn);
        }
        if let Ok(mut admin) = PgConnection::establish(&format!("{}/postgres", support::pg_base()))
        {
            let _ =
                diesel::sql_query(format!("DROP ROLE IF EXISTS {}", self.name)).execute(&mut admin);
        }
    }
}

/// The first line's buffers of an `EXPLAIN (ANALYZE, BUFFERS)`: `shared hit` plus `read`.
fn buffers(plan: &[String]) -> u64 {
    let line = plan
        .iter()
        .find(|l| l.contains("Buffers:"))
        .unwrap_or_else(|| panic!("no Buffers line in\n{}", plan.join("\n")));
    line.split_whitespace()
        .filter_map(|w| w.strip_prefix("hit=").or_else(|| w.strip_prefix("read=")))
        .filter_map(|n| n.parse::<u64>().ok())
        .sum()
}

/// The `seq`s of `batch`'s rows from `source`.
/// A transaction that runs `insert` and stays open until the returned function is called,
/// which commits it.
fn hold_open(db: &TestDb, insert: &str) -> impl FnOnce() {
    let insert = insert.to_owned();
    let mut open = db.conn();
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let (inserted, inserted_wait) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        open.transaction(|c| {
            diesel::sql_query(insert).execute(c)?;
            inserted.send(()).ok();
            wait.recv().ok();
            Ok::<_, diesel::result::Error>(())
        })
        .expect("the held transaction commits");
    });
    inserted_wait.recv().expect("the held rows inserted");
    move || {
        done.send(()).expect("commit the held transaction");
        holder.join().expect("the holder");
    }
}

fn seqs_of(batch: &outbox_diesel::relay::Batch, source: outbox_diesel::relay::Source) -> Vec<i64> {
    batch
        .rows
        .iter()
        .filter(|(_, s)| *s == source)
        .map(|(r, _)| r.seq)
        .collect()
}

fn seqs_where(db: &TestDb, filter: &str) -> Vec<i64> {
    #[derive(QueryableByName)]
    struct Seq {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        seq: i64,
    }
    diesel::sql_query(format!(
        "SELECT seq FROM outbox WHERE {filter} ORDER BY seq"
    ))
    .load::<Seq>(&mut db.conn())
    .expect("select seqs")
    .into_iter()
    .map(|s| s.seq)
    .collect()
}

/// The batch of the one partition of `outbox` (`--partitions 1`) at `cursor`, 8 rows at most.
async fn batch_of_8(
    conn: &mut diesel_async::AsyncPgConnection,
    cursor: outbox_diesel::relay::Cursor,
) -> outbox_diesel::relay::Batch {
    let table = outbox_diesel::OutboxTable::DEFAULT;
    outbox_diesel::relay::fetch_batches(conn, &table, 1, &[(0, cursor)], &[], 8, i64::MAX)
        .await
        .expect("fetch")
        .into_iter()
        .next()
        .expect("the partition's batch")
        .1
}

/// The plans (with their buffers) of a late pass at `late` late rows: a transaction held open
/// while 4 later rows were read, then committed. `first`: the batch that finds the late rows
/// and begins the pass; `part`: the next part, after `since` rows more were written by
/// transactions that began after the pass did. Each in a relay's session.
struct LatePassPlans {
    first: (u64, Vec<String>),
    part: (u64, Vec<String>),
}

async fn late_pass_plans(late: i64, since: i64) -> LatePassPlans {
    use outbox_diesel::relay::{Cursor, Partition, explain_batch_analyze};
    let db = TestDb::new();
    let table = outbox_diesel::OutboxTable::DEFAULT;
    insert_rows_over(&db, 2, 2);
    let bulk = format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'bulk', 'b-' || (i % 7), 'bulk.loaded', \
         jsonb_build_object('n', i) FROM generate_series(1, {late}) AS i"
    );
    let commit = hold_open(&db, &bulk);
    insert_rows_over(&db, 2, 2);
    let mut conn = db.relay_session().await;
    let cursor = batch_of_8(&mut conn, Cursor::start()).await.next;
    commit();
    db.execute("VACUUM ANALYZE outbox", "vacuum");
    let plan = async |conn: &mut diesel_async::AsyncPgConnection, cursor: &Cursor| {
        let plan = explain_batch_analyze(conn, &table, Partition::ALL, cursor, 8)
            .await
            .expect("explain");
        (buffers(&plan), plan)
    };
    let first = plan(&mut conn, &cursor).await;
    let cursor = batch_of_8(&mut conn, cursor).await.next;
    assert!(cursor.late.is_some(), "in a late pass");
    if since > 0 {
        insert_rows_over(&db, since, 100);
    }
    let part = plan(&mut conn, &cursor).await;
    LatePassPlans { first, part }
}

/// The cursors of all `count` partitions after reading the whole table from the start, in
/// batches of 5,000, as a relay catching up leaves them.
async fn read_to_the_end(
    conn: &mut diesel_async::AsyncPgConnection,
    count: u32,
) -> Vec<(u32, outbox_diesel::relay::Cursor)> {
    use outbox_diesel::relay::{Cursor, fetch_batches};
    let table = outbox_diesel::OutboxTable::DEFAULT;
    let mut cursors: Vec<(u32, Cursor)> = (0..count).map(|p| (p, Cursor::start())).collect();
    loop {
        let batches = fetch_batches(conn, &table, count, &cursors, &[], 5_000, i64::MAX)
            .await
            .expect("fetch");
        let read: usize = batches.iter().map(|(_, b)| b.rows.len()).sum();
        cursors = batches.into_iter().map(|(p, b)| (p, b.next)).collect();
        if read == 0 {
            return cursors;
        }
    }
}

/// Asserts that `what` reads no more buffers in the `case` than in the `base` one, give or
/// take `slack`, showing the case's plan when it does; prints both.
fn assert_no_dearer(
    what: &str,
    (base, base_is): (u64, &str),
    (case, case_is, plan): (u64, &str, &[String]),
    slack: u64,
) {
    println!("{what}: {base} buffers {base_is}, {case} {case_is}");
    assert!(
        case <= base + slack,
        "{what}: {case} buffers {case_is}, {base} {base_is}:\n{}",
        plan.join("\n")
    );
}
