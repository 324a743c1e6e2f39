//! Reads that skip the batch statement while nothing new can be read: an idle relay's poll.
//!
//! A batch statement reads what its snapshot sees from where the cursors stand. Once one found
//! nothing, the next poll asks a smaller question first, and reads the partitions again only
//! when it says rows may have come (or, once the snapshot moved, at least once a second:
//! [`QUIET_READ_EVERY`]):
//!
//! - whether the snapshot moved at all: two equal snapshots (`xmin:xmax:xip`) see the same
//!   transactions committed, and every write takes a transaction id;
//! - whether the table holds a row the read's snapshot did not see: every row carries the id
//!   of the transaction that inserted it (`txid`), and a row that snapshot did not see has an
//!   id in its in-progress list or at or above its `xmax` (two probes of the `txid` index);
//! - whether a row is released (`retry`) and not among those the relay has in flight.
//!
//! The snapshot is the whole cluster's, so the first alone lets every write anywhere send the
//! relay back to its partitions; the second keeps it at the question while other tables and
//! databases are written. Rows of a transaction in progress at the last read (late ones) have
//! an id in its in-progress list, and are read at the first poll after their commit. What the
//! question does not see is a row made readable by an `UPDATE` that keeps its `txid` (an
//! operator setting `parked_at` back by hand), or inserted with an earlier transaction's id:
//! either moves the snapshot, and a read runs at least once a second while it moved. On a
//! database where nothing is written, the relay reads no more than the question.

use std::time::{Duration, Instant};

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{Bool, Text};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;
use crate::relay::prepared::Prepared;

use super::Cursor;
use super::batch::{Batch, Partitioning, Read, read_batches_in};

/// A relay's reads of its partitions: [`fetch_batches_in`](super::fetch_batches_in), but after
/// a read that found nothing, each read first asks PostgreSQL whether rows may have come since
/// ([`written_since`]), and runs the batch statement only when they may, when it reads from
/// other cursors, or when the snapshot moved since the last one ran [`QUIET_READ_EVERY`] ago
/// ([`QuietSince`]). An idle relay's poll is then one small statement, prepared once per
/// session like the batch statement.
///
/// ```no_run
/// use outbox_diesel::OutboxTable;
/// use outbox_diesel::relay::{Cursor, Partitioning, Reads};
///
/// # async fn run(conn: &mut diesel_async::AsyncPgConnection) -> diesel::QueryResult<()> {
/// let table = OutboxTable::DEFAULT;
/// let mut reads = Reads::default();
/// let cursors = vec![(0, Cursor::start())];
/// loop {
///     let batches = reads
///         .fetch(conn, &table, Partitioning::new(1), &cursors, &[], 500, 8 << 20)
///         .await?;
///     // ... publish the rows, move the cursors on
///     # break;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct Reads {
    quiet: Option<Quiet>,
}

/// How often an idle relay reads its partitions whatever the question says, once the snapshot
/// moved since its last read: the bound on how long a row the question does not see waits (one
/// made readable by an `UPDATE` that keeps its `txid`, or inserted with an earlier
/// transaction's id; either moves the snapshot).
pub const QUIET_READ_EVERY: Duration = Duration::from_secs(1);

/// A read that found nothing, as an idle relay keeps it: the snapshot it read at, the latest
/// snapshot the question found nothing new at, and when it read. [`ask`](Self::ask) says
/// whether to read again.
///
/// ```no_run
/// use outbox_diesel::OutboxTable;
/// use outbox_diesel::relay::{QuietSince, current_snapshot};
///
/// # async fn run(conn: &mut diesel_async::AsyncPgConnection) -> diesel::QueryResult<()> {
/// let table = OutboxTable::DEFAULT;
/// let snapshot = current_snapshot(conn).await?;
/// // ... a read after `snapshot` was taken found nothing
/// let mut quiet = QuietSince::new(snapshot);
/// match quiet.ask(conn, &table, &[]).await? {
///     None => { /* nothing new: wait for the next poll */ }
///     Some(now) => { /* read again; `now` was taken before the read */ }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct QuietSince {
    read: String,
    seen: String,
    read_at: Instant,
}

