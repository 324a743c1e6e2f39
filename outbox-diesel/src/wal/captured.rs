//! The outbox table's side of log tailing: the age of what the slot has not confirmed, rows
//! parked and captured rows deleted, released rows settled, and the rows recorded before a
//! new slot, read in its snapshot.

use super::error::classify;
use super::*;

/// Seconds since the oldest transaction the slot has not confirmed committed (0 when there
/// is none), read by decoding up to one transaction. It needs the REPLICATION right, and
/// fails while a reader is using the slot at that instant; retry then.
pub async fn pending_age_seconds(
    conn: &mut AsyncPgConnection,
    slot: &str,
    publication: &str,
) -> Result<f64, WalError> {
    let changes: Vec<Change> = match diesel::sql_query(
        "SELECT data FROM pg_logical_slot_peek_binary_changes($1::name, NULL, 1, \
         'proto_version', '1', 'publication_names', $2)",
    )
    .bind::<Text, _>(slot)
    .bind::<Text, _>(quote_ident(publication))
    .load(conn)
    .await
    {
        Ok(changes) => changes,
        Err(e) => return Err(classify(conn, e, slot).await),
    };
    for change in &changes {
        if let Message::Begin {
            commit_time_micros, ..
        } = pgoutput::decode(&change.data)?
        {
            let age = Utc::now() - pgoutput::commit_time(commit_time_micros);
            return Ok(age.to_std().unwrap_or_default().as_secs_f64());
        }
    }
    Ok(0.0)
}

/// Records an event the relay gave up on: its row gets `parked_at`, `attempts` and
/// `last_error`, and is written back (with its `seq`) when the recording side deleted it.
/// The reader passes over parked rows; `outbox-relay parked` lists them and `outbox-relay
/// retry` releases them, which the reader sees as an update and publishes.
pub async fn park(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    row: &OutboxRow,
    attempts: i32,
    error: &str,
) -> diesel::QueryResult<()> {
    diesel::sql_query(format!(
        "INSERT INTO {} (seq, id, aggregate_type, aggregate_id, event_type, payload, headers, \
         created_at, attempts, last_error, parked_at) OVERRIDING SYSTEM VALUE \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, now()) \
         ON CONFLICT (id) DO UPDATE SET attempts = EXCLUDED.attempts, \
         last_error = EXCLUDED.last_error, parked_at = now()",
        table.quoted()
    ))
    .bind::<BigInt, _>(row.seq)
    .bind::<diesel::sql_types::Uuid, _>(row.id)
    .bind::<Text, _>(&row.aggregate_type)
    .bind::<Text, _>(&row.aggregate_id)
    .bind::<Text, _>(&row.event_type)
    .bind::<diesel::sql_types::Jsonb, _>(&row.payload)
    .bind::<diesel::sql_types::Jsonb, _>(&row.headers)
    .bind::<diesel::sql_types::Timestamptz, _>(row.created_at)
    .bind::<Integer, _>(attempts)
    .bind::<Text, _>(error)
    .execute(conn)
    .await
    .map(drop)
}

/// Deletes up to `limit` captured rows: rows with `seq` at most `up_to_seq` (the highest
/// `seq` the relay has confirmed), recorded more than `older_than` ago, not parked, and
/// without a `last_error` (a parked row released by `outbox-relay retry` keeps it until the
/// reader has published it: its release is an UPDATE that the reader reads the row for).
/// Returns how many. Deleting a row never affects delivery: its insert is in the WAL.
pub async fn delete_captured(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    up_to_seq: i64,
    older_than: Duration,
    limit: i64,
) -> diesel::QueryResult<usize> {
    let t = table.quoted();
    diesel::sql_query(format!(
        "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} WHERE seq <= $1 AND parked_at IS NULL \
         AND last_error IS NULL AND created_at < now() - make_interval(secs => $2) ORDER BY seq LIMIT $3 \
         FOR UPDATE SKIP LOCKED)"
    ))
    .bind::<BigInt, _>(up_to_seq)
    .bind::<Double, _>(older_than.as_secs_f64())
    .bind::<BigInt, _>(limit)
    .execute(conn)
    .await
}

/// The rows `seqs` of `table` as they are now.
pub(super) async fn rows_by_seq(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seqs: &[i64],
) -> diesel::QueryResult<Vec<OutboxRow>> {
    diesel::sql_query(format!(
        "SELECT seq, id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, \
         attempts FROM {} WHERE seq = ANY($1) AND parked_at IS NULL ORDER BY seq",
        table.quoted()
    ))
    .bind::<Array<BigInt>, _>(seqs)
    .load(conn)
    .await
}

impl WalReader {
    /// Settles the released parked rows (`outbox-relay retry`) read in transactions confirmed
    /// by `confirmed`: their `last_error` is cleared, so that the cleanup of captured rows, which
    /// passes over rows with a `last_error`, may delete them. A released row keeps it until
    /// then, so the cleanup cannot delete it before the reader has read the release.
    pub async fn settle_released(
        &mut self,
        conn: &mut AsyncPgConnection,
        confirmed: Lsn,
    ) -> Result<(), WalError> {
        let seqs: Vec<i64> = self
            .released
            .iter()
            .filter(|(commit, _)| confirms(confirmed, *commit))
            .map(|(_, seq)| *seq)
            .collect();
        if seqs.is_empty() {
            return Ok(());
        }
        diesel::sql_query(format!(
            "UPDATE {} SET last_error = NULL WHERE seq = ANY($1) AND parked_at IS NULL",
            self.table.quoted()
        ))
        .bind::<Array<BigInt>, _>(&seqs)
        .execute(conn)
        .await?;
        self.released
            .retain(|(commit, _)| !confirms(confirmed, *commit));
        Ok(())
    }
}

/// Up to `limit` rows after `after_seq`, in `seq` order, that no relay has published and
/// that are not parked, as the snapshot transaction of [`WalReader::create_slot`] sees them:
/// the rows committed before the slot's consistent point.
pub async fn snapshot_rows(
    snapshot: &mut AsyncPgConnection,
    table: &OutboxTable,
    after_seq: i64,
    limit: i64,
) -> diesel::QueryResult<Vec<OutboxRow>> {
    diesel::sql_query(format!(
        "SELECT seq, id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, \
         attempts FROM {} WHERE published_at IS NULL AND parked_at IS NULL AND seq > $1 \
         ORDER BY seq LIMIT $2",
        table.quoted()
    ))
    .bind::<BigInt, _>(after_seq)
    .bind::<BigInt, _>(limit)
    .load(snapshot)
    .await
}

/// Ends the snapshot transaction of [`WalReader::create_slot`].
pub async fn end_snapshot(snapshot: &mut AsyncPgConnection) -> diesel::QueryResult<()> {
    snapshot.batch_execute("COMMIT").await
}

/// A change as `pg_logical_slot_peek_binary_changes` returns it.
#[derive(QueryableByName)]
pub(super) struct Change {
    #[diesel(sql_type = diesel::sql_types::Binary)]
    data: Vec<u8>,
}
