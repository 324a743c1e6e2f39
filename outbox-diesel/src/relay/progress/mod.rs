//! Snapshot batches: how the ordered relay reads its partitions and records what it published
//! without a write per row.
//!
//! Every row carries the id of the transaction that inserted it (`txid`, `xid8`). Per
//! partition, the relay keeps a [`Cursor`]: the highest `seq` it has read, `W`, and the snapshot
//! `S` it read at. What it has read is exactly the rows with `seq <= W` that `S` sees. A batch
//! runs one statement, whose snapshot `cur` becomes the next `S`, and reads:
//!
//! - the next rows after `W`, in `seq` order (the poll's index), up to the batch size;
//! - the late rows: `seq <= W` but not seen by `S`, so inserted by a transaction in progress at
//!   `S` (its `xip` list) or begun after it (at or above its `xmax`). They are found by
//!   transaction id (the index `outbox_txid`), so a transaction held open for an hour costs a
//!   lookup of its id, not a rescan of everything recorded since it began (PgQ's batches);
//! - the rows `outbox-relay retry` released after the relay had read past them
//!   (`parked_at = 'infinity'`, the index `outbox_released`).
//!
//! The new cursor is `(max seq read, cur)`: every row at or below it that `cur` sees was read,
//! either before (seen by `S`) or now.
//!
//! Late rows come within the batch's limits (rows and bytes), like the next ones. When a
//! partition has more than that (a large transaction held open across batches commits), its
//! cursor keeps `(W, S)` and starts a [`LatePass`] at the statement's snapshot `S2`: the next
//! batches read the late rows `S2` sees after the pass's `seq`, in parts, in `seq` order, and
//! none of the partition's next rows; once through, the cursor is `(W, S2)`, and what `S2` did
//! not see is late for it as before. Each part's progress row records the pass with its cursor
//! (`late_after_seq`, `late_snap`), so that a relay taking the partition over during the pass
//! goes on where it stood.
//!
//! A relay reads every partition it owns with one statement ([`fetch_batches`]): the next rows
//! are one walk through those partitions' rows after the lowest of their cursors, and each
//! cursor moves to where the walk ended, since the walk saw every row of each up to there (a
//! row at or below its own partition's cursor, which cursors that differ after a take-over
//! meet, is passed over and not counted against the batch's limits). The late rows are found per cursor; a row is late for its own
//! partition only. After the acks, the relay records the cursor with one
//! `INSERT` per batch into `<table>_progress`; nothing is written per row. The view
//! `<table>_audit` answers `published_at` for the rows a cursor covers (the time of the first
//! batch that covered the row), and cleanup deletes the rows a cursor covered a retention ago.
//!
//! Late commits are never skipped, whatever the order of `seq` and commits: a committed row is
//! read by the first batch whose snapshot sees it. Two transactions of one aggregate serialised
//! by a lock commit in `seq` order, and the first is seen by every snapshot that sees the
//! second: the first is read in the same batch (rows go out in `seq` order) or an earlier one.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::sql_types::{Array, BigInt, Integer, Nullable, Text};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;

use super::Partition;

mod batch;
mod coverage;
mod quiet;
mod retention;
mod rotation;
mod statement;

pub use batch::*;
pub(crate) use coverage::Coverage;
pub use quiet::*;
pub use retention::*;
pub use rotation::*;

/// Where a partition's reading stands: every row with `seq <= upto_seq` that the snapshot
/// `snap` sees has been read, and, while a [`LatePass`] runs, the late rows it has read too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// The highest `seq` read.
    pub upto_seq: i64,
    /// The snapshot the rows were read at, as PostgreSQL writes a `pg_snapshot`
    /// (`xmin:xmax:xip,…`).
    pub snap: String,
    /// The late rows being read in parts, when they were more than a batch holds.
    pub late: Option<LatePass>,
}

