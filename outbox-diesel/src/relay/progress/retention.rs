//! Retention: the rows a cursor read a retention ago, deleted or archived, and the progress
//! rows no longer needed to tell them.

use diesel::QueryResult;
use diesel::sql_types::BigInt;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use crate::OutboxTable;

use super::{COVERED, PROGRESS_COVERS, progress_table};

/// Deletes up to `limit` rows a cursor read more than `older_than` ago (by the time of the
/// last batch recorded before then), oldest first; returns how many. The rows are found first
/// and deleted by `seq = ANY(…)` (primary-key lookups): with `seq IN (…)` the planner joins
/// the whole table to them, a scan of every kept row per call. The rows marked
/// `published_at` are [`delete_published`](crate::relay::delete_published)'s.
pub async fn delete_read(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    older_than: std::time::Duration,
    limit: i64,
) -> QueryResult<usize> {
    delete_read_in(conn, table, table, older_than, limit).await
}

/// Like [`delete_read`], for the rows of `rows_in` alone: `table` itself or one of its
/// partitions ([`Ring::current`](crate::relay::Ring::current), where a rotated table's cleanup deletes row by row).
pub async fn delete_read_in(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    rows_in: &OutboxTable,
    older_than: std::time::Duration,
    limit: i64,
) -> QueryResult<usize> {
    let t = rows_in.quoted();
    let sql = format!(
        "WITH {} DELETE FROM {t} WHERE seq = ANY(ARRAY(SELECT o.seq FROM {t} o \
         WHERE o.published_at IS NULL AND o.parked_at IS NULL \
         AND o.seq <= (SELECT max(upto_seq) FROM c) AND {COVERED} ORDER BY o.seq LIMIT $2 \
         FOR UPDATE SKIP LOCKED))",
        old_cursors_cte(table)
    );
    in_seq_order(conn, sql, older_than, limit).await
}

/// Runs `sql` (binds: the retention in seconds, the row limit) in a transaction with the relay
/// session's planner settings (`prepare_session`), for a connection that may not have them:
/// plans that read the table in `seq` order by its indexes (the planner cannot tell how many
/// rows the cover test keeps, and would otherwise scan and sort every kept row at each call),
/// and no JIT. The statement's estimated cost is far above `jit_above_cost`, and compiling it
/// took about 200 ms per call, ten times the deletion of its 5,000 rows.
async fn in_seq_order(
    conn: &mut AsyncPgConnection,
    sql: String,
    older_than: std::time::Duration,
    limit: i64,
) -> QueryResult<usize> {
    conn.transaction(async |conn| {
        conn.batch_execute(
            "SET LOCAL enable_seqscan = off; SET LOCAL enable_sort = off; \
             SET LOCAL jit = off",
        )
        .await?;
        diesel::sql_query(sql)
            .bind::<diesel::sql_types::Double, _>(older_than.as_secs_f64())
            .bind::<BigInt, _>(limit)
            .execute(conn)
            .await
    })
    .await
}

/// Like [`delete_read`], but moves the rows into `archive` (see
/// [`archive_published`](crate::relay::archive_published)), each with the time of the first batch
/// that covered it as its `published_at`; returns how many it moved.
pub async fn archive_read(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    archive: &OutboxTable,
    older_than: std::time::Duration,
    limit: i64,
) -> QueryResult<usize> {
    let (t, a, p) = (table.quoted(), archive.quoted(), progress_table(table));
    let columns = super::super::cleanup::ARCHIVE_COLUMNS;
    let dated = columns.replace(
        "published_at",
        &format!(
            "(SELECT p.published_at FROM {p} p WHERE {PROGRESS_COVERS} \
             ORDER BY p.upto_seq, p.id LIMIT 1)"
        ),
    );
    let sql = format!(
        "WITH {}, moved AS (DELETE FROM {t} WHERE seq = ANY(ARRAY(SELECT o.seq FROM {t} o \
         WHERE o.published_at IS NULL AND o.parked_at IS NULL \
         AND o.seq <= (SELECT max(upto_seq) FROM c) AND {COVERED} ORDER BY o.seq LIMIT $2 \
         FOR UPDATE SKIP LOCKED)) RETURNING {columns}) \
         INSERT INTO {a} ({columns}) SELECT {dated} FROM moved o",
        old_cursors_cte(table)
    );
    in_seq_order(conn, sql, older_than, limit).await
}

/// `c`: per partition of the newest count, the last cursor recorded more than `$1` seconds ago.
pub(super) fn old_cursors_cte(table: &OutboxTable) -> String {
    let p = progress_table(table);
    format!(
        "c AS MATERIALIZED (SELECT m.n AS partitions, g.p AS partition, l.upto_seq, l.snap, \
         l.late_after_seq, l.late_snap \
         FROM (SELECT partitions AS n FROM {p} ORDER BY id DESC LIMIT 1) m \
         CROSS JOIN generate_series(0, m.n - 1) AS g(p) \
         JOIN LATERAL (SELECT upto_seq, snap, late_after_seq, late_snap FROM {p} \
         WHERE partitions = m.n AND partition = g.p \
         AND published_at < now() - make_interval(secs => $1) ORDER BY id DESC LIMIT 1) l ON true)"
    )
}

/// Deletes the progress rows recorded more than `older_than` ago but the last of each
/// partition; returns how many. What they covered is older than the retention too, and
/// deleted by [`delete_read`] first.
pub async fn prune_progress(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    older_than: std::time::Duration,
) -> QueryResult<usize> {
    let p = progress_table(table);
    diesel::sql_query(format!(
        "DELETE FROM {p} WHERE published_at < now() - make_interval(secs => $1) \
         AND id NOT IN (SELECT max(id) FROM {p} GROUP BY partitions, partition)"
    ))
    .bind::<diesel::sql_types::Double, _>(older_than.as_secs_f64())
    .execute(conn)
    .await
}
