//! Reads that skip the batch statement while nothing can have changed: an idle relay's poll.
//!
//! A batch statement reads what its snapshot sees from where the cursors stand. Two snapshots
//! that are equal (`xmin:xmax:xip`) see the same transactions committed; the snapshot moves
//! only when a transaction that wrote ends, since every write (an `INSERT`, a `retry`'s
//! `UPDATE`, a `DELETE`, a `NOTIFY`) takes a transaction id. So once a statement found nothing,
//! the same statement at an equal snapshot, from the same cursors, finds nothing again: the
//! next poll asks for the snapshot alone, a statement PostgreSQL starts and runs at a fraction
//! of the batch statement's cost (whose plan covers every partition the relay reads), and
//! reads the partitions again only once it moved. A transaction in progress at the last read
//! leaves its snapshot's `xip` list when it ends, so its rows (late ones) are read at the next
//! poll as before. The snapshot is the whole cluster's: writes to other tables and databases
//! move it too, and the relay then reads as it did without the question.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::Text;
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;

use super::Cursor;
use super::batch::{Batch, Partitioning, Read, read_batches_in};

/// A relay's reads of its partitions: [`fetch_batches_in`](super::fetch_batches_in), but after
/// a read that found nothing, each read first asks PostgreSQL for its current snapshot, and
/// runs the batch statement only when it differs from that read's (a transaction ended since)
/// or when it reads from other cursors. An idle relay's poll is then one small statement,
/// prepared once per session like the batch statement.
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

/// The last read, which found nothing: what it read from, and at which snapshot.
#[derive(Debug)]
struct Quiet {
    table: OutboxTable,
    partitioning: Partitioning,
    cursors: Vec<(u32, Cursor)>,
    exclude: Vec<i64>,
    snapshot: String,
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
    /// cursors, found nothing and no transaction has ended since: then every batch is empty
    /// and its cursor stays.
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
        if let Some(quiet) = self.quiet.take()
            && quiet.reads(table, partitioning, cursors, exclude)
            && current_snapshot(conn).await? == quiet.snapshot
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
                snapshot,
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
