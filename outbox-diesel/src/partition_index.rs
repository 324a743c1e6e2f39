//! The partition index: what lets an ordered relay that owns some of the partitions read only
//! their rows.
//!
//! The `ready` index (`seq`, over the rows neither published nor parked) serves a relay that
//! reads every partition: one walk by `seq`. A relay that owns some of `N` partitions walks it
//! too and passes over the other relays' rows, each one a heap fetch: with two relays every
//! row is read twice, with four four times. The partition index, `<name>_ready_p<N>` on
//! `(aggregate_hash % N, seq)` over the same rows, gives each partition's rows in `seq` order:
//! a relay reads each partition it owns from its own cursor, their rows merged in `seq` order
//! (a busy partition among quiet ones fills the batch), and no row of another's. It serves one
//! partition count; the relays use it when its count is theirs (`outbox-relay run` checks at
//! start and whenever it balances its partitions) and they own at most 64 partitions, and walk
//! `ready` otherwise.
//!
//! [`create_partition_index`] makes it (`outbox-relay index --partitions N`). Each index costs
//! every insert an index entry: make it for the partition count the relays run with, when
//! more than one relay reads the table, and drop the one of a count no longer used.

use diesel::pg::PgConnection;
use diesel::sql_types::Bool;
use diesel::{QueryResult, QueryableByName, RunQueryDsl};

use crate::OutboxTable;
use crate::table::{quote_ident, quote_literal};

/// The largest partition count: each partition is a session advisory lock in PostgreSQL's
/// shared lock table (`max_locks_per_transaction` × `max_connections` entries, 6,400 by
/// default), which the relays of every table share with the database's other locks. The
/// relay's [`MAX_PARTITIONS`](crate::relay::MAX_PARTITIONS) (feature `relay`) is this one.
pub(crate) const MAX_PARTITIONS: u32 = 1024;

/// The partition index's name for `partitions` partitions, schema-qualified as `table` is and
/// quoted: `"outbox_ready_p4"` for the default table and 4 partitions.
///
/// ```
/// use outbox_diesel::{OutboxTable, partition_index_name};
///
/// assert_eq!(partition_index_name(&OutboxTable::DEFAULT, 4), r#""outbox_ready_p4""#);
/// ```
pub fn partition_index_name(table: &OutboxTable, partitions: u32) -> String {
    let name = quote_ident(&format!("{}_ready_p{partitions}", table.name()));
    match table.schema() {
        Some(s) => format!("{}.{name}", quote_ident(s)),
        None => name,
    }
}

/// The statement that creates the partition index of `table` for `partitions` partitions,
/// `CONCURRENTLY` (writers go on meanwhile; it cannot run in a transaction) or not (writers
/// wait for it; a partitioned table, which cannot build one concurrently, takes this one).
///
/// ```
/// use outbox_diesel::{OutboxTable, partition_index_sql};
///
/// assert_eq!(
///     partition_index_sql(&OutboxTable::DEFAULT, 4, true),
///     r#"CREATE INDEX CONCURRENTLY IF NOT EXISTS "outbox_ready_p4" ON "outbox" ((aggregate_hash % 4), seq) WHERE published_at IS NULL AND parked_at IS NULL"#
/// );
/// ```
pub fn partition_index_sql(table: &OutboxTable, partitions: u32, concurrently: bool) -> String {
    let name = quote_ident(&format!("{}_ready_p{partitions}", table.name()));
    format!(
        "CREATE INDEX {}IF NOT EXISTS {name} ON {} ((aggregate_hash % {partitions}), seq) \
         WHERE published_at IS NULL AND parked_at IS NULL",
        if concurrently { "CONCURRENTLY " } else { "" },
        table.quoted()
    )
}

#[derive(QueryableByName)]
struct Found {
    #[diesel(sql_type = Bool)]
    partitioned: bool,
    #[diesel(sql_type = Bool)]
    exists: bool,
    #[diesel(sql_type = Bool)]
    valid: bool,
}

/// Creates the partition index of `table` for `partitions` partitions (see the
/// [module](self)); returns `false` when a valid one is there already. On a plain table it is
/// built `CONCURRENTLY`, so writers and relays go on; one left invalid by a build that did not
/// finish is dropped and built again. A rotated table ([`partition_table`](crate::partition_table))
/// builds it on every partition at once, with writers waiting until it is done. `partitions`
/// must be 2 to 1,024 (what a relay runs with): with one, the relay reads every row and `ready` serves it.
/// The table must exist.
///
/// ```no_run
/// use diesel::prelude::*;
/// use outbox_diesel::{OutboxTable, create_partition_index};
///
/// let mut conn = PgConnection::establish("postgres://localhost/app")?;
/// // the relays run with --partitions 8
/// create_partition_index(&mut conn, &OutboxTable::DEFAULT, 8)?;
/// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
/// ```
pub fn create_partition_index(
    conn: &mut PgConnection,
    table: &OutboxTable,
    partitions: u32,
) -> QueryResult<bool> {
    if !(2..=MAX_PARTITIONS).contains(&partitions) {
        return Err(diesel::result::Error::QueryBuilderError(
            format!(
                "a partition index is for 2 to {MAX_PARTITIONS} partitions, not {partitions}: \
                 with one partition the relay reads every row, which the table's own index serves"
            )
            .into(),
        ));
    }
    let t = table.quoted();
    let index = partition_index_name(table, partitions);
    let found = |conn: &mut PgConnection| -> QueryResult<Found> {
        diesel::sql_query(format!(
            "SELECT c.relkind = 'p' AS partitioned, i.indexrelid IS NOT NULL AS exists, \
             COALESCE(i.indisvalid AND i.indisready, false) AS valid \
             FROM pg_class c LEFT JOIN pg_index i ON i.indrelid = c.oid \
             AND i.indexrelid = to_regclass({}) \
             WHERE c.oid = to_regclass({})",
            quote_literal(&index),
            quote_literal(&t)
        ))
        .get_result(conn)
        .map_err(|e| match e {
            diesel::result::Error::NotFound => diesel::result::Error::QueryBuilderError(
                format!(
                    "the outbox table {t} does not exist (or is not visible to this role): \
                     create it first (outbox_diesel::create_table or the migrations)"
                )
                .into(),
            ),
            e => e,
        })
    };
    let before = found(conn)?;
    if before.valid {
        return Ok(false);
    }
    if before.exists {
        // a concurrent build that did not finish leaves its index invalid: built again
        let drop = if before.partitioned {
            format!("DROP INDEX {index}")
        } else {
            format!("DROP INDEX CONCURRENTLY {index}")
        };
        diesel::sql_query(drop).execute(conn)?;
    }
    diesel::sql_query(partition_index_sql(table, partitions, !before.partitioned)).execute(conn)?;
    Ok(true)
}