/// Late rows read in parts: more committed at or below a cursor's `seq` than a batch holds
/// (a large transaction held open across batches). The pass reads, in `seq` order and within
/// the batch's limits, the late rows that its snapshot `snap` sees, after `after_seq`; the
/// partition's next rows wait until it ends, and its cursor then becomes `(upto_seq, snap)`.
/// The progress table records the pass with its cursor (`late_after_seq`, `late_snap`): a
/// relay that takes the partition over during the pass goes on after its last recorded part,
/// and `<table>_audit` dates each row the pass read by the part that read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatePass {
    /// The highest `seq` the pass has read.
    pub after_seq: i64,
    /// The snapshot of the statement that found the late rows: the pass reads what it sees.
    pub snap: String,
}

/// A cursor as the progress table stores it.
#[derive(QueryableByName)]
struct StoredCursor {
    #[diesel(sql_type = BigInt)]
    upto_seq: i64,
    #[diesel(sql_type = Text)]
    snap: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    late_after_seq: Option<i64>,
    #[diesel(sql_type = Nullable<Text>)]
    late_snap: Option<String>,
}

impl From<StoredCursor> for Cursor {
    fn from(c: StoredCursor) -> Cursor {
        Cursor {
            upto_seq: c.upto_seq,
            snap: c.snap,
            late: c
                .late_after_seq
                .zip(c.late_snap)
                .map(|(after_seq, snap)| LatePass { after_seq, snap }),
        }
    }
}

impl Cursor {
    /// A partition nothing was read from: no `seq` at or below 0, a snapshot that sees nothing.
    pub fn start() -> Cursor {
        Cursor::at(0, "1:1:")
    }

    /// Its late pass's `seq`, if it is in one.
    pub(crate) fn late_after_seq(&self) -> Option<i64> {
        self.late.as_ref().map(|l| l.after_seq)
    }

    /// Its late pass's snapshot, if it is in one.
    pub(crate) fn late_snap(&self) -> Option<&str> {
        self.late.as_ref().map(|l| l.snap.as_str())
    }

    /// The rows with `seq <= upto_seq` that `snap` sees.
    pub fn at(upto_seq: i64, snap: impl Into<String>) -> Cursor {
        Cursor {
            upto_seq,
            snap: snap.into(),
            late: None,
        }
    }
}

fn progress_table(table: &OutboxTable) -> String {
    table.progress_table()
}

/// `c`: the last cursor of every partition of the newest partition count in the progress
/// table (a partition not read yet: [`Cursor::start`]), with its late pass (NULLs when none);
/// no row when nothing was recorded. The pass is read through `to_jsonb` of the progress row,
/// so that the operations also read a progress table made before passes were recorded
/// (whose relays recorded none), which has no columns for them.
pub(crate) fn cursors_cte(table: &OutboxTable) -> String {
    let p = progress_table(table);
    format!(
        "c AS MATERIALIZED (SELECT m.n AS partitions, g.p AS partition, \
         COALESCE(l.upto_seq, 0) AS upto_seq, COALESCE(l.snap, '1:1:'::pg_snapshot) AS snap, \
         l.published_at, (l.j ->> 'late_after_seq')::int8 AS late_after_seq, \
         (l.j ->> 'late_snap')::pg_snapshot AS late_snap \
         FROM (SELECT partitions AS n FROM {p} ORDER BY id DESC LIMIT 1) m \
         CROSS JOIN generate_series(0, m.n - 1) AS g(p) \
         LEFT JOIN LATERAL (SELECT r.upto_seq, r.snap, r.published_at, to_jsonb(r) AS j \
         FROM {p} r WHERE r.partitions = m.n AND r.partition = g.p ORDER BY r.id DESC LIMIT 1) l \
         ON true)"
    )
}

/// Whether row `o` was read by its partition's cursor in `c` (see [`cursors_cte`]): at or below
/// its `seq` and seen by its snapshot, or read by its late pass.
pub(crate) const COVERED: &str = "EXISTS (SELECT 1 FROM c WHERE o.aggregate_hash % c.partitions \
     = c.partition AND o.seq <= c.upto_seq AND (pg_visible_in_snapshot(o.txid, c.snap) \
     OR (o.seq <= c.late_after_seq AND pg_visible_in_snapshot(o.txid, c.late_snap))))";

