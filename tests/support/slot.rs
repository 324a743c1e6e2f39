//! Logical replication slots of the log-tailing tests: cluster-wide names made unique from the
//! test database's, dropped before the database is (a database with a slot cannot be dropped).

use std::time::{Duration, Instant};

use diesel::prelude::*;

use super::TestDb;

/// The test's slot: created by the relay, dropped on `Drop` before the database is (a
/// database with a logical slot cannot be dropped). Declare it after the `TestDb` and before
/// the relays, so that it drops after the relays and before the database.
pub struct Slot {
    pub name: String,
    admin_url: String,
}

impl Slot {
    pub fn new(db: &TestDb) -> Self {
        let admin_url = db.admin_url().to_owned();
        drop_stale_slots(&admin_url);
        Slot {
            // slot names are cluster-wide: take the database's unique suffix
            name: format!("lt_{}", db.name.trim_start_matches("outbox_t_")),
            admin_url,
        }
    }

    /// Creates the publication `outbox_pub` and the slot now, as the relay would: what
    /// commits from here on is captured even before a relay runs. The publication sends a
    /// partitioned table's rows under the table's own name, as the relay requires of a
    /// rotated table.
    pub fn create(db: &TestDb) -> Self {
        let slot = Slot::new(db);
        diesel::sql_query(
            "CREATE PUBLICATION outbox_pub FOR TABLE outbox \
             WITH (publish = 'insert, update', publish_via_partition_root = true)",
        )
        .execute(&mut db.conn())
        .expect("the publication");
        diesel::sql_query(format!(
            "SELECT 1 FROM pg_create_logical_replication_slot('{}', 'pgoutput')",
            slot.name
        ))
        .execute(&mut db.conn())
        .expect("the slot");
        slot
    }

    /// Waits until the slot's confirmed position passes the WAL inserted so far: every
    /// transaction committed before this call was published and acked. The insert position,
    /// not `pg_current_wal_lsn()`: that is the write position, and a transaction committed
    /// with `synchronous_commit = off` (the fault suite's writer) can still sit in the WAL
    /// buffers past it, not yet decoded, so the slot passed the write position while the last
    /// commits were still to come (the last 6 or 7 events "missing" from a log-tailing run).
    pub async fn confirmed_past_now(&self, db: &TestDb, timeout: Duration) {
        let target = db.scalar("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint");
        // a slot in its first start is confirmed at its consistent point while the rows
        // before it are still being published: drained only once it streams
        super::wait_until(timeout, "the slot confirmed past every commit", || async {
            self.streaming(db) && self.confirmed(db) >= target
        })
        .await;
    }

    /// Whether the relay's record says the slot is read from the stream: its first start
    /// (the rows committed before the slot) is over.
    pub fn streaming(&self, db: &TestDb) -> bool {
        db.scalar("SELECT count(*) FROM pg_class WHERE relname = 'outbox_relay_slots'") == 1
            && db.scalar(&format!(
                "SELECT count(*) FROM outbox_relay_slots WHERE slot_name = '{}' \
                 AND state = 'streaming'",
                self.name
            )) == 1
    }

    pub fn exists(&self, db: &TestDb) -> bool {
        db.scalar(&format!(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
            self.name
        )) == 1
    }

    /// The backend pid of the relay session that holds the reader's lock, if any.
    pub fn reader(&self, db: &TestDb) -> Option<i64> {
        let pid = db.scalar(&format!(
            "SELECT COALESCE((SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND objsubid = 2 AND classid = {} AND objid = hashtext('{}')::oid \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())), 0)",
            outbox_diesel::relay::SLOT_LOCK_KEY,
            self.name
        ));
        (pid != 0).then_some(pid)
    }

    pub fn confirmed(&self, db: &TestDb) -> i64 {
        db.scalar(&format!(
            "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots \
             WHERE slot_name = '{}'",
            self.name
        ))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        drop_slot(&self.admin_url, &self.name);
    }
}

pub fn drop_slot(admin_url: &str, slot: &str) {
    let Ok(mut admin) = PgConnection::establish(admin_url) else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        // a killed relay's backend may still hold the slot for a moment
        let _ = diesel::sql_query(format!(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
             WHERE slot_name = '{slot}' AND active_pid IS NOT NULL"
        ))
        .execute(&mut admin);
        let dropped = diesel::sql_query(format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = '{slot}'"
        ))
        .execute(&mut admin);
        if dropped.is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Slots (and their databases) left by test runs that were killed before their guards ran:
/// the test slots' names hold a UUIDv7, whose first 48 bits are its creation time.
pub fn drop_stale_slots(admin_url: &str) {
    #[derive(QueryableByName)]
    struct S {
        #[diesel(sql_type = diesel::sql_types::Text)]
        slot_name: String,
    }
    let Ok(mut admin) = PgConnection::establish(admin_url) else {
        return;
    };
    let Ok(slots) = diesel::sql_query(
        "SELECT slot_name::text AS slot_name FROM pg_replication_slots \
         WHERE slot_name LIKE 'lt\\_%' AND NOT active",
    )
    .load::<S>(&mut admin) else {
        return;
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    for s in slots {
        let suffix = s.slot_name.trim_start_matches("lt_");
        let Some(created_ms) = suffix
            .get(..12)
            .and_then(|h| u64::from_str_radix(h, 16).ok())
        else {
            continue;
        };
        if now_ms.saturating_sub(created_ms) > 60 * 60 * 1000 {
            drop_slot(admin_url, &s.slot_name);
            let _ = diesel::sql_query(format!(
                "DROP DATABASE IF EXISTS outbox_t_{suffix} WITH (FORCE)"
            ))
            .execute(&mut admin);
        }
    }
}
