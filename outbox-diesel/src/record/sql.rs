//! The statements a recording writes: the multi-row `INSERT`, the `DELETE` of
//! `delete_after_insert`, the `NOTIFY` that wakes the relay, and [`Statement`], one of them.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::sql_types::{Array, Text, Uuid as SqlUuid};
use diesel::{QueryResult, RunQueryDsl};
use uuid::Uuid;

use crate::OutboxTable;

/// The insert: one statement with six array parameters, whatever the row count, so that its
/// prepared statement is cached; one event is a plain `VALUES` row (a second cached statement).
#[derive(Debug)]
pub(crate) struct InsertEvents {
    table: OutboxTable,
    pub(crate) ids: Vec<Uuid>,
    pub(super) aggregate_types: Vec<String>,
    pub(super) aggregate_ids: Vec<String>,
    pub(super) event_types: Vec<String>,
    pub(super) payloads: Vec<String>,
    pub(super) headers: Vec<String>,
}

impl InsertEvents {
    pub(super) fn with_capacity(table: OutboxTable, n: usize) -> Self {
        InsertEvents {
            table,
            ids: Vec::with_capacity(n),
            aggregate_types: Vec::with_capacity(n),
            aggregate_ids: Vec::with_capacity(n),
            event_types: Vec::with_capacity(n),
            payloads: Vec::with_capacity(n),
            headers: Vec::with_capacity(n),
        }
    }
}

impl QueryId for InsertEvents {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for InsertEvents {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO ");
        self.table.walk_ast(&mut out)?;
        out.push_sql(" (id, aggregate_type, aggregate_id, event_type, payload, headers) ");
        if let ([id], [t], [a], [e], [p], [h]) = (
            &self.ids[..],
            &self.aggregate_types[..],
            &self.aggregate_ids[..],
            &self.event_types[..],
            &self.payloads[..],
            &self.headers[..],
        ) {
            // one event (the common `record_event`): plain values, no arrays to build and
            // unnest
            out.push_sql("VALUES (");
            out.push_bind_param::<SqlUuid, _>(id)?;
            out.push_sql(", ");
            out.push_bind_param::<Text, _>(t)?;
            out.push_sql(", ");
            out.push_bind_param::<Text, _>(a)?;
            out.push_sql(", ");
            out.push_bind_param::<Text, _>(e)?;
            out.push_sql(", ");
            out.push_bind_param::<Text, _>(p)?;
            out.push_sql("::jsonb, ");
            out.push_bind_param::<Text, _>(h)?;
            out.push_sql("::jsonb)");
            return Ok(());
        }
        out.push_sql("SELECT i, t, a, e, p::jsonb, h::jsonb FROM unnest(");
        out.push_bind_param::<Array<SqlUuid>, _>(&self.ids)?;
        out.push_sql("::uuid[], ");
        out.push_bind_param::<Array<Text>, _>(&self.aggregate_types)?;
        out.push_sql("::text[], ");
        out.push_bind_param::<Array<Text>, _>(&self.aggregate_ids)?;
        out.push_sql("::text[], ");
        out.push_bind_param::<Array<Text>, _>(&self.event_types)?;
        out.push_sql("::text[], ");
        out.push_bind_param::<Array<Text>, _>(&self.payloads)?;
        out.push_sql("::text[], ");
        out.push_bind_param::<Array<Text>, _>(&self.headers)?;
        out.push_sql("::text[]) AS u(i, t, a, e, p, h)");
        Ok(())
    }
}

/// `DELETE FROM table WHERE id = ANY($1)`: the second half of
/// [`Outbox::delete_after_insert`](super::Outbox::delete_after_insert).
#[derive(Debug)]
pub(crate) struct DeleteEvents<'a> {
    pub(super) table: &'a OutboxTable,
    pub(super) ids: Vec<Uuid>,
}

impl QueryId for DeleteEvents<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for DeleteEvents<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("DELETE FROM ");
        self.table.walk_ast(&mut out)?;
        out.push_sql(" WHERE id = ANY(");
        out.push_bind_param::<Array<SqlUuid>, _>(&self.ids)?;
        out.push_sql(")");
        Ok(())
    }
}

/// `SELECT pg_notify($1, '')`.
#[derive(Debug)]
pub(crate) struct NotifyQuery<'a> {
    pub(super) channel: &'a str,
}

impl QueryId for NotifyQuery<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for NotifyQuery<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("SELECT pg_notify(");
        out.push_bind_param::<Text, _>(self.channel)?;
        out.push_sql(", '')");
        Ok(())
    }
}

/// One statement of a recording (see [`Outbox::statements`](super::Outbox::statements)).
#[derive(Debug)]
pub(crate) enum Statement<'a> {
    Insert(InsertEvents),
    Delete(DeleteEvents<'a>),
    Notify(NotifyQuery<'a>),
}

impl QueryId for Statement<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl QueryFragment<Pg> for Statement<'_> {
    fn walk_ast<'b>(&'b self, out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        match self {
            Statement::Insert(q) => q.walk_ast(out),
            Statement::Delete(q) => q.walk_ast(out),
            Statement::Notify(q) => q.walk_ast(out),
        }
    }
}

impl<Conn> RunQueryDsl<Conn> for Statement<'_> {}
