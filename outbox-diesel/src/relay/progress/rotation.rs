//! Cleanup of a rotated table ([`partition_table`](crate::partition_table)): a partition whose
//! every row is past the retention goes by one `TRUNCATE`.

use diesel::sql_types::{BigInt, Double, Nullable, Text};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use crate::OutboxTable;

use super::super::Flag;
use super::COVERED;
use super::retention::old_cursors_cte;

/// The partitions of a rotated outbox table, and the one that holds its newest row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ring {
    /// Every partition, by name.
    pub partitions: Vec<OutboxTable>,
    /// The partition being filled: the one the identity's last `seq` went to (the highest
    /// `seq` in the table or read by a cursor, for a role that may not read the sequence;
    /// `None` when no `seq` was taken yet, or the partition key is not [`partition_table`]'s
    /// `(seq / R) % N`). Cleanup deletes row by row there only.
    ///
    /// [`partition_table`]: crate::partition_table
    pub current: Option<OutboxTable>,
    /// Whether this session's role may empty every partition (`TRUNCATE` and `DELETE` on
    /// each, which [`partition_table`](crate::partition_table) grants to the roles that may
    /// delete from the table). Without, cleanup deletes row by row through the table.
    pub may_truncate: bool,
    /// Whether the table has what an ordered relay's cursors need
    /// ([`has_progress`](super::has_progress)): its rows not marked go when a cursor covers
    /// them.
    pub cursors: bool,
}

#[derive(QueryableByName)]
struct PartitionName {
    #[diesel(sql_type = Text)]
    schema: String,
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    current: Option<i64>,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    may_truncate: bool,
}

