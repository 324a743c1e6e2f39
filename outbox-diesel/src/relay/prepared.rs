//! Statements of fixed text that Diesel prepares once per session.

use diesel::QueryResult;
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::Text;

/// A statement of fixed text with text binds, which Diesel prepares once per session and then
/// runs on its cached statement, planned once (the relay's session keeps the generic plan). A
/// statement of `sql_query` is never cached: each call sends, parses and plans it again, which
/// for the relays' looks at `pg_locks` and the catalogs, once a second, cost more than running
/// them. `pieces` has one item more than `binds`: each bind stands between two pieces.
pub(crate) struct Prepared<'a> {
    pub(crate) pieces: &'a [&'a str],
    pub(crate) binds: &'a [&'a str],
}

impl QueryId for Prepared<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl Query for Prepared<'_> {
    type SqlType = diesel::sql_types::Untyped;
}

impl QueryFragment<Pg> for Prepared<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        if self.pieces.len() != self.binds.len() + 1 {
            return Err(diesel::result::Error::QueryBuilderError(
                format!(
                    "a statement of {} pieces has {} binds, one fewer than its pieces",
                    self.pieces.len(),
                    self.binds.len()
                )
                .into(),
            ));
        }
        for (i, piece) in self.pieces.iter().enumerate() {
            out.push_sql(piece);
            if let Some(bind) = self.binds.get(i) {
                out.push_bind_param::<Text, _>(bind)?;
            }
        }
        Ok(())
    }
}

impl<Conn> diesel::RunQueryDsl<Conn> for Prepared<'_> {}