impl QuietSince {
    /// After a read that found nothing at `snapshot` (or later: a snapshot taken before it).
    pub fn new(snapshot: String) -> Self {
        QuietSince {
            seen: snapshot.clone(),
            read: snapshot,
            read_at: Instant::now(),
        }
    }

    /// Asks PostgreSQL whether a read now could find rows of `table` (other than the released
    /// rows `exclude`) that the last one did not: `None` when it cannot, or the session's
    /// current snapshot when it may, or when the snapshot moved since the read
    /// [`QUIET_READ_EVERY`] ago or more. One statement ([`current_snapshot`]) while the
    /// snapshot stays; once it moved, [`written_since`] too.
    pub async fn ask(
        &mut self,
        conn: &mut AsyncPgConnection,
        table: &OutboxTable,
        exclude: &[i64],
    ) -> QueryResult<Option<String>> {
        // the snapshot alone first: a statement PostgreSQL starts at a fraction of the cost of
        // the probes' (whose plan it starts whether they run or not), and on a quiet database
        // the whole question
        let now = current_snapshot(conn).await?;
        if now == self.seen {
            return Ok(None);
        }
        let since = written_since(conn, table, &self.seen, exclude).await?;
        if since.written
            || (self.read_at.elapsed() >= QUIET_READ_EVERY && since.snapshot != self.read)
        {
            return Ok(Some(since.snapshot));
        }
        // what the new snapshot sees of the table, the last read's saw
        self.seen = since.snapshot;
        Ok(None)
    }
}

/// The last read, which found nothing: what it read from, and at which snapshot.
#[derive(Debug)]
struct Quiet {
    table: OutboxTable,
    partitioning: Partitioning,
    cursors: Vec<(u32, Cursor)>,
    exclude: Vec<i64>,
    since: QuietSince,
}

impl Quiet {
    fn reads(
        &self,
        table: &OutboxTable,
        partitioning: Partitioning,
        cursors: &[(u32, Cursor)],
        exclude: &[i64],
    ) -> bool {
        self.partitioning == partitioning
            && self.cursors == cursors
            && self.exclude == exclude
            && self.table == *table
    }
}

impl Reads {
    /// Reads the next batch of each of `cursors`' partitions as
    /// [`fetch_batches_in`](super::fetch_batches_in) does, unless the last read, from the same
    /// cursors, found nothing and [`QuietSince::ask`] says no row it could read has come
    /// since: then every batch is empty and its cursor stays.
    #[allow(clippy::too_many_arguments)]
    pub async fn fetch(
        &mut self,
        conn: &mut AsyncPgConnection,
        table: &OutboxTable,
        partitioning: Partitioning,
        cursors: &[(u32, Cursor)],
        exclude: &[i64],
        limit: i64,
        max_bytes: i64,
    ) -> QueryResult<Vec<(u32, Batch)>> {
        if let Some(mut quiet) = self.quiet.take()
            && quiet.reads(table, partitioning, cursors, exclude)
            && quiet.since.ask(conn, table, exclude).await?.is_none()
        {
            self.quiet = Some(quiet);
            return Ok(cursors
                .iter()
                .map(|(p, c)| (*p, Batch::empty(c.clone())))
                .collect());
        }
        let Read {
            batches,
            snapshot,
            found,
        } = read_batches_in(
            conn,
            table,
            partitioning,
            cursors,
            exclude,
            limit,
            max_bytes,
        )
        .await?;
        let unmoved = batches
            .iter()
            .zip(cursors)
            .all(|((_, b), (_, c))| b.next == *c);
        if !found && unmoved {
            self.quiet = snapshot.map(|snapshot| Quiet {
                table: table.clone(),
                partitioning,
                cursors: cursors.to_vec(),
                exclude: exclude.to_vec(),
                since: QuietSince::new(snapshot),
            });
        }
        Ok(batches)
    }

    /// Forgets the last read: the next one runs the batch statement (a writer's notification
    /// says a transaction ended, and asking first would only add a round trip).
    pub fn forget(&mut self) {
        self.quiet = None;
    }
}

