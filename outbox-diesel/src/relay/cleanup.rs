//! Cleanup: deleting or archiving published rows past their retention.

use diesel::QueryResult;
use diesel::sql_types::BigInt;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;

/// Deletes up to `limit` rows published more than `older_than` ago, oldest first (found
/// through the partial index `outbox_published`), skipping rows another cleaner has locked
/// (`SKIP LOCKED`, so concurrent cleaners never wait on each other); returns how many.
/// Bounded batches keep locks short; call it until it returns less than `limit`. Unpublished
/// rows, and so the relay's poll, are never touched.
pub async fn delete_published(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    older_than: std::time::Duration,
    limit: i64,
) -> QueryResult<usize> {
    let t = table.quoted();
    diesel::sql_query(format!(
        "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} WHERE published_at IS NOT NULL \
         AND published_at < now() - make_interval(secs => $1) ORDER BY published_at LIMIT $2 \
         FOR UPDATE SKIP LOCKED)"
    ))
    .bind::<diesel::sql_types::Double, _>(older_than.as_secs_f64())
    .bind::<BigInt, _>(limit)
    .execute(conn)
    .await
}

/// The columns an archive table takes (`CREATE TABLE outbox_archive (LIKE outbox)`).
pub(crate) const ARCHIVE_COLUMNS: &str = "seq, id, aggregate_type, aggregate_id, event_type, \
     payload, headers, created_at, published_at, aggregate_hash, attempts, last_error, parked_at, \
     txid";

/// Like [`delete_published`], but moves the rows into `archive` in the same statement (a
/// table with the outbox's columns, e.g. `CREATE TABLE outbox_archive (LIKE outbox)`);
/// returns how many it moved.
pub async fn archive_published(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    archive: &OutboxTable,
    older_than: std::time::Duration,
    limit: i64,
) -> QueryResult<usize> {
    let columns = ARCHIVE_COLUMNS;
    let (t, a) = (table.quoted(), archive.quoted());
    diesel::sql_query(format!(
        "WITH moved AS (DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} \
         WHERE published_at IS NOT NULL AND published_at < now() - make_interval(secs => $1) \
         ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED) RETURNING {columns}) \
         INSERT INTO {a} ({columns}) SELECT {columns} FROM moved"
    ))
    .bind::<diesel::sql_types::Double, _>(older_than.as_secs_f64())
    .bind::<BigInt, _>(limit)
    .execute(conn)
    .await
}
