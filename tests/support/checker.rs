//! The fault suite's checker: reads a whole stream back and compares it with the database.
//!
//! The database is the truth. An event is *committed* when its outbox row committed together
//! with its business row: the writer example (`examples/writer.rs`) writes a ledger entry
//! (`writer_entries.event_id`) in the transaction that records the event, and the checker
//! joins the two. In a database without that table every outbox row counts as committed.
//!
//! What it counts:
//!
//! - `missing`: committed events whose message id is not in the stream;
//! - `orphaned`: messages in the stream without a committed business row (an event of a
//!   rolled-back transaction, or one nobody recorded);
//! - `duplicates`: messages whose `Nats-Msg-Id` is already earlier in the stream;
//! - `order_violations`: per aggregate, messages (first copies) that arrive after a message of
//!   the same aggregate with a higher `seq`. `seq` order is commit order per aggregate because
//!   the writers lock the aggregate's row before recording (the documented rule);
//! - `torn`: business rows without an outbox row or outbox rows without a business row: a
//!   transaction that committed half of itself, which must never happen;
//! - `marked_not_in_stream`: rows marked published whose message is not in the stream
//!   ("nothing is marked without an ack");
//! - `max_wait`: the longest time from `Outbox-Created-At` to the message's stream timestamp.
//!
//! A relay run with `--delete-published` deletes the rows JetStream acked. In a database
//! prepared with [`keep_deleted_rows`], a trigger copies each deleted row into
//! `outbox_deleted` (with the time of its deletion) in the deleting transaction, and the checker
//! reads the view [`RECORD_VIEW`], the outbox rows and the deleted ones, where a deleted row
//! counts as marked: it is held to "nothing is deleted without an ack" as a marked row is.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Nullable, Text, Uuid as SqlUuid};

use super::{TestDb, TestStream};

/// The business table the writer example fills, one row per committed event.
pub const BUSINESS_TABLE: &str = "writer_entries";

/// The view of the outbox rows and the rows deleted from it, when [`keep_deleted_rows`]
/// made it: `seq, id, aggregate_type, aggregate_id, published_at` (the deletion time for a
/// deleted row).
pub const RECORD_VIEW: &str = "outbox_record";

/// Makes the outbox of `db` keep a record of the rows deleted from it, and the view
/// [`RECORD_VIEW`] over both. A relay's `DELETE` is recorded in its own transaction: a
/// deletion that rolls back leaves no record.
pub fn keep_deleted_rows(db: &TestDb) {
    use diesel::connection::SimpleConnection;
    db.conn()
        .batch_execute(&format!(
            "CREATE TABLE outbox_deleted ( \
                 seq bigint PRIMARY KEY, id uuid NOT NULL, aggregate_type text NOT NULL, \
                 aggregate_id text NOT NULL, deleted_at timestamptz NOT NULL DEFAULT clock_timestamp()); \
             CREATE FUNCTION outbox_keep_deleted() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN \
                 INSERT INTO outbox_deleted (seq, id, aggregate_type, aggregate_id) \
                 VALUES (OLD.seq, OLD.id, OLD.aggregate_type, OLD.aggregate_id); \
                 RETURN OLD; \
             END $$; \
             CREATE TRIGGER outbox_keep_deleted AFTER DELETE ON outbox \
                 FOR EACH ROW EXECUTE FUNCTION outbox_keep_deleted(); \
             CREATE VIEW {RECORD_VIEW} AS \
                 SELECT seq, id, aggregate_type, aggregate_id, published_at FROM outbox_audit \
                 UNION ALL \
                 SELECT seq, id, aggregate_type, aggregate_id, deleted_at FROM outbox_deleted;"
        ))
        .expect("a record of the rows deleted from the outbox");
}

/// What a run left behind, database against stream.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// Events whose transaction committed.
    pub committed: usize,
    /// Rows in the outbox table.
    pub outbox_rows: usize,
    /// Outbox rows not marked published (yet).
    pub unpublished: usize,
    /// Half-committed transactions (a business row without its event or the reverse).
    pub torn: usize,
    /// Messages in the stream, duplicates included.
    pub in_stream: usize,
    /// Committed events not in the stream.
    pub missing: usize,
    /// Messages without a committed business row.
    pub orphaned: usize,
    /// Messages whose message id came earlier in the stream.
    pub duplicates: usize,
    /// Messages that arrived after a later event of their aggregate.
    pub order_violations: usize,
    /// Rows marked published that are not in the stream.
    pub marked_not_in_stream: usize,
    /// The longest time an event waited from its recording to its storing in the stream.
    pub max_wait: Duration,
    /// The `seq`s of the first missing events (up to 20), for a failure's report.
    pub missing_seqs: Vec<i64>,
}

