//! The consumer's side: an inbox of processed message ids, checked and filled inside the
//! consumer's own transaction, so that a message delivered twice changes its state once.
//!
//! The relay delivers each event *at least* once: a relay that dies between publishing and
//! marking publishes the row again, and JetStream redelivers a message whose consumer died
//! before acking it. A consumer makes that *exactly once in effect* by recording the message
//! id in the same transaction as the change the message causes:
//!
//! ```
//! use diesel::prelude::*;
//! use outbox_diesel::InboxExt;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! # let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into());
//! # let mut conn = PgConnection::establish(&url)?;
//! # let conn = &mut conn;
//! # conn.begin_test_transaction()?;
//! # outbox_diesel::Inbox::global().create_table(conn)?;
//! let message_id = "0190b5c8-7a8e-7d1e-9f5e-6c2d1a3b4c5d"; // the `Nats-Msg-Id` header
//! let applied = conn.transaction(|conn| {
//!     if !conn.mark_processed("billing", message_id)? {
//!         return Ok(false); // seen before: its change is already committed
//!     }
//!     // diesel::update(accounts::table)...execute(conn)?;
//!     Ok::<_, diesel::result::Error>(true)
//! })?;
//! assert!(applied);
//!
//! // the same message again: nothing to do
//! let again = conn.transaction(|conn| conn.mark_processed("billing", message_id))?;
//! assert!(!again);
//! # Ok(()) }
//! ```
//!
//! `outbox-nats`'s consumer helper does this for every message it hands to a handler.
//!
//! An entry only has to outlive the last moment its message can arrive again: the stream's
//! `max_age` if a consumer may be reset to replay it, otherwise the relay's worst republishing
//! delay plus JetStream's redelivery horizon. [`Inbox::cleanup`] deletes older entries in
//! bounded batches.

use std::sync::OnceLock;
use std::time::Duration;

use diesel::connection::TransactionManager;
use diesel::pg::{Pg, PgConnection};
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::result::Error as DieselError;
use diesel::sql_types::{BigInt, Double, Text};
use diesel::{Connection, QueryResult, RunQueryDsl};

use crate::OutboxTable;
use crate::record::ensure_in_transaction;
use crate::table::{quote_ident, quote_literal};

diesel::table! {
    /// The default inbox table (`processed_messages`), for queries written with Diesel's DSL.
    ///
    /// ```
    /// # use diesel::prelude::*;
    /// use outbox_diesel::inbox::processed_messages;
    /// # fn count(conn: &mut PgConnection) -> QueryResult<i64> {
    /// let seen: i64 = processed_messages::table
    ///     .filter(processed_messages::consumer.eq("billing"))
    ///     .count()
    ///     .get_result(conn)?;
    /// # Ok(seen) }
    /// ```
    processed_messages (consumer, message_id) {
        /// The consumer's name (for the NATS helper, its durable name).
        consumer -> Text,
        /// The message id (`Nats-Msg-Id`: the outbox row's UUID, as text).
        message_id -> Text,
        /// When the consumer's transaction recorded it.
        processed_at -> Timestamptz,
    }
}

const UP_SQL: &str =
    include_str!("../migrations/2026-12-01-000100_create_processed_messages/up.sql");

/// Which table the processed message ids live in.
///
/// [`InboxExt::mark_processed`] uses [`Inbox::global`] (table `processed_messages`, made by
/// [`MIGRATIONS`](crate::MIGRATIONS)); build your own for another table.
///
/// ```
/// use outbox_diesel::Inbox;
///
/// let inbox = Inbox::new("billing.inbox".parse()?);
/// assert_eq!(inbox.table().to_string(), "billing.inbox");
/// assert_eq!(Inbox::global().table().name(), "processed_messages");
/// # Ok::<(), outbox_diesel::InvalidTableName>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inbox {
    table: OutboxTable,
}

impl Default for Inbox {
    fn default() -> Self {
        Inbox::global().clone()
    }
}

impl Inbox {
    /// The name of the default inbox table.
    pub const DEFAULT_TABLE: &'static str = "processed_messages";

    /// An inbox in `table`.
    pub fn new(table: OutboxTable) -> Self {
        Inbox { table }
    }