/// Whether the progress row `p` covers row `o`: the first such row of `o`'s partition (by
/// `upto_seq`, then `id`) is the batch that read it, and dates its publication.
pub(crate) const PROGRESS_COVERS: &str = "p.upto_seq >= o.seq \
     AND p.partition = o.aggregate_hash % p.partitions \
     AND (pg_visible_in_snapshot(o.txid, p.snap) \
     OR (p.late_after_seq >= o.seq AND pg_visible_in_snapshot(o.txid, p.late_snap)))";

/// Whether `table` has what snapshot batches need: its `txid` column and its progress table,
/// with the columns that record a late pass. A table made before them gets them from
/// [`create_table`](crate::create_table) or the migrations.
pub async fn has_progress(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<bool> {
    progress_with(conn, table, "late_after_seq").await
}

/// Whether `table` has a `txid` column and a progress table, whether or not it records late
/// passes: cursors an ordered relay recorded, which the operations read.
pub(crate) async fn has_cursors(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<bool> {
    progress_with(conn, table, "partition").await
}

/// Whether `table` has a `txid` column and a progress table with the column `column`.
async fn progress_with(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    column: &str,
) -> QueryResult<bool> {
    let f: super::Flag = super::prepared::Prepared {
        pieces: &[
            "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(",
            ") AND attname = ",
            " AND NOT attisdropped) AND EXISTS (SELECT 1 FROM pg_attribute \
             WHERE attrelid = to_regclass(",
            ") AND attname = 'txid' AND NOT attisdropped) AS flag",
        ],
        binds: &[&progress_table(table), column, &table.quoted()],
    }
    .get_result(conn)
    .await?;
    Ok(f.flag.unwrap_or(false))
}

/// The last recorded cursor of `partition`, if any.
pub async fn load_cursor(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partition: Partition,
) -> QueryResult<Option<Cursor>> {
    let rows: Vec<StoredCursor> = diesel::sql_query(format!(
        "SELECT upto_seq, snap::text AS snap, late_after_seq, late_snap::text AS late_snap \
         FROM {} WHERE partitions = $1 AND partition = $2 ORDER BY id DESC LIMIT 1",
        progress_table(table)
    ))
    .bind::<Integer, _>(partition.count as i32)
    .bind::<Integer, _>(partition.index as i32)
    .load(conn)
    .await?;
    Ok(rows.into_iter().next().map(Cursor::from))
}

/// The first key of the transaction advisory lock that serialises changing a table's
/// partition count in its progress (the second is the table's OID): `'OBPC'` in ASCII.
pub const PROGRESS_LOCK_KEY: i32 = 0x4F42_5043;

/// Where `partition` goes on from: its last recorded cursor; when it has none and the
/// progress was recorded under another partition count, every partition of the new count
/// starts from what all the old ones read (the lowest `seq`, a snapshot that sees only what
/// every old snapshot sees), and the rows an old cursor read beyond that start are marked
/// `published_at` once, so that none is published again; otherwise [`Cursor::start`].
///
/// Relays of one table agree on the partition count before they read (see
/// [`AdvisoryLock::PartitionCount`](super::AdvisoryLock::PartitionCount)).
pub async fn start_cursor(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partition: Partition,
) -> QueryResult<Cursor> {
    if let Some(c) = load_cursor(conn, table, partition).await? {
        return Ok(c);
    }
    let t = table.quoted();
    let p = progress_table(table);
    let cte = cursors_cte(table);
    conn.transaction(async |conn| {
        lock_progress(conn, &t).await?;
        if let Some(c) = load_cursor(conn, table, partition).await? {
            // another relay of the new count moved the progress meanwhile
            return Ok(c);
        }
        #[derive(QueryableByName)]
        struct Newest {
            #[diesel(sql_type = Nullable<Integer>)]
            n: Option<i32>,
        }
        let newest: Newest = diesel::sql_query(format!(
            "SELECT (SELECT partitions FROM {p} ORDER BY id DESC LIMIT 1) AS n"
        ))
        .get_result(conn)
        .await?;
        let Some(old) = newest.n.filter(|&n| n != partition.count as i32) else {
            return Ok(Cursor::start());
        };
        // the start every new partition shares: the lowest seq, and a snapshot that sees a
        // transaction only when every old one does
        let start: StoredCursor = diesel::sql_query(format!(
            "WITH {cte}, lim AS (SELECT min(upto_seq) AS w, min(pg_snapshot_xmin(snap)) AS xmin, \
             min(pg_snapshot_xmax(snap)) AS xmax FROM c) \
             SELECT lim.w AS upto_seq, (lim.xmin::text || ':' || lim.xmax::text || ':' || \
             COALESCE((SELECT string_agg(x::text, ',' ORDER BY x) FROM (SELECT DISTINCT x \
             FROM c, pg_snapshot_xip(c.snap) AS x WHERE x < lim.xmax) d), ''))::pg_snapshot::text \
             AS snap, NULL::int8 AS late_after_seq, NULL::text AS late_snap FROM lim"
        ))
        .get_result(conn)
        .await?;
        // what an old cursor read and the shared start does not cover: marked, once
        let marked = diesel::sql_query(format!(
            "WITH {cte} UPDATE {t} o SET published_at = now() \
             WHERE o.published_at IS NULL AND o.parked_at IS NULL AND {COVERED} \
             AND (o.seq > $1 OR o.txid = ANY(ARRAY(SELECT pg_snapshot_xip($2::pg_snapshot))) \
             OR o.txid >= pg_snapshot_xmax($2::pg_snapshot))"
        ))
        .bind::<BigInt, _>(start.upto_seq)
        .bind::<Text, _>(&start.snap)
        .execute(conn)
        .await?;
        diesel::sql_query(format!(
            "INSERT INTO {p} (partitions, partition, upto_seq, snap) \
             SELECT $1, g, $2, $3::pg_snapshot FROM generate_series(0, $1 - 1) AS g"
        ))
        .bind::<Integer, _>(partition.count as i32)
        .bind::<BigInt, _>(start.upto_seq)
        .bind::<Text, _>(&start.snap)
        .execute(conn)
        .await?;
        tracing::info!(
            from_partitions = old,
            to_partitions = partition.count,
            marked,
            "progress moved to the new partition count"
        );
        Ok(Cursor::from(start))
    })
    .await
}

/// Takes the transaction's lock on the progress of the table `quoted` (named as SQL quotes
/// it), which orders moving the progress to a new partition count and settling it.
async fn lock_progress(conn: &mut AsyncPgConnection, quoted: &str) -> QueryResult<()> {
    diesel::sql_query(format!(
        "SELECT pg_advisory_xact_lock({PROGRESS_LOCK_KEY}, to_regclass($1)::oid::int)"
    ))
    .bind::<Text, _>(quoted)
    .execute(conn)
    .await
    .map(drop)
}

/// The `INSERT` of [`record_progress`], which Diesel prepares once per session and runs on its
/// cached statement (a statement of `sql_query` is never cached: it was prepared and planned
/// again at every batch).
struct RecordProgress<'a> {
    table: String,
    counts: &'a [i32],
    indexes: &'a [i32],
    seqs: &'a [i64],
    snaps: &'a [&'a str],
    late_seqs: &'a [Option<i64>],
    late_snaps: &'a [Option<&'a str>],
}

