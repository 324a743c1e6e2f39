//! Recording the outcome of a publish: marking or deleting the acked rows, counting failures.

use diesel::QueryResult;
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::sql_types::{Array, BigInt, Bool, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;

/// What a statement does to the rows JetStream acked.
#[derive(Debug, Clone, Copy)]
enum Acked {
    Mark,
    Delete,
}

/// The statement of [`mark_published`] or [`delete_acked`], which Diesel prepares once per
/// session and runs on its cached statement (a statement of `sql_query` is never cached: it
/// was prepared and planned again at every batch).
#[derive(Debug)]
struct OnAcked<'a> {
    table: &'a OutboxTable,
    seqs: &'a [i64],
    what: Acked,
}

impl QueryId for OnAcked<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for OnAcked<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(match self.what {
            Acked::Mark => "UPDATE ",
            Acked::Delete => "DELETE FROM ",
        });
        self.table.walk_ast(&mut out)?;
        if let Acked::Mark = self.what {
            out.push_sql(" SET published_at = now()");
        }
        out.push_sql(" WHERE seq = ANY(");
        out.push_bind_param::<Array<BigInt>, _>(self.seqs)?;
        out.push_sql(")");
        if let Acked::Mark = self.what {
            out.push_sql(" AND published_at IS NULL");
        }
        Ok(())
    }
}

impl<Conn> diesel::RunQueryDsl<Conn> for OnAcked<'_> {}

/// Sets `published_at` on the rows `seqs` (those JetStream acked); returns how many it marked.
/// Traced as the span `outbox.mark`.
#[tracing::instrument(name = "outbox.mark", level = "debug", skip_all, fields(outbox.table = %table, batch.len = seqs.len()))]
pub async fn mark_published(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seqs: &[i64],
) -> QueryResult<usize> {
    if seqs.is_empty() {
        return Ok(0);
    }
    OnAcked {
        table,
        seqs,
        what: Acked::Mark,
    }
    .execute(conn)
    .await
}

/// Deletes the rows `seqs` (those JetStream acked) instead of marking them: for a relay that
/// keeps no published history, about a sixth of the database work of
/// [`mark_published`] and the later cleanup together. Returns how many it deleted. Traced as
/// the span `outbox.mark`.
#[tracing::instrument(name = "outbox.mark", level = "debug", skip_all, fields(outbox.table = %table, batch.len = seqs.len()))]
pub async fn delete_acked(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seqs: &[i64],
) -> QueryResult<usize> {
    if seqs.is_empty() {
        return Ok(0);
    }
    OnAcked {
        table,
        seqs,
        what: Acked::Delete,
    }
    .execute(conn)
    .await
}

/// Counts a failed publish of row `seq` with its error; parks the row (it is then skipped,
/// and holds back the later rows of its aggregate) when `park` is set.
pub async fn record_failure(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    seq: i64,
    error: &str,
    park: bool,
) -> QueryResult<()> {
    diesel::sql_query(format!(
        "UPDATE {} SET attempts = attempts + 1, last_error = $1, \
         parked_at = CASE WHEN $2 THEN now() ELSE parked_at END WHERE seq = $3",
        table.quoted()
    ))
    .bind::<Text, _>(error)
    .bind::<Bool, _>(park)
    .bind::<BigInt, _>(seq)
    .execute(conn)
    .await
    .map(drop)
}
