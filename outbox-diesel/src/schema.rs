//! The outbox table: its Diesel definition, its migration and its DDL for other names.

use diesel::pg::PgConnection;
use diesel::{Connection, RunQueryDsl};
#[cfg(feature = "migrations")]
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

use crate::OutboxTable;

diesel::table! {
    /// The default outbox table (`outbox`), for queries written with Diesel's DSL.
    ///
    /// ```
    /// # use diesel::prelude::*;
    /// use outbox_diesel::schema::outbox;
    /// # fn count(conn: &mut PgConnection) -> QueryResult<i64> {
    /// let backlog: i64 = outbox::table
    ///     .filter(outbox::published_at.is_null())
    ///     .count()
    ///     .get_result(conn)?;
    /// # Ok(backlog) }
    /// ```
    outbox (seq) {
        /// Insertion order: the polling relays publish in this order.
        seq -> BigInt,
        /// The message id (UUIDv7): `Nats-Msg-Id`.
        id -> Uuid,
        /// The subject token after the prefix (`order`).
        aggregate_type -> Text,
        /// The aggregate instance; events of one aggregate keep their commit order.
        aggregate_id -> Text,
        /// The event's name (`order.placed`): header `Outbox-Event-Type`.
        event_type -> Text,
        /// The message body.
        payload -> Jsonb,
        /// Extra NATS headers (a JSON object of strings), e.g. `traceparent`.
        headers -> Jsonb,
        /// When the event was recorded (the transaction's start).
        created_at -> Timestamptz,
        /// When a polling relay had it acked by JetStream; `NULL` = not yet.
        published_at -> Nullable<Timestamptz>,
        /// A stable hash of `aggregate_id` (first 28 bits of its MD5): the partition key.
        aggregate_hash -> Integer,
        /// Failed publish attempts.
        attempts -> Integer,
        /// The last publish error.
        last_error -> Nullable<Text>,
        /// Set when the relay gave up on the row; it then holds back its aggregate.
        parked_at -> Nullable<Timestamptz>,
    }
}

/// The outbox's migrations in Diesel's layout, for `diesel_migrations`.
///
/// They create the table `outbox` and the consumer inbox `processed_messages`; for another
/// outbox name use [`create_table_sql`].
///
/// ```no_run
/// use diesel::prelude::*;
/// use diesel_migrations::MigrationHarness;
///
/// let mut conn = PgConnection::establish("postgres://localhost/app")?;
/// conn.run_pending_migrations(outbox_diesel::MIGRATIONS)?;
/// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
/// ```
#[cfg(feature = "migrations")]
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations");

const UP_SQL: &str = include_str!("../migrations/2026-12-01-000000_create_outbox/up.sql");
const READY_SQL: &str = include_str!("../migrations/2026-12-03-000000_outbox_ready/up.sql");
const SNAPSHOT_SQL: &str = include_str!("../migrations/2026-12-05-000000_snapshot_batches/up.sql");
const LATE_PASS_SQL: &str =
    include_str!("../migrations/2026-12-05-000100_durable_late_pass/up.sql");

/// Applies the outbox's pending migrations (creating the tables `outbox` and
/// `processed_messages`).
///
/// Returns the versions it applied; none when the table is up to date. Processes that run it
/// at once (replicas of a service starting together) take turns under an advisory lock
/// ([`SCHEMA_LOCK_KEY`]): the first applies the migrations, the others find them applied.
#[cfg(feature = "migrations")]
pub fn run_migrations(
    conn: &mut PgConnection,
) -> Result<Vec<String>, Box<dyn std::error::Error + Send + Sync>> {
    diesel::sql_query(format!("SELECT pg_advisory_lock({SCHEMA_LOCK_KEY}, 0)")).execute(conn)?;
    let applied: Result<Vec<String>, _> = conn
        .run_pending_migrations(MIGRATIONS)
        .map(|versions| versions.into_iter().map(|v| v.to_string()).collect());
    let unlocked =
        diesel::sql_query(format!("SELECT pg_advisory_unlock({SCHEMA_LOCK_KEY}, 0)")).execute(conn);
    let applied = applied?;
    unlocked?;
    Ok(applied)
}

