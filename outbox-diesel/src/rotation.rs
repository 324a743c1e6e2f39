//! Rotation: an outbox table whose kept rows go by `TRUNCATE` of a partition, not a `DELETE`
//! per row.
//!
//! [`partition_table`] turns an outbox table into a ring of `N` list partitions,
//! `<name>_r0` … `<name>_r{N-1}`: rows are cut into blocks of `R` consecutive `seq`s, and
//! block `b` goes to partition `b % N` (the partition key is `(seq / R) % N`). While the
//! relay fills one partition, the ones it filled before age; once every row of a partition
//! is past the retention and published (marked more than a retention ago, or covered by an
//! ordered relay's cursor recorded more than a retention ago) and none is parked, cleanup
//! empties it with one `TRUNCATE`, whatever its row count (PgQ's rotation of event tables).
//! Nothing else changes: the table keeps its name, columns, indexes, grants and its
//! `<name>_audit` view; every relay mode, the recording and the operations read and write it
//! as before.
//!
//! Sizing: a partition is truncated only when no row in it is younger than the retention, so
//! the ring must hold more than a retention of rows: `R × (N − 1)` above the rows written in
//! a retention (plus the relay's lag). Where it does not (a quiet outbox fills a block in
//! days), cleanup deletes row by row in the partition being filled, as for a plain table.
//!
//! Uniqueness holds per partition: `seq` is the primary key of each partition (and unique
//! across the table, since its identity generates it), and so is `id`, which UUIDv7 makes
//! unique anyway; PostgreSQL cannot enforce a unique key on a list partition's expression.

use diesel::pg::PgConnection;
use diesel::sql_types::{Bool, Text};
use diesel::{Connection, QueryResult, QueryableByName, RunQueryDsl};

use crate::OutboxTable;
use crate::table::{quote_ident, quote_literal};

/// How [`partition_table`] spreads an outbox table's rows: `partitions` list partitions in a
/// ring, each taking blocks of `block_rows` consecutive `seq`s in turn.
///
/// ```
/// use outbox_diesel::Rotation;
///
/// // about 20,000 events/s kept 5 minutes: a block of 2,000,000 rows fills in 100 s, and the
/// // other three partitions hold 300 s of rows while the fourth fills
/// let rotation = Rotation::default().block_rows(2_000_000);
/// assert_eq!(rotation.partitions, 4);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rotation {
    /// How many partitions the ring has (default 4, at least 2). Each one more costs every
    /// statement that reads the table one more index probe.
    pub partitions: u16,
    /// How many consecutive `seq`s a block holds (default 1,000,000, at least 1,000).
    pub block_rows: i64,
}

impl Default for Rotation {
    fn default() -> Self {
        Rotation {
            partitions: 4,
            block_rows: 1_000_000,
        }
    }
}

impl Rotation {
    /// Sets [`Rotation::partitions`].
    pub fn partitions(mut self, n: u16) -> Self {
        self.partitions = n;
        self
    }

    /// Sets [`Rotation::block_rows`].
    pub fn block_rows(mut self, n: i64) -> Self {
        self.block_rows = n;
        self
    }

    fn validate(&self) -> QueryResult<()> {
        if self.partitions < 2 || self.block_rows < 1000 {
            return Err(diesel::result::Error::QueryBuilderError(
                format!(
                    "a rotation needs at least 2 partitions and blocks of at least 1,000 rows \
                     (got {} partitions of {}-row blocks)",
                    self.partitions, self.block_rows
                )
                .into(),
            ));
        }
        Ok(())
    }
}

#[derive(QueryableByName)]
struct Line {
    #[diesel(sql_type = Text)]
    line: String,
}

#[derive(QueryableByName)]
struct Flag {
    #[diesel(sql_type = Bool)]
    flag: bool,
}

