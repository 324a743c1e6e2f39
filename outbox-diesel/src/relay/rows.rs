//! The row the relay publishes and the partition an aggregate falls in.

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer, Jsonb, Text, Timestamptz, Uuid as SqlUuid};
use uuid::Uuid;

use crate::RawJson;

/// One outbox row, as the relay publishes it.
#[derive(Debug, Clone, PartialEq, QueryableByName)]
pub struct OutboxRow {
    /// Insertion order.
    #[diesel(sql_type = BigInt)]
    pub seq: i64,
    /// The message id: `Nats-Msg-Id`.
    #[diesel(sql_type = SqlUuid)]
    pub id: Uuid,
    /// The aggregate's type.
    #[diesel(sql_type = Text)]
    pub aggregate_type: String,
    /// The aggregate's id.
    #[diesel(sql_type = Text)]
    pub aggregate_id: String,
    /// The event's type.
    #[diesel(sql_type = Text)]
    pub event_type: String,
    /// The message body: the `jsonb` text as PostgreSQL renders it, published as it is.
    #[diesel(sql_type = Jsonb)]
    pub payload: RawJson,
    /// Extra headers (a JSON object).
    #[diesel(sql_type = Jsonb)]
    pub headers: serde_json::Value,
    /// When it was recorded.
    #[diesel(sql_type = Timestamptz)]
    pub created_at: DateTime<Utc>,
    /// Failed attempts so far.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
}

/// An [`OutboxRow`] read with its payload as text (`payload::text`), for a statement that
/// writes the payload out as text once for its byte budget and returns that text, instead of
/// writing it out a second time to send the `jsonb` (see `batch_sql`).
#[derive(QueryableByName)]
pub(crate) struct OutboxRowText {
    #[diesel(sql_type = BigInt)]
    seq: i64,
    #[diesel(sql_type = SqlUuid)]
    id: Uuid,
    #[diesel(sql_type = Text)]
    aggregate_type: String,
    #[diesel(sql_type = Text)]
    aggregate_id: String,
    #[diesel(sql_type = Text)]
    event_type: String,
    #[diesel(sql_type = Text)]
    payload: String,
    #[diesel(sql_type = Jsonb)]
    headers: serde_json::Value,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Integer)]
    attempts: i32,
}

impl OutboxRowText {
    pub(crate) fn seq(&self) -> i64 {
        self.seq
    }
}

impl From<OutboxRowText> for OutboxRow {
    fn from(r: OutboxRowText) -> OutboxRow {
        OutboxRow {
            seq: r.seq,
            id: r.id,
            aggregate_type: r.aggregate_type,
            aggregate_id: r.aggregate_id,
            event_type: r.event_type,
            // PostgreSQL's text of a `jsonb` value, as its binary form carries it
            payload: RawJson::from_postgres(r.payload),
            headers: r.headers,
            created_at: r.created_at,
            attempts: r.attempts,
        }
    }
}

/// Which rows a relay task works on: all of them, or the rows whose `aggregate_hash` falls
/// in partition `index` of `count` (`aggregate_hash % count = index`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Partition {
    /// This partition's number, `0..count`.
    pub index: u32,
    /// How many partitions the table is split into.
    pub count: u32,
}

impl Partition {
    /// The whole table as one partition.
    pub const ALL: Partition = Partition { index: 0, count: 1 };

    /// The partition an aggregate id falls in: the first 28 bits of the MD5 of the id,
    /// modulo `count`. The same as the table's generated `aggregate_hash % count`.
    ///
    /// ```
    /// use outbox_diesel::relay::Partition;
    /// assert_eq!(Partition::hash("a.b c"), 251735073);
    /// assert_eq!(Partition::of("a.b c", 16).index, 251735073 % 16);
    /// ```
    pub fn of(aggregate_id: &str, count: u32) -> Partition {
        Partition {
            index: Partition::hash(aggregate_id) as u32 % count.max(1),
            count: count.max(1),
        }
    }

    /// The stable hash of an aggregate id: the first 28 bits of its MD5, as the table's
    /// `aggregate_hash` column computes it.
    pub fn hash(aggregate_id: &str) -> i32 {
        use md5::Digest;
        let d = md5::Md5::digest(aggregate_id.as_bytes());
        ((u32::from_be_bytes([d[0], d[1], d[2], d[3]])) >> 4) as i32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_matches_postgres() {
        // SELECT ('x' || substr(md5(x), 1, 7))::bit(28)::integer
        assert_eq!(Partition::hash("a.b c"), 251735073);
        assert_eq!(Partition::hash("x"), 165498438);
    }
}