/// The DDL of an outbox table named `table`: the same table, indexes and settings as the
/// migration, with `table`'s name.
///
/// ```
/// let sql = outbox_diesel::create_table_sql(&"billing.events".parse()?);
/// assert!(sql.contains(r#"CREATE TABLE "billing"."events" ("#));
/// # Ok::<(), outbox_diesel::InvalidTableName>(())
/// ```
pub fn create_table_sql(table: &OutboxTable) -> String {
    let q = table.quoted();
    let prefix = table.name();
    let snapshot = snapshot_sql(table);
    format!("{UP_SQL}{READY_SQL}")
        .replace("CREATE TABLE outbox (", &format!("CREATE TABLE {q} ("))
        .replace(" ON outbox (", &format!(" ON {q} ("))
        .replace("ALTER TABLE outbox SET", &format!("ALTER TABLE {q} SET"))
        .replace("CONSTRAINT outbox_", &format!("CONSTRAINT {prefix}_"))
        .replace("CREATE INDEX outbox_", &format!("CREATE INDEX {prefix}_"))
        .lines()
        .map(|l| quote_object_names(l, prefix))
        .chain([snapshot, late_pass_sql(table)])
        .collect::<Vec<_>>()
        .join("\n")
}

/// The DDL of snapshot batches (the `txid` column, its index, the released rows' index, the
/// progress table and the audit view) for `table`: the migration
/// `2026-12-05-000000_snapshot_batches` with `table`'s names.
fn snapshot_sql(table: &OutboxTable) -> String {
    let progress_table = |t: &OutboxTable| t.progress_table();
    let audit_view = |t: &OutboxTable| t.audit_view();
    let q = table.quoted();
    let index = |suffix: &str| crate::table::quote_ident(&format!("{}_{suffix}", table.name()));
    SNAPSHOT_SQL
        .replace("outbox_progress_cursor", &index("progress_cursor"))
        .replace("outbox_progress_upto", &index("progress_upto"))
        .replace(
            "CREATE TABLE outbox_progress (",
            &format!("CREATE TABLE {} (", progress_table(table)),
        )
        .replace(
            " ON outbox_progress (",
            &format!(" ON {} (", progress_table(table)),
        )
        .replace(
            "FROM outbox_progress p",
            &format!("FROM {} p", progress_table(table)),
        )
        .replace(
            "CREATE VIEW outbox_audit ",
            &format!("CREATE VIEW {} ", audit_view(table)),
        )
        .replace(
            "CREATE INDEX outbox_txid ON outbox (",
            &format!("CREATE INDEX {} ON {q} (", index("txid")),
        )
        .replace(
            "CREATE INDEX outbox_released ON outbox (",
            &format!("CREATE INDEX {} ON {q} (", index("released")),
        )
        .replace("ALTER TABLE outbox ADD", &format!("ALTER TABLE {q} ADD"))
        .replace("  FROM outbox o;", &format!("  FROM {q} o;"))
        .trim_end()
        .to_owned()
}

/// The DDL that records late passes with their cursor (two columns of the progress table, the
/// audit view that reads them, and the transaction id index that carries `seq`) for `table`: the migration `2026-12-05-000100_durable_late_pass`
/// with `table`'s names.
fn late_pass_sql(table: &OutboxTable) -> String {
    let progress = table.progress_table();
    let check = crate::table::quote_ident(&format!("{}_progress_late_pass", table.name()));
    let txid_index = crate::table::quote_ident(&format!("{}_txid", table.name()));
    // dropped by its qualified name: the index lives in the table's schema
    let qualified_txid_index = in_schema_of(table, &txid_index);
    LATE_PASS_SQL
        .replace(
            "DROP INDEX outbox_txid;",
            &format!("DROP INDEX {qualified_txid_index};"),
        )
        .replace(
            "CREATE INDEX outbox_txid ON outbox (",
            &format!("CREATE INDEX {txid_index} ON {} (", table.quoted()),
        )
        .replace(
            "ALTER TABLE outbox_progress ADD",
            &format!("ALTER TABLE {progress} ADD"),
        )
        .replace(
            "CONSTRAINT outbox_progress_late_pass ",
            &format!("CONSTRAINT {check} "),
        )
        .replace(
            "CREATE OR REPLACE VIEW outbox_audit ",
            &format!("CREATE OR REPLACE VIEW {} ", table.audit_view()),
        )
        .replace("FROM outbox_progress p", &format!("FROM {progress} p"))
        .replace("  FROM outbox o;", &format!("  FROM {} o;", table.quoted()))
        .trim_end()
        .to_owned()
}