/// Turns the outbox table `table` into a ring of partitions (see the [module](self)); returns
/// `false` when it is partitioned already, and creates it first when it does not exist.
///
/// The rows it holds are copied, published or not, with their `seq`, `id` and transaction
/// id, so relays go on where they stood; the identity goes on after the last `seq`. Indexes
/// (the ones you added too), grants, storage settings, the `<name>_audit` view and the
/// publications that list the table are made again on the new one (publications then publish
/// through the parent, `publish_via_partition_root`). The table's grants apply to each
/// partition too, and a role that may `DELETE` from the table (the relay's, for cleanup) may
/// `TRUNCATE` the partitions; for a role granted later, grant both on `<name>_r0` …
/// `<name>_r{N-1}` as well. It runs in one transaction under an
/// `ACCESS EXCLUSIVE` lock, so writers and relays wait for the copy: convert while the table
/// holds few rows (right after creating it, or with relays stopped after cleanup). With log
/// tailing, the copy is decoded as new inserts, so the rows present are published again
/// under their ids: JetStream drops those within its duplicate window, consumers' inbox the
/// rest. A view of your own on the table, a trigger or a row security policy makes it fail
/// (the copy would lose them): drop them first and make them again after.
///
/// ```no_run
/// use diesel::prelude::*;
/// use outbox_diesel::{OutboxTable, Rotation, partition_table};
///
/// let mut conn = PgConnection::establish("postgres://localhost/app")?;
/// partition_table(&mut conn, &OutboxTable::DEFAULT, Rotation::default())?;
/// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
/// ```
pub fn partition_table(
    conn: &mut PgConnection,
    table: &OutboxTable,
    rotation: Rotation,
) -> QueryResult<bool> {
    rotation.validate()?;
    crate::create_table(conn, table)?;
    conn.transaction(|conn| {
        diesel::sql_query(format!(
            "SELECT pg_advisory_xact_lock({}, 0)",
            crate::SCHEMA_LOCK_KEY
        ))
        .execute(conn)?;
        let t = table.quoted();
        let rel = quote_literal(&t);
        let partitioned: Flag = diesel::sql_query(format!(
            "SELECT relkind = 'p' AS flag FROM pg_class WHERE oid = {rel}::regclass"
        ))
        .get_result(conn)?;
        if partitioned.flag {
            return Ok(false);
        }
        diesel::sql_query(format!("LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE")).execute(conn)?;
        // what the copy would not carry over: refused rather than lost
        let kept: Flag = diesel::sql_query(format!(
            "SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = {rel}::regclass \
             AND NOT tgisinternal) OR EXISTS (SELECT 1 FROM pg_policy \
             WHERE polrelid = {rel}::regclass) AS flag"
        ))
        .get_result(conn)?;
        if kept.flag {
            return Err(diesel::result::Error::QueryBuilderError(
                format!(
                    "{t} has triggers or row security policies of its own, which the \
                     partitioned copy would not have: drop them, partition the table, and \
                     make them again on it"
                )
                .into(),
            ));
        }
        let lines = |conn: &mut PgConnection, sql: String| -> QueryResult<Vec<String>> {
            Ok(diesel::sql_query(sql)
                .load::<Line>(conn)?
                .into_iter()
                .map(|l| l.line)
                .collect())
        };
        // what the new table gets again: the indexes that are not a constraint's (their
        // definitions name the table, which the new one takes), grants, storage settings
        let indexes = lines(
            conn,
            format!(
                "SELECT pg_get_indexdef(i.indexrelid) AS line FROM pg_index i \
                 WHERE i.indrelid = {rel}::regclass AND NOT EXISTS \
                 (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid) \
                 ORDER BY i.indexrelid"
            ),
        )?;
        // each grant as `PRIVILEGE grantee`
        let grants = lines(
            conn,
            format!(
                "SELECT a.privilege_type || ' ' || \
                 CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS line \
                 FROM pg_class c CROSS JOIN aclexplode(c.relacl) a \
                 LEFT JOIN pg_roles r ON r.oid = a.grantee \
                 WHERE c.oid = {rel}::regclass AND a.grantee <> c.relowner"
            ),
        )?;
        let storage = lines(
            conn,
            format!(
                "SELECT array_to_string(reloptions, ', ') AS line FROM pg_class \
                 WHERE oid = {rel}::regclass AND reloptions IS NOT NULL"
            ),
        )?;
        let publications = lines(
            conn,
            format!(
                "SELECT quote_ident(p.pubname) AS line FROM pg_publication p \
                 JOIN pg_publication_rel r ON r.prpubid = p.oid WHERE r.prrelid = {rel}::regclass"
            ),
        )?;
        let columns = lines(
            conn,
            format!(
                "SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) AS line \
                 FROM pg_attribute WHERE attrelid = {rel}::regclass AND attnum > 0 \
                 AND NOT attisdropped AND attgenerated = ''"
            ),
        )?
        .concat();
        let next = lines(
            conn,
            format!(
                "SELECT (GREATEST((SELECT max(seq) FROM {t}), \
                 pg_sequence_last_value(pg_get_serial_sequence({rel}, 'seq')), 0) + 1)::text AS line"
            ),
        )?
        .concat();
        let staging = table.sibling("rotating");
        let (n, r) = (rotation.partitions, rotation.block_rows);
        let with = match storage.first() {
            Some(s) => format!(" WITH ({s})"),
            None => String::new(),
        };
        let mut ddl = vec![format!(
            "CREATE TABLE {staging} (LIKE {t} INCLUDING DEFAULTS INCLUDING GENERATED \
             INCLUDING IDENTITY INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMMENTS) \
             PARTITION BY LIST (((seq / {r}) % {n}))"
        )];
        ddl.push(format!(
            "ALTER TABLE {staging} ALTER COLUMN seq RESTART WITH {next}"
        ));
        for k in 0..n {
            let part = table.sibling(&format!("r{k}"));
            let name = |suffix: &str| quote_ident(&format!("{}_r{k}_{suffix}", table.name()));
            ddl.push(format!(
                "CREATE TABLE {part} PARTITION OF {staging} (CONSTRAINT {} PRIMARY KEY (seq), \
                 CONSTRAINT {} UNIQUE (id)) FOR VALUES IN ({k}){with}",
                name("pkey"),
                name("id_key")
            ));
        }
        ddl.push(format!(
            "INSERT INTO {staging} ({columns}) OVERRIDING SYSTEM VALUE SELECT {columns} FROM {t}"
        ));
        ddl.push(format!("DROP VIEW IF EXISTS {}", table.audit_view()));
        ddl.push(format!("DROP TABLE {t}"));
        ddl.push(format!(
            "ALTER TABLE {staging} RENAME TO {}",
            quote_ident(table.name())
        ));
        ddl.extend(indexes);
        // the table's grants on the table and on each partition (cleanup deletes from the one
        // being filled), and a role that may delete rows may empty a partition
        let partitions: Vec<String> = (0..n).map(|k| table.sibling(&format!("r{k}"))).collect();
        for grant in &grants {
            let Some((privilege, grantee)) = grant.split_once(' ') else {
                continue;
            };
            for relation in std::iter::once(&t).chain(&partitions) {
                ddl.push(format!("GRANT {privilege} ON TABLE {relation} TO {grantee}"));
            }
            if privilege == "DELETE" {
                for part in &partitions {
                    ddl.push(format!("GRANT TRUNCATE ON TABLE {part} TO {grantee}"));
                }
            }
        }
        if crate::schema::has_progress_table(conn, table)? {
            ddl.push(crate::schema::audit_view_sql(table));
        }
        for p in &publications {
            ddl.push(format!("ALTER PUBLICATION {p} ADD TABLE {t}"));
            ddl.push(format!(
                "ALTER PUBLICATION {p} SET (publish_via_partition_root = true)"
            ));
        }
        for statement in ddl {
            diesel::sql_query(statement).execute(conn)?;
        }
        // the identity's sequence, made for the staging name, takes the table's
        let sequence = format!("{}_seq_seq", table.name());
        if sequence.len() <= 63 {
            let made = lines(
                conn,
                format!("SELECT pg_get_serial_sequence({rel}, 'seq') AS line"),
            )?
            .concat();
            if !made.is_empty() {
                diesel::sql_query(format!(
                    "ALTER SEQUENCE {made} RENAME TO {}",
                    quote_ident(&sequence)
                ))
                .execute(conn)?;
            }
        }
        Ok(true)
    })
}
