//! Parking: rows set aside after failed publishes, the rows of their aggregates held back behind
//! them, and their release.

use chrono::{DateTime, Utc};
use diesel::sql_types::{Array, BigInt, Integer, Nullable, Text, Timestamptz, Uuid as SqlUuid};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use uuid::Uuid;

use crate::OutboxTable;

use super::progress::Coverage;

/// The first key of the transaction advisory lock that orders [`hold_back`] and
/// [`retry_parked`] on a table (the second is the table's OID): `'OBHD'` in ASCII, far above
/// the OIDs of user tables that the partition locks use there.
pub const HOLD_LOCK_KEY: i32 = 0x4F42_4844;

/// Sets aside the rows `seqs` whose aggregate has an earlier parked (or held) row, with
/// `parked_at = '-infinity'`: unpublished, out of the poll's index, released by
/// [`retry_parked`] with the parked row. A row whose aggregate no longer has one (a `retry`
/// ran meanwhile) is left as it is. Returns how many it set aside.
pub async fn hold_back(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seqs: &[i64],
) -> QueryResult<usize> {
    use diesel_async::AsyncConnection;
    let t = table.quoted();
    conn.transaction(async |conn| {
        lock_holds(conn, table).await?;
        diesel::sql_query(format!(
            "UPDATE {t} o SET parked_at = '-infinity' WHERE o.seq = ANY($1) \
             AND o.published_at IS NULL AND o.parked_at IS NULL AND {}",
            earlier_waiting_sql(&t, "IS NOT NULL")
        ))
        .bind::<Array<BigInt>, _>(seqs)
        .execute(conn)
        .await
    })
    .await
}

/// Whether row `o` of `t` (quoted) has an earlier row of its aggregate waiting (parked, held
/// back or released, unpublished) whose `parked_at` is `parked` (`< 'infinity'`, `IS NOT
/// NULL`, ...): a boolean SQL expression that reads the index of parked rows (`aggregate_type,
/// aggregate_id`) whatever the statistics say. It asks for the first such row in that
/// index's order (`ORDER BY aggregate_id`, the id bounded on both sides rather than compared
/// equal, which would make the order moot), which no other index gives without sorting.
/// Asked only whether one exists, the planner chose by its estimates, and where the statistics
/// give an aggregate a large share of the table (few aggregates, or a partition of a ring
/// filled by the one held back) a walk of every unpublished row by `seq` until a match looked
/// cheaper: it read every row kept before each row looked up, 20 s a batch of 500 with
/// 100,000 rows held back behind a parked one.
pub(super) fn earlier_waiting_sql(t: &str, parked: &str) -> String {
    format!(
        "(SELECT p.parked_at FROM {t} p WHERE p.aggregate_type = o.aggregate_type \
         AND p.aggregate_id >= o.aggregate_id AND p.aggregate_id <= o.aggregate_id \
         AND p.parked_at IS NOT NULL AND p.published_at IS NULL AND p.seq < o.seq \
         AND p.parked_at {parked} ORDER BY p.aggregate_id LIMIT 1) IS NOT NULL"
    )
}