    /// The inbox that [`InboxExt`] uses: table `processed_messages` on the `search_path`.
    pub fn global() -> &'static Inbox {
        static GLOBAL: OnceLock<Inbox> = OnceLock::new();
        GLOBAL.get_or_init(|| Inbox {
            table: OutboxTable::new(Inbox::DEFAULT_TABLE).expect("a valid table name"),
        })
    }

    /// The inbox's table.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// Records that `consumer` processed `message_id`, inside the transaction open on `conn`.
    ///
    /// Returns `true` when this is the first time (go on and apply the message) and `false`
    /// when the pair is already recorded (skip it: its change is already committed). The check
    /// and the record are one statement (`INSERT … ON CONFLICT DO NOTHING`), so two deliveries
    /// of one message that race each other cannot both see `true`: the second waits for the
    /// first transaction and sees `false` if it commits, `true` if it rolls back.
    ///
    /// Refuses with [`DieselError::NotInTransaction`] outside a transaction (the record would
    /// commit on its own, apart from the change it guards), and with
    /// [`DieselError::QueryBuilderError`] when `consumer` or `message_id` is empty.
    pub fn mark_processed<C>(
        &self,
        conn: &mut C,
        consumer: &str,
        message_id: &str,
    ) -> QueryResult<bool>
    where
        C: Connection<Backend = Pg>,
    {
        let insert = self.insert(consumer, message_id)?;
        ensure_in_transaction(C::TransactionManager::transaction_manager_status_mut(conn))?;
        Ok(insert.execute(conn)? == 1)
    }

    /// Deletes up to `limit` entries (oldest first) recorded more than `retention` ago;
    /// returns how many it deleted. One statement: run it outside a long transaction.
    pub fn delete_older_than(
        &self,
        conn: &mut PgConnection,
        retention: Duration,
        limit: i64,
    ) -> QueryResult<usize> {
        self.delete(retention, limit).execute(conn)
    }

    /// Deletes every entry recorded more than `retention` ago, `batch` entries per statement
    /// so that no statement holds many locks or runs long; returns how many it deleted.
    ///
    /// Keep `retention` longer than a message can take to come back (see the
    /// [module documentation](self)): an entry deleted too early lets a late duplicate through.
    ///
    /// ```
    /// # use diesel::prelude::*;
    /// use std::time::Duration;
    /// use outbox_diesel::Inbox;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// # let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into());
    /// # let mut conn = PgConnection::establish(&url)?;
    /// # let conn = &mut conn;
    /// # conn.begin_test_transaction()?;
    /// # Inbox::global().create_table(conn)?;
    /// let week = Duration::from_secs(7 * 24 * 3600);
    /// let deleted = Inbox::global().cleanup(conn, week, 1000)?;
    /// # let _ = deleted;
    /// # Ok(()) }
    /// ```
    pub fn cleanup(
        &self,
        conn: &mut PgConnection,
        retention: Duration,
        batch: i64,
    ) -> QueryResult<usize> {
        let batch = batch.max(1);
        let mut total = 0;
        loop {
            let n = self.delete_older_than(conn, retention, batch)?;
            total += n;
            if (n as i64) < batch {
                tracing::debug!(inbox.table = %self.table, deleted = total, "inbox cleanup");
                return Ok(total);
            }
        }
    }

    /// The DDL of this inbox's table: the migration's, with this table's name.
    ///
    /// ```
    /// use outbox_diesel::Inbox;
    ///
    /// let sql = Inbox::new("billing.inbox".parse()?).create_table_sql();
    /// assert!(sql.contains(r#"CREATE TABLE "billing"."inbox" ("#));
    /// assert!(sql.contains(r#"CREATE INDEX "inbox_processed_at" ON "billing"."inbox" (processed_at)"#));
    /// # Ok::<(), outbox_diesel::InvalidTableName>(())
    /// ```
    pub fn create_table_sql(&self) -> String {
        let q = self.table.quoted();
        let index = quote_ident(&format!("{}_processed_at", self.table.name()));
        UP_SQL
            .replace(
                "CREATE TABLE processed_messages (",
                &format!("CREATE TABLE {q} ("),
            )
            .replace(
                "CREATE INDEX processed_messages_processed_at ON processed_messages (",
                &format!("CREATE INDEX {index} ON {q} ("),
            )
            .trim_end()
            .to_owned()
    }

    /// Creates this inbox's table (and index) when it does not exist yet, in one transaction.
    /// For the default name prefer [`MIGRATIONS`](crate::MIGRATIONS), which Diesel tracks.
    pub fn create_table(&self, conn: &mut PgConnection) -> QueryResult<()> {
        let exists: bool = diesel::select(diesel::dsl::sql::<diesel::sql_types::Bool>(&format!(
            "to_regclass({}) IS NOT NULL",
            quote_literal(&self.table.quoted())
        )))
        .get_result(conn)?;
        if exists {
            return Ok(());
        }
        conn.transaction(|conn| {
            diesel::connection::SimpleConnection::batch_execute(conn, &self.create_table_sql())
        })
    }

    fn insert<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> QueryResult<MarkProcessed<'a>> {
        if consumer.is_empty() || message_id.is_empty() {
            return Err(DieselError::QueryBuilderError(
                "the inbox needs a consumer name and a message id, and one of them is empty".into(),
            ));
        }
        Ok(MarkProcessed {
            table: &self.table,
            consumer,
            message_id,
        })
    }

    fn delete(&self, retention: Duration, limit: i64) -> DeleteOlderThan<'_> {
        DeleteOlderThan {
            table: &self.table,
            seconds: retention.as_secs_f64(),
            limit: limit.max(0),
        }
    }
}