impl Report {
    /// Asserts the promise for modes that keep order: nothing missing, orphaned, duplicated,
    /// reordered, torn, or marked without being in the stream.
    pub fn assert_exact_and_ordered(&self) {
        self.assert_exact();
        assert_eq!(self.order_violations, 0, "per-aggregate order: {self}");
    }

    /// The promise for log tailing, which marks no row: as for the ordered modes, except that
    /// rows stay unmarked.
    pub fn assert_captured_in_order(&self) {
        self.assert_delivered();
        assert_eq!(self.order_violations, 0, "per-aggregate order: {self}");
    }

    /// The same without the order (unordered mode).
    pub fn assert_exact(&self) {
        self.assert_delivered();
        assert_eq!(self.unpublished, 0, "rows left unpublished: {self}");
    }

    /// Nothing missing, orphaned, duplicated, torn, or marked without being in the stream.
    fn assert_delivered(&self) {
        assert!(self.committed > 0, "the run committed nothing: {self}");
        assert_eq!(self.torn, 0, "half-committed transactions: {self}");
        assert_eq!(
            self.missing, 0,
            "committed events missing from the stream: {self}"
        );
        assert_eq!(
            self.orphaned, 0,
            "events in the stream without a commit: {self}"
        );
        assert_eq!(self.duplicates, 0, "duplicates in the stream: {self}");
        assert_eq!(
            self.marked_not_in_stream, 0,
            "rows marked published that are not in the stream: {self}"
        );
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "committed {} (outbox rows {}, unpublished {}, torn {}); stream {}: missing {}, \
             orphaned {}, duplicates {}, order violations {}, marked but not in stream {}; \
             longest wait {:.3}s",
            self.committed,
            self.outbox_rows,
            self.unpublished,
            self.torn,
            self.in_stream,
            self.missing,
            self.orphaned,
            self.duplicates,
            self.order_violations,
            self.marked_not_in_stream,
            self.max_wait.as_secs_f64()
        )?;
        if !self.missing_seqs.is_empty() {
            write!(f, "; missing seqs (first 20) {:?}", self.missing_seqs)?;
        }
        Ok(())
    }
}

/// One event as the database knows it.
#[derive(Debug, QueryableByName)]
pub struct DbEvent {
    /// Its outbox `seq` (none when only the business row exists).
    #[diesel(sql_type = Nullable<BigInt>)]
    pub seq: Option<i64>,
    /// Its message id.
    #[diesel(sql_type = SqlUuid)]
    pub id: uuid::Uuid,
    /// `aggregate_type/aggregate_id`.
    #[diesel(sql_type = Text)]
    pub aggregate: String,
    /// Whether its outbox row exists.
    #[diesel(sql_type = Bool)]
    pub in_outbox: bool,
    /// Whether its business row exists.
    #[diesel(sql_type = Bool)]
    pub in_business: bool,
    /// Whether its outbox row is marked published.
    #[diesel(sql_type = Bool)]
    pub marked: bool,
}

/// One message as the stream holds it.
#[derive(Debug, Clone)]
pub struct StreamMessage {
    /// Its stream sequence.
    pub stream_seq: u64,
    /// `Nats-Msg-Id`.
    pub msg_id: String,
    /// `Outbox-Aggregate-Type` and `Outbox-Aggregate-Id`, joined by `/`.
    pub aggregate: String,
    /// `Outbox-Created-At`, in Unix nanoseconds.
    pub created_nanos: Option<i128>,
    /// When the stream stored it, in Unix nanoseconds.
    pub stored_nanos: i128,
}