impl QueryId for RecordProgress<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for RecordProgress<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO ");
        out.push_sql(&self.table);
        out.push_sql(
            " (partitions, partition, upto_seq, snap, late_after_seq, late_snap) \
             SELECT n, i, s, x::pg_snapshot, ls, lx::pg_snapshot FROM unnest(",
        );
        out.push_bind_param::<Array<Integer>, _>(self.counts)?;
        out.push_sql("::int[], ");
        out.push_bind_param::<Array<Integer>, _>(self.indexes)?;
        out.push_sql("::int[], ");
        out.push_bind_param::<Array<BigInt>, _>(self.seqs)?;
        out.push_sql("::bigint[], ");
        out.push_bind_param::<Array<Text>, _>(self.snaps)?;
        out.push_sql("::text[], ");
        out.push_bind_param::<Array<Nullable<BigInt>>, _>(self.late_seqs)?;
        out.push_sql("::bigint[], ");
        out.push_bind_param::<Array<Nullable<Text>>, _>(self.late_snaps)?;
        out.push_sql("::text[]) AS u(n, i, s, x, ls, lx)");
        Ok(())
    }
}

impl<Conn> diesel::RunQueryDsl<Conn> for RecordProgress<'_> {}

/// Records the cursors of a batch, one row per partition, each with its late pass; the last one
/// of a partition is where its next owner goes on from. One statement, prepared once per
/// session. Traced as the span `outbox.mark`.
#[tracing::instrument(name = "outbox.mark", level = "debug", skip_all, fields(outbox.table = %table, outbox.partitions = cursors.len()))]
pub async fn record_progress(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    cursors: &[(Partition, Cursor)],
) -> QueryResult<()> {
    if cursors.is_empty() {
        return Ok(());
    }
    let counts: Vec<i32> = cursors.iter().map(|(p, _)| p.count as i32).collect();
    let indexes: Vec<i32> = cursors.iter().map(|(p, _)| p.index as i32).collect();
    let seqs: Vec<i64> = cursors.iter().map(|(_, c)| c.upto_seq).collect();
    let snaps: Vec<&str> = cursors.iter().map(|(_, c)| c.snap.as_str()).collect();
    let late_seqs: Vec<Option<i64>> = cursors.iter().map(|(_, c)| c.late_after_seq()).collect();
    let late_snaps: Vec<Option<&str>> = cursors.iter().map(|(_, c)| c.late_snap()).collect();
    RecordProgress {
        table: progress_table(table),
        counts: &counts,
        indexes: &indexes,
        seqs: &seqs,
        snaps: &snaps,
        late_seqs: &late_seqs,
        late_snaps: &late_snaps,
    }
    .execute(conn)
    .await
    .map(drop)
}