/// `SELECT pg_current_snapshot()::text`, prepared once per session (a statement type of its
/// own: Diesel never caches a statement of `sql_query`).
struct CurrentSnapshot;

impl QueryId for CurrentSnapshot {
    type QueryId = CurrentSnapshot;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for CurrentSnapshot {
    type SqlType = diesel::sql_types::Untyped;
}

impl QueryFragment<Pg> for CurrentSnapshot {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("SELECT pg_current_snapshot()::text AS snap");
        Ok(())
    }
}

impl<Conn> diesel::RunQueryDsl<Conn> for CurrentSnapshot {}

#[derive(QueryableByName)]
struct Snapshot {
    #[diesel(sql_type = Text)]
    snap: String,
}

/// The session's current snapshot, as PostgreSQL writes a `pg_snapshot` (`xmin:xmax:xip,…`):
/// the transactions that had ended when the statement began. It moves when a transaction that
/// wrote (and so took a transaction id) ends, anywhere in the cluster.
pub async fn current_snapshot(conn: &mut AsyncPgConnection) -> QueryResult<String> {
    let s: Snapshot = CurrentSnapshot.get_result(conn).await?;
    Ok(s.snap)
}

/// What [`written_since`] answers.
#[derive(Debug, Clone, PartialEq, Eq, QueryableByName)]
pub struct Since {
    /// The session's current snapshot (as [`current_snapshot`] writes it).
    #[diesel(sql_type = Text, column_name = snap)]
    pub snapshot: String,
    /// Whether `table` may hold rows that a read at the earlier snapshot did not see: a row
    /// of a transaction that snapshot saw in progress or not begun, or a released row other
    /// than those left out. `false` when the snapshot did not move.
    #[diesel(sql_type = Bool)]
    pub written: bool,
}

/// Asks whether `table` holds rows that a read at `snapshot` (a `pg_snapshot` as text) did not
/// see, with the session's current snapshot: one statement, prepared once per session, of two
/// probes of the `txid` index and one of the released rows' (none when the snapshot has not
/// moved). A row inserted with an earlier transaction's id, or made readable by an `UPDATE`
/// other than `retry`'s, is not seen: [`QuietSince`] reads again at least every
/// [`QUIET_READ_EVERY`] while the snapshot moved.
///
/// ```no_run
/// use outbox_diesel::OutboxTable;
/// use outbox_diesel::relay::{current_snapshot, written_since};
///
/// # async fn run(conn: &mut diesel_async::AsyncPgConnection) -> diesel::QueryResult<()> {
/// let table = OutboxTable::DEFAULT;
/// let before = current_snapshot(conn).await?;
/// // ... a read at `before` found nothing
/// let since = written_since(conn, &table, &before, &[]).await?;
/// if since.written {
///     // read again
/// }
/// # Ok(()) }
/// ```
pub async fn written_since(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    snapshot: &str,
    exclude: &[i64],
) -> QueryResult<Since> {
    let t = table.quoted();
    let exclude = format!(
        "{{{}}}",
        exclude
            .iter()
            .map(i64::to_string)
            .collect::<Vec<_>>()
            .join(",")
    );
    let probes = format!(
        "::int8[] AS x, pg_current_snapshot() AS n) \
         SELECT q.n::text AS snap, CASE WHEN q.n::text = q.s::text THEN false ELSE \
         EXISTS (SELECT 1 FROM {t} o WHERE o.txid >= pg_snapshot_xmax(q.s)) \
         OR EXISTS (SELECT 1 FROM {t} o WHERE o.txid = ANY (ARRAY(SELECT pg_snapshot_xip(q.s)))) \
         OR EXISTS (SELECT 1 FROM {t} o WHERE o.parked_at = 'infinity' \
         AND o.published_at IS NULL AND o.seq <> ALL (q.x)) END AS written FROM q"
    );
    Prepared {
        pieces: &[
            "WITH q AS MATERIALIZED (SELECT ",
            "::pg_snapshot AS s, ",
            &probes,
        ],
        binds: &[snapshot, &exclude],
    }
    .get_result(conn)
    .await
}