fn database_events(db: &TestDb) -> Vec<DbEvent> {
    let mut conn = db.conn();
    #[derive(QueryableByName)]
    struct Exists {
        #[diesel(sql_type = Bool)]
        exists: bool,
    }
    let exists = |conn: &mut PgConnection, table: &str| {
        diesel::sql_query(format!(
            "SELECT to_regclass('{table}') IS NOT NULL AS exists"
        ))
        .get_result::<Exists>(conn)
        .expect("look up a table")
        .exists
    };
    let outbox = if exists(&mut conn, RECORD_VIEW) {
        RECORD_VIEW
    } else {
        "outbox_audit"
    };
    let sql = if exists(&mut conn, BUSINESS_TABLE) {
        format!(
            "SELECT o.seq, COALESCE(o.id, e.event_id) AS id, \
             COALESCE(o.aggregate_type || '/' || o.aggregate_id, 'account/' || e.account) AS aggregate, \
             o.id IS NOT NULL AS in_outbox, e.event_id IS NOT NULL AS in_business, \
             COALESCE(o.published_at IS NOT NULL, false) AS marked \
             FROM {outbox} o FULL JOIN {BUSINESS_TABLE} e ON e.event_id = o.id"
        )
    } else {
        format!(
            "SELECT o.seq, o.id, o.aggregate_type || '/' || o.aggregate_id AS aggregate, \
             true AS in_outbox, true AS in_business, o.published_at IS NOT NULL AS marked \
             FROM {outbox} o"
        )
    };
    diesel::sql_query(sql)
        .load(&mut conn)
        .expect("read the outbox and the business rows")
}

/// Every message of `stream`, in stream order.
pub async fn read_messages(stream: &TestStream) -> Vec<StreamMessage> {
    super::read_raw(&stream.js().await, &stream.name)
        .await
        .into_iter()
        .map(|m| {
            let headers = m.headers.clone().unwrap_or_default();
            let get = |k: &str| headers.get(k).map(|v| v.as_str().to_owned());
            let info = m.info().expect("JetStream metadata");
            StreamMessage {
                stream_seq: info.stream_sequence,
                msg_id: get("Nats-Msg-Id").unwrap_or_default(),
                aggregate: format!(
                    "{}/{}",
                    get("Outbox-Aggregate-Type").unwrap_or_default(),
                    get("Outbox-Aggregate-Id").unwrap_or_default()
                ),
                created_nanos: get("Outbox-Created-At")
                    .and_then(|t| chrono::DateTime::parse_from_rfc3339(&t).ok())
                    .and_then(|t| t.timestamp_nanos_opt())
                    .map(i128::from),
                stored_nanos: info.published.unix_timestamp_nanos(),
            }
        })
        .collect()
}

/// Reads the database and the whole stream and compares them.
pub async fn check(db: &TestDb, stream: &TestStream) -> Report {
    let events = database_events(db);
    let messages = read_messages(stream).await;
    compare(&events, &messages)
}

/// Compares what the database committed with what the stream holds.
pub fn compare(events: &[DbEvent], messages: &[StreamMessage]) -> Report {
    let mut report = Report {
        outbox_rows: events.iter().filter(|e| e.in_outbox).count(),
        committed: events
            .iter()
            .filter(|e| e.in_outbox && e.in_business)
            .count(),
        unpublished: events.iter().filter(|e| e.in_outbox && !e.marked).count(),
        torn: events
            .iter()
            .filter(|e| e.in_outbox != e.in_business)
            .count(),
        in_stream: messages.len(),
        ..Report::default()
    };
    let committed: HashMap<String, &DbEvent> = events
        .iter()
        .filter(|e| e.in_outbox && e.in_business)
        .map(|e| (e.id.to_string(), e))
        .collect();
    let mut seen: HashSet<&str> = HashSet::with_capacity(messages.len());
    let mut highest: HashMap<&str, i64> = HashMap::new();
    for m in messages {
        if !seen.insert(&m.msg_id) {
            report.duplicates += 1;
            continue;
        }
        if let Some(created) = m.created_nanos {
            let waited = Duration::from_nanos((m.stored_nanos - created).max(0) as u64);
            report.max_wait = report.max_wait.max(waited);
        }
        let Some(event) = committed.get(&m.msg_id) else {
            report.orphaned += 1;
            continue;
        };
        let seq = event.seq.unwrap_or_default();
        let top = highest.entry(&m.aggregate).or_insert(seq);
        if seq < *top {
            report.order_violations += 1;
        } else {
            *top = seq;
        }
    }
    let mut missing: Vec<i64> = committed
        .iter()
        .filter(|(id, _)| !seen.contains(id.as_str()))
        .map(|(_, e)| e.seq.unwrap_or_default())
        .collect();
    report.missing = missing.len();
    missing.sort_unstable();
    missing.truncate(20);
    report.missing_seqs = missing;
    report.marked_not_in_stream = events
        .iter()
        .filter(|e| e.in_outbox && e.marked && !seen.contains(e.id.to_string().as_str()))
        .count();
    report
}