/// Serialises holding back and retrying on `table` until the transaction ends: a retry that
/// commits is seen by a later hold, which then leaves the released aggregate's rows alone.
pub(super) async fn lock_holds(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<()> {
    diesel::sql_query(format!(
        "SELECT pg_advisory_xact_lock({HOLD_LOCK_KEY}, to_regclass($1)::oid::int)"
    ))
    .bind::<Text, _>(table.quoted())
    .execute(conn)
    .await
    .map(drop)
}

#[derive(QueryableByName)]
struct Key {
    #[diesel(sql_type = Text)]
    k: String,
}

/// The aggregates held back by a parked row, as `aggregate_type.aggregate_id` keys: in
/// ordered mode, their later rows wait until the parked row is retried.
pub async fn held_back_aggregates(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<Vec<String>> {
    let keys: Vec<Key> = diesel::sql_query(format!(
        "SELECT DISTINCT aggregate_type || '.' || aggregate_id AS k FROM {} \
         WHERE parked_at > '-infinity' AND parked_at < 'infinity'",
        table.quoted()
    ))
    .load(conn)
    .await?;
    Ok(keys.into_iter().map(|k| k.k).collect())
}

/// A row the relay gave up on.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct ParkedRow {
    /// Its `seq`.
    #[diesel(sql_type = BigInt)]
    pub seq: i64,
    /// Its message id.
    #[diesel(sql_type = SqlUuid)]
    pub id: Uuid,
    /// Its aggregate's type.
    #[diesel(sql_type = Text)]
    pub aggregate_type: String,
    /// Its aggregate's id.
    #[diesel(sql_type = Text)]
    pub aggregate_id: String,
    /// Its event type.
    #[diesel(sql_type = Text)]
    pub event_type: String,
    /// Failed attempts.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    /// The last error.
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    /// When it was parked.
    #[diesel(sql_type = Timestamptz)]
    pub parked_at: DateTime<Utc>,
    /// Unpublished rows of its aggregate held back behind it.
    #[diesel(sql_type = BigInt)]
    pub held_back: i64,
}

/// The parked rows of `table`, oldest first.
pub async fn parked(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<Vec<ParkedRow>> {
    let t = table.quoted();
    let cov = Coverage::of(conn, table).await?;
    diesel::sql_query(format!(
        "{}SELECT p.seq, p.id, p.aggregate_type, p.aggregate_id, p.event_type, p.attempts, \
         p.last_error, p.parked_at, (SELECT count(*) FROM {t} o WHERE o.published_at IS NULL \
         AND (o.parked_at = '-infinity' OR (o.parked_at IS NULL AND NOT {})) \
         AND o.aggregate_type = p.aggregate_type \
         AND o.aggregate_id = p.aggregate_id AND o.seq > p.seq) AS held_back \
         FROM {t} p WHERE p.parked_at > '-infinity' AND p.parked_at < 'infinity' \
         AND p.published_at IS NULL ORDER BY p.seq",
        cov.with(),
        cov.covered()
    ))
    .load(conn)
    .await
}

/// Un-parks the row `seq` (or every parked row when `None`) and resets its attempts, so the
/// relay publishes it again, and releases the rows held back behind it (see [`hold_back`]);
/// returns how many parked rows it released (held-back rows are not counted). Rows still
/// behind another parked row of their aggregate are held back again by the next poll. The
/// relays that listen on the table's channel are notified when the transaction commits.
pub async fn retry_parked(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seq: Option<i64>,
) -> QueryResult<usize> {
    use diesel_async::AsyncConnection;
    let t = table.quoted();
    conn.transaction(async |conn| {
        lock_holds(conn, table).await?;
        #[derive(QueryableByName)]
        struct Count {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let parked: Count = diesel::sql_query(format!(
            "SELECT count(*) AS n FROM {t} WHERE parked_at > '-infinity' \
             AND parked_at < 'infinity' AND published_at IS NULL \
             AND ($1::bigint IS NULL OR seq = $1)"
        ))
        .bind::<Nullable<BigInt>, _>(seq)
        .get_result(conn)
        .await?;
        // where an ordered relay records its progress, its cursor may have read past the
        // rows: they are released (`'infinity'`), read apart, and marked once published
        let cov = Coverage::of(conn, table).await?;
        diesel::sql_query(format!(
            "UPDATE {t} o SET parked_at = {}, \
             attempts = 0 WHERE o.parked_at IS NOT NULL AND o.parked_at < 'infinity' \
             AND o.published_at IS NULL AND ($1::bigint IS NULL OR o.seq = $1 \
             OR (o.parked_at = '-infinity' AND o.seq > $1 AND EXISTS (SELECT 1 FROM {t} p \
             WHERE p.seq = $1 AND p.parked_at > '-infinity' \
             AND p.aggregate_type = o.aggregate_type AND p.aggregate_id = o.aggregate_id)))",
            if cov.in_use() {
                "'infinity'::timestamptz"
            } else {
                "NULL"
            }
        ))
        .bind::<Nullable<BigInt>, _>(seq)
        .execute(conn)
        .await?;
        // the relays listening read at once (their idle question does not see a row whose
        // `UPDATE` kept its transaction id)
        if parked.n > 0 {
            // the writers' wake-up: an empty payload on the table's channel
            super::notify_members(conn, &table.channel(), "").await?;
        }
        Ok(parked.n as usize)
    })
    .await
}