/// `INSERT INTO t (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING`.
#[derive(Debug)]
struct MarkProcessed<'a> {
    table: &'a OutboxTable,
    consumer: &'a str,
    message_id: &'a str,
}

impl QueryId for MarkProcessed<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for MarkProcessed<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO ");
        self.table.walk_ast(&mut out)?;
        out.push_sql(" (consumer, message_id) VALUES (");
        out.push_bind_param::<Text, _>(self.consumer)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(self.message_id)?;
        out.push_sql(") ON CONFLICT DO NOTHING");
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for MarkProcessed<'_> {}

/// Deletes a bounded batch of old entries, oldest first, skipping rows another cleaner holds.
#[derive(Debug)]
struct DeleteOlderThan<'a> {
    table: &'a OutboxTable,
    seconds: f64,
    limit: i64,
}

impl QueryId for DeleteOlderThan<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for DeleteOlderThan<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("DELETE FROM ");
        self.table.walk_ast(&mut out)?;
        out.push_sql(" WHERE (consumer, message_id) IN (SELECT consumer, message_id FROM ");
        self.table.walk_ast(&mut out)?;
        out.push_sql(" WHERE processed_at < now() - make_interval(secs => ");
        out.push_bind_param::<Double, _>(&self.seconds)?;
        out.push_sql(") ORDER BY processed_at LIMIT ");
        out.push_bind_param::<BigInt, _>(&self.limit)?;
        out.push_sql(" FOR UPDATE SKIP LOCKED)");
        Ok(())
    }
}

impl<Conn> RunQueryDsl<Conn> for DeleteOlderThan<'_> {}

/// The inbox on a synchronous Diesel connection: `PgConnection` and pooled (`r2d2`) ones.
///
/// Call it first in the consumer's `conn.transaction`; apply the message only when it returns
/// `true`. See the [module documentation](self) for an example.
pub trait InboxExt {
    /// Records `message_id` for `consumer` in the default inbox ([`Inbox::global`]); `true`
    /// when it is new. See [`Inbox::mark_processed`].
    fn mark_processed(&mut self, consumer: &str, message_id: &str) -> QueryResult<bool>;

    /// Records `message_id` for `consumer` in `inbox`; `true` when it is new.
    fn mark_processed_with(
        &mut self,
        inbox: &Inbox,
        consumer: &str,
        message_id: &str,
    ) -> QueryResult<bool>;
}

impl<C> InboxExt for C
where
    C: Connection<Backend = Pg>,
{
    fn mark_processed(&mut self, consumer: &str, message_id: &str) -> QueryResult<bool> {
        Inbox::global().mark_processed(self, consumer, message_id)
    }

    fn mark_processed_with(
        &mut self,
        inbox: &Inbox,
        consumer: &str,
        message_id: &str,
    ) -> QueryResult<bool> {
        inbox.mark_processed(self, consumer, message_id)
    }
}

#[cfg(feature = "async")]
mod async_impl {
    use std::future::Future;
    use std::time::Duration;