/// Whether the session's role holds `rights` (`has_table_privilege`'s list) on the progress
/// table of `table`, which exists.
async fn may_read_progress(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    rights: &str,
) -> QueryResult<bool> {
    let may: super::Flag =
        diesel::sql_query("SELECT has_table_privilege(to_regclass($1), $2) AS flag")
            .bind::<Text, _>(progress_table(table))
            .bind::<Text, _>(rights)
            .get_result(conn)
            .await?;
    Ok(may.flag == Some(true))
}

/// Marks `published_at` on every row a cursor read and forgets the cursors: for a relay of
/// another mode (unordered, log tailing) taking over a table the ordered relay published
/// from, so that it does not publish those rows again. Returns how many rows it marked.
pub async fn settle_progress(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<usize> {
    if !has_cursors(conn, table).await? {
        return Ok(0);
    }
    if !may_read_progress(conn, table, "SELECT, DELETE").await? {
        // a role without rights on the progress was never an ordered relay's: nothing to settle
        // that it could read
        tracing::debug!(
            "no rights on the progress table; an ordered relay's progress is not settled"
        );
        return Ok(0);
    }
    let t = table.quoted();
    let p = progress_table(table);
    let cte = cursors_cte(table);
    conn.transaction(async |conn| {
        lock_progress(conn, &t).await?;
        let marked = diesel::sql_query(format!(
            "WITH {cte} UPDATE {t} o SET published_at = now() \
             WHERE o.published_at IS NULL AND o.parked_at IS NULL AND {COVERED}"
        ))
        .execute(conn)
        .await?;
        // released rows not published yet: to be published as any unpublished row
        diesel::sql_query(format!(
            "UPDATE {t} SET parked_at = NULL WHERE parked_at = 'infinity' AND published_at IS NULL"
        ))
        .execute(conn)
        .await?;
        diesel::sql_query(format!("DELETE FROM {p}"))
            .execute(conn)
            .await?;
        Ok(marked)
    })
    .await
}