/// The upgrade of a table made before snapshot batches: [`snapshot_sql`] then
/// [`late_pass_sql`], with the transaction id index built once, on `(txid, seq)`. Run as the
/// migrations run, the first builds it on `(txid)` and the second drops it and builds it
/// again: on a large table one more build, while writes wait on the upgrade's locks.
fn snapshot_upgrade_sql(table: &OutboxTable) -> String {
    let (snapshot, late_pass) = (snapshot_sql(table), late_pass_sql(table));
    let index = crate::table::quote_ident(&format!("{}_txid", table.name()));
    let first = format!("CREATE INDEX {index} ON {} (txid);", table.quoted());
    let again = format!("DROP INDEX {};", in_schema_of(table, &index));
    let without = |sql: &str, line: &str| {
        sql.lines()
            .filter(|l| l.trim() != line)
            .collect::<Vec<_>>()
            .join("\n")
    };
    format!(
        "{}\n{}",
        without(&snapshot, &first),
        without(&late_pass, &again)
    )
}

/// The `CREATE OR REPLACE VIEW` of `table`'s audit view, as the latest migration makes it.
pub(crate) fn audit_view_sql(table: &OutboxTable) -> String {
    let sql = late_pass_sql(table);
    let start = sql.find("CREATE OR REPLACE VIEW").unwrap_or(sql.len());
    let view = &sql[start..];
    view[..view.find(';').map_or(view.len(), |end| end + 1)].to_owned()
}

/// Whether `table`'s progress table exists.
pub(crate) fn has_progress_table(
    conn: &mut PgConnection,
    table: &OutboxTable,
) -> diesel::QueryResult<bool> {
    has_column(conn, &table.progress_table(), "upto_seq")
}

/// `name` (quoted) in the schema of `table`: how an index of the table is named outside
/// `CREATE INDEX`.
fn in_schema_of(table: &OutboxTable, name: &str) -> String {
    match table.schema() {
        Some(s) => format!("{}.{name}", crate::table::quote_ident(s)),
        None => name.to_owned(),
    }
}

/// Whether the relation `relation` (as SQL quotes it) exists and has the column `column`.
fn has_column(conn: &mut PgConnection, relation: &str, column: &str) -> diesel::QueryResult<bool> {
    diesel::select(
        diesel::dsl::sql::<diesel::sql_types::Bool>(
            "EXISTS (SELECT 1 FROM pg_attribute WHERE NOT attisdropped AND attname = ",
        )
        .bind::<diesel::sql_types::Text, _>(column)
        .sql(" AND attrelid = to_regclass(")
        .bind::<diesel::sql_types::Text, _>(relation)
        .sql("))"),
    )
    .get_result(conn)
}

fn quote_object_names(line: &str, prefix: &str) -> String {
    for kw in ["CONSTRAINT ", "CREATE INDEX "] {
        if let Some(start) = line.find(kw) {
            let rest = &line[start + kw.len()..];
            if let Some(tail) = rest.strip_prefix(prefix) {
                let end = tail.find(' ').unwrap_or(tail.len());
                let ident = format!("{prefix}{}", &tail[..end]);
                return format!(
                    "{}{}{}{}",
                    &line[..start],
                    kw,
                    crate::table::quote_ident(&ident),
                    &tail[end..]
                );
            }
        }
    }
    line.to_owned()
}

/// Creates the outbox table `table` (and its indexes) when it does not exist yet, in one
/// transaction; adds the poll's index `{name}_ready` to a table made by an earlier version.
/// For the default name prefer [`MIGRATIONS`], which Diesel tracks. Processes that call it at
/// once take turns under an advisory lock ([`SCHEMA_LOCK_KEY`]).
pub fn create_table(conn: &mut PgConnection, table: &OutboxTable) -> diesel::QueryResult<()> {
    // replicas of a service starting together: one makes the table, the others then find it
    conn.transaction(|conn| {
        diesel::sql_query(format!(
            "SELECT pg_advisory_xact_lock({SCHEMA_LOCK_KEY}, 0)"
        ))
        .execute(conn)?;
        create_table_locked(conn, table)
    })
}

/// The first key of the advisory lock under which [`run_migrations`] and [`create_table`]
/// change the schema (the second is 0), so that processes starting together take turns:
/// `'OBSC'` in ASCII.
pub const SCHEMA_LOCK_KEY: i32 = 0x4F42_5343;