/// The partitions of `table` when it is partitioned ([`partition_table`](crate::partition_table)),
/// `None` when it is a plain table.
pub async fn ring(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<Option<Ring>> {
    let t = table.quoted();
    // the last seq taken: the identity's (when this role may read its sequence), or else the
    // highest seq in the table or read by a cursor (the newest row may be deleted already)
    let cursors = super::has_progress(conn, table).await?;
    let read = if cursors {
        format!(", (SELECT max(upto_seq) FROM {})", table.progress_table())
    } else {
        String::new()
    };
    let found: Vec<PartitionName> = diesel::sql_query(format!(
        "WITH s AS (SELECT pg_get_serial_sequence($1, 'seq') AS s), \
         k AS (SELECT substring(d FROM 'seq / ([0-9]+)')::int8 AS r, \
         substring(d FROM '% \\(?([0-9]+)')::int8 AS n, \
         GREATEST(CASE WHEN has_sequence_privilege((SELECT s FROM s), 'SELECT') \
         THEN pg_sequence_last_value((SELECT s FROM s)) END, \
         (SELECT max(seq) FROM {t}){read}) AS last \
         FROM pg_get_partkeydef($1::regclass) d) \
         SELECT n.nspname::text AS schema, c.relname::text AS name, \
         CASE WHEN pg_get_expr(c.relpartbound, c.oid) = \
         (SELECT format('FOR VALUES IN (''%s'')', (last / r) % k.n) FROM k) THEN 1 END::int8 AS current, \
         has_table_privilege(c.oid, 'TRUNCATE') AND has_table_privilege(c.oid, 'DELETE') \
         AND has_table_privilege(c.oid, 'SELECT') AS may_truncate \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE i.inhparent = $1::regclass ORDER BY c.relname"
    ))
    .bind::<Text, _>(&t)
    .load(conn)
    .await?;
    if found.is_empty() {
        return Ok(None);
    }
    let mut ring = Ring {
        partitions: Vec::with_capacity(found.len()),
        current: None,
        may_truncate: found.iter().all(|p| p.may_truncate),
        cursors,
    };
    for p in found {
        let Ok(part) = OutboxTable::with_schema(p.schema, p.name) else {
            continue;
        };
        if p.current.is_some() {
            ring.current = Some(part.clone());
        }
        ring.partitions.push(part);
    }
    Ok(Some(ring))
}

/// Whether every row of the partition `part` of `table` may go: none is parked or held back,
/// the rows marked `published_at` were marked more than `$1` seconds ago, and the others
/// are covered by a cursor recorded more than `$1` seconds ago (its own partition's). Index
/// reads only where the cursors are not far behind: the rows past the lowest cursor or not
/// surely seen by every cursor's snapshot are checked one by one.
fn all_expired_sql(table: &OutboxTable, part: &OutboxTable, cursors: bool) -> String {
    let p = part.quoted();
    let unmarked = if cursors {
        format!(
            "COALESCE((SELECT count(*) FROM c) = (SELECT n FROM counts) \
             AND NOT EXISTS (SELECT 1 FROM {p} o WHERE o.published_at IS NULL \
             AND (o.seq > (SELECT min(upto_seq) FROM c) \
                  OR o.txid >= (SELECT min(pg_snapshot_xmin(snap)) FROM c)) \
             AND NOT {COVERED}), false)"
        )
    } else {
        "false".to_owned()
    };
    let with = if cursors {
        format!(
            "WITH {}, counts AS (SELECT partitions AS n FROM {} ORDER BY id DESC LIMIT 1) ",
            old_cursors_cte(table),
            table.progress_table()
        )
    } else {
        String::new()
    };
    format!(
        "{with}SELECT NOT EXISTS (SELECT 1 FROM {p} WHERE parked_at IS NOT NULL) \
         AND COALESCE((SELECT max(published_at) FROM {p} WHERE published_at IS NOT NULL) \
             < now() - make_interval(secs => $1), true) \
         AND (NOT EXISTS (SELECT 1 FROM {p} WHERE published_at IS NULL) OR {unmarked}) AS flag"
    )
}

/// Empties, with one `TRUNCATE` each, the partitions of the rotated `table` (see [`ring`])
/// other than the one being filled whose every row is past `older_than`: marked published
/// before then, or covered by an ordered relay's cursor recorded before then; none parked.
/// Returns the names of the partitions it emptied.
///
/// A partition that a transaction still writes or reads (a lock of another session on it
/// other than a reader's) is left for the next call; the others are locked for the
/// `TRUNCATE` within 200 ms (`lock_timeout`: a relay's statement holds its read lock for
/// milliseconds), and checked again under the lock, so a row committed meanwhile keeps its
/// partition.
pub async fn truncate_expired(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    ring: &Ring,
    older_than: std::time::Duration,
) -> QueryResult<Vec<OutboxTable>> {
    let cursors = ring.cursors;
    let mut emptied = Vec::new();
    for part in &ring.partitions {
        if ring.current.as_ref() == Some(part) {
            continue;
        }
        let p = part.quoted();
        let check = all_expired_sql(table, part, cursors);
        // empty, still written, or not all expired: nothing to do before taking a lock
        let worth: Flag = diesel::sql_query(format!(
            "SELECT EXISTS (SELECT 1 FROM {p}) AND NOT EXISTS (SELECT 1 FROM pg_locks l \
             WHERE l.relation = $1::regclass AND l.pid <> pg_backend_pid() \
             AND l.mode <> 'AccessShareLock') AS flag"
        ))
        .bind::<Text, _>(&p)
        .get_result(conn)
        .await?;
        if worth.flag != Some(true) || !expired(conn, &check, older_than).await? {
            continue;
        }
        let truncated = conn
            .transaction(async |conn| {
                conn.batch_execute(&format!(
                    "SET LOCAL lock_timeout = '200ms'; LOCK TABLE {p} IN ACCESS EXCLUSIVE MODE"
                ))
                .await?;
                if !expired(conn, &check, older_than).await? {
                    return Ok::<_, diesel::result::Error>(false);
                }
                conn.batch_execute(&format!("TRUNCATE {p}")).await?;
                Ok(true)
            })
            .await;
        match truncated {
            Ok(true) => emptied.push(part.clone()),
            Ok(false) => {}
            // the lock not had in time: another session's lock on it (sorted by the server's
            // state, not by the error's words), for the next call
            Err(e) if locked_by_others(conn, &p).await? => {
                tracing::debug!(partition = %part, error = %e, "a partition to truncate is in use; next round");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(emptied)
}

/// Whether a session other than this one holds a lock on the relation `p` (quoted).
async fn locked_by_others(conn: &mut AsyncPgConnection, p: &str) -> QueryResult<bool> {
    let f: Flag = diesel::sql_query(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE relation = $1::regclass \
         AND pid <> pg_backend_pid()) AS flag",
    )
    .bind::<Text, _>(p)
    .get_result(conn)
    .await?;
    Ok(f.flag == Some(true))
}

/// Runs `check` (see [`all_expired_sql`]) by the partition's indexes: the planner cannot tell
/// how few rows lie past the cursors, and would otherwise scan the partition, a read of every
/// row at each check.
async fn expired(
    conn: &mut AsyncPgConnection,
    check: &str,
    older_than: std::time::Duration,
) -> QueryResult<bool> {
    conn.transaction(async |conn| {
        conn.batch_execute("SET LOCAL enable_seqscan = off; SET LOCAL jit = off")
            .await?;
        let f: Flag = diesel::sql_query(check)
            .bind::<Double, _>(older_than.as_secs_f64())
            .get_result(conn)
            .await?;
        Ok(f.flag == Some(true))
    })
    .await
}