    use diesel::QueryResult;
    use diesel::pg::Pg;
    use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};

    use super::Inbox;
    use crate::record::ensure_in_transaction;

    impl Inbox {
        /// [`Inbox::mark_processed`] on an async connection.
        pub fn mark_processed_async<'c, C>(
            &'c self,
            conn: &'c mut C,
            consumer: &'c str,
            message_id: &'c str,
        ) -> impl Future<Output = QueryResult<bool>> + Send + 'c
        where
            C: AsyncConnection<Backend = Pg>,
        {
            let insert = self.insert(consumer, message_id);
            async move {
                let insert = insert?;
                ensure_in_transaction(
                    <C::TransactionManager as diesel_async::TransactionManager<C>>::transaction_manager_status_mut(conn),
                )?;
                Ok(insert.execute(conn).await? == 1)
            }
        }

        /// [`Inbox::delete_older_than`] on an async connection.
        pub async fn delete_older_than_async(
            &self,
            conn: &mut AsyncPgConnection,
            retention: Duration,
            limit: i64,
        ) -> QueryResult<usize> {
            self.delete(retention, limit).execute(conn).await
        }

        /// [`Inbox::cleanup`] on an async connection.
        pub async fn cleanup_async(
            &self,
            conn: &mut AsyncPgConnection,
            retention: Duration,
            batch: i64,
        ) -> QueryResult<usize> {
            let batch = batch.max(1);
            let mut total = 0;
            loop {
                let n = self.delete_older_than_async(conn, retention, batch).await?;
                total += n;
                if (n as i64) < batch {
                    tracing::debug!(inbox.table = %self.table, deleted = total, "inbox cleanup");
                    return Ok(total);
                }
            }
        }
    }

    /// The inbox on an async Diesel connection: `diesel_async::AsyncPgConnection` and pooled
    /// (deadpool, bb8) ones. Feature `async`.
    ///
    /// ```no_run
    /// use diesel_async::{AsyncConnection, AsyncPgConnection};
    /// use outbox_diesel::AsyncInboxExt;
    ///
    /// # async fn run(message_id: &str) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let mut conn = AsyncPgConnection::establish("postgres://localhost/app").await?;
    /// conn.transaction(async |conn| {
    ///     if conn.mark_processed("billing", message_id).await? {
    ///         // diesel::update(accounts::table)...execute(conn).await?;
    ///     }
    ///     Ok::<_, diesel::result::Error>(())
    /// })
    /// .await?;
    /// # Ok(()) }
    /// ```
    pub trait AsyncInboxExt {
        /// Records `message_id` for `consumer` in the default inbox; `true` when it is new.
        /// See [`Inbox::mark_processed`].
        fn mark_processed<'c>(
            &'c mut self,
            consumer: &'c str,
            message_id: &'c str,
        ) -> impl Future<Output = QueryResult<bool>> + Send + 'c;

        /// Records `message_id` for `consumer` in `inbox`; `true` when it is new.
        fn mark_processed_with<'c>(
            &'c mut self,
            inbox: &'c Inbox,
            consumer: &'c str,
            message_id: &'c str,
        ) -> impl Future<Output = QueryResult<bool>> + Send + 'c;
    }

    impl<C> AsyncInboxExt for C
    where
        C: AsyncConnection<Backend = Pg>,
    {
        fn mark_processed<'c>(
            &'c mut self,
            consumer: &'c str,
            message_id: &'c str,
        ) -> impl Future<Output = QueryResult<bool>> + Send + 'c {
            Inbox::global().mark_processed_async(self, consumer, message_id)
        }

        fn mark_processed_with<'c>(
            &'c mut self,
            inbox: &'c Inbox,
            consumer: &'c str,
            message_id: &'c str,
        ) -> impl Future<Output = QueryResult<bool>> + Send + 'c {
            inbox.mark_processed_async(self, consumer, message_id)
        }
    }
}

#[cfg(feature = "async")]
pub use async_impl::AsyncInboxExt;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_ddl_is_the_migration() {
        assert_eq!(
            Inbox::global().create_table_sql().replace('"', ""),
            UP_SQL.trim_end()
        );
    }

    #[test]
    fn ddl_renames_every_object() {
        let sql = Inbox::new("s.seen".parse().expect("valid")).create_table_sql();
        assert!(!sql.contains("TABLE processed_messages"), "{sql}");
        assert!(!sql.contains("INDEX processed_messages"), "{sql}");
        assert!(
            sql.contains(r#"CREATE INDEX "seen_processed_at" ON "s"."seen" (processed_at)"#),
            "{sql}"
        );
    }

    #[test]
    fn refuses_empty_names() {
        let inbox = Inbox::global();
        assert!(matches!(
            inbox.insert("", "id"),
            Err(DieselError::QueryBuilderError(_))
        ));
        assert!(matches!(
            inbox.insert("c", ""),
            Err(DieselError::QueryBuilderError(_))
        ));
        assert!(inbox.insert("c", "id").is_ok());
    }
}