fn create_table_locked(conn: &mut PgConnection, table: &OutboxTable) -> diesel::QueryResult<()> {
    let exists: bool = diesel::select(
        diesel::dsl::sql::<diesel::sql_types::Bool>("to_regclass(")
            .bind::<diesel::sql_types::Text, _>(table.quoted())
            .sql(") IS NOT NULL"),
    )
    .get_result(conn)?;
    if exists {
        // a table made before the poll's index existed gets it
        let index = crate::table::quote_ident(&format!("{}_ready", table.name()));
        let qualified = in_schema_of(table, &index);
        let has_index: bool = diesel::select(
            diesel::dsl::sql::<diesel::sql_types::Bool>("to_regclass(")
                .bind::<diesel::sql_types::Text, _>(qualified)
                .sql(") IS NOT NULL"),
        )
        .get_result(conn)?;
        if !has_index {
            let ready = READY_SQL
                .lines()
                .find(|l| l.starts_with("CREATE INDEX"))
                .unwrap_or_default()
                .replacen(
                    "CREATE INDEX outbox_ready ON outbox (",
                    &format!("CREATE INDEX IF NOT EXISTS {index} ON {} (", table.quoted()),
                    1,
                );
            diesel::connection::SimpleConnection::batch_execute(conn, &ready)?;
        }
        // a table made before snapshot batches gets them
        let has_txid = has_column(conn, &table.quoted(), "txid")?;
        // and one made before late passes were recorded gets their columns
        let has_late_pass =
            has_txid && has_column(conn, &table.progress_table(), "late_after_seq")?;
        let upgrade = match (has_txid, has_late_pass) {
            (true, true) => return Ok(()),
            (true, false) => late_pass_sql(table),
            (false, _) => snapshot_upgrade_sql(table),
        };
        return conn.transaction(|conn| {
            diesel::connection::SimpleConnection::batch_execute(
                conn,
                &format!("SET LOCAL standard_conforming_strings = on;\n{upgrade}"),
            )
        });
    }
    conn.transaction(|conn| {
        // the DDL's string literals (the CHECKs' patterns) are written for standard strings
        diesel::connection::SimpleConnection::batch_execute(
            conn,
            &format!(
                "SET LOCAL standard_conforming_strings = on;\n{}",
                create_table_sql(table)
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_ddl_is_the_migration() {
        assert_eq!(
            create_table_sql(&OutboxTable::DEFAULT).replace('"', ""),
            format!(
                "{UP_SQL}{READY_SQL}{}\n{}",
                SNAPSHOT_SQL.trim_end(),
                LATE_PASS_SQL.trim_end()
            )
        );
    }

    #[test]
    fn the_upgrade_to_snapshot_batches_builds_the_txid_index_once() {
        for table in [OutboxTable::DEFAULT, "s.ev".parse().expect("valid")] {
            let sql = snapshot_upgrade_sql(&table);
            let name = table.name();
            assert_eq!(
                sql.matches(&format!("\"{name}_txid\" ON")).count(),
                1,
                "{sql}"
            );
            assert!(
                sql.contains(&format!(
                    "\"{name}_txid\" ON {} (txid, seq);",
                    table.quoted()
                )),
                "{sql}"
            );
            assert!(!sql.contains("DROP INDEX"), "{sql}");
            // the rest of both steps, as they are
            let both = format!("{}\n{}", snapshot_sql(&table), late_pass_sql(&table));
            assert_eq!(sql.lines().count(), both.lines().count() - 2, "{sql}");
        }
    }

    #[test]
    fn late_pass_ddl_renames_every_object() {
        let sql = late_pass_sql(&"s.ev".parse().expect("valid"));
        assert!(!sql.contains("outbox"), "{sql}");
        assert!(
            sql.contains(r#"ALTER TABLE "s"."ev_progress" ADD COLUMN late_after_seq"#),
            "{sql}"
        );
        assert!(sql.contains(r#"VIEW "s"."ev_audit" AS"#), "{sql}");
        assert!(
            sql.contains(r#"CONSTRAINT "ev_progress_late_pass" CHECK"#),
            "{sql}"
        );
        assert!(sql.contains(r#"DROP INDEX "s"."ev_txid";"#), "{sql}");
        assert!(
            sql.contains(r#"CREATE INDEX "ev_txid" ON "s"."ev" (txid, seq)"#),
            "{sql}"
        );
    }

    #[test]
    fn ddl_renames_every_object() {
        let sql = create_table_sql(&"s.ev".parse().expect("valid"));
        assert!(!sql.contains(" outbox ("), "{sql}");
        assert!(!sql.contains("TABLE outbox"), "{sql}");
        assert!(
            sql.contains(r#"CREATE INDEX "ev_unpublished" ON "s"."ev" (seq)"#),
            "{sql}"
        );
        assert!(
            sql.contains(r#"CREATE INDEX "ev_ready" ON "s"."ev" (seq)"#),
            "{sql}"
        );
        assert!(
            sql.contains(r#"CONSTRAINT "ev_aggregate_id_is_a_header_value""#),
            "{sql}"
        );
    }
}
