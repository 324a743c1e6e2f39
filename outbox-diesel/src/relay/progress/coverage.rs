//! Coverage: how the operations (backlog, parked rows, retry) tell the rows a cursor read from
//! the unpublished ones.

use diesel::QueryResult;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;

use super::{COVERED, cursors_cte, has_cursors, may_read_progress, progress_table};

/// What the operations need to tell the rows a cursor read from the unpublished ones: for a
/// table with snapshot batches, its cursors (`WITH c AS …`) and [`COVERED`]; for one made
/// before them, nothing is covered.
pub(crate) struct Coverage {
    cte: Option<String>,
}

impl Coverage {
    /// Reads whether an ordered relay records its progress on `table` (since the last
    /// [`settle_progress`](super::settle_progress)). A role that may not read the progress table was never an ordered
    /// relay's (a log-tailing relay granted only the outbox table): for it, nothing is covered.
    pub(crate) async fn of(conn: &mut AsyncPgConnection, table: &OutboxTable) -> QueryResult<Self> {
        if !has_cursors(conn, table).await? || !may_read_progress(conn, table, "SELECT").await? {
            return Ok(Coverage { cte: None });
        }
        let f: super::super::Flag = diesel::sql_query(format!(
            "SELECT EXISTS (SELECT 1 FROM {}) AS flag",
            progress_table(table)
        ))
        .get_result(conn)
        .await?;
        Ok(Coverage {
            cte: f.flag.unwrap_or(false).then(|| cursors_cte(table)),
        })
    }

    /// Whether an ordered relay records its progress on the table: a row it read past and
    /// `retry` releases is then marked released (`'infinity'`), for the relay to read apart.
    pub(crate) fn in_use(&self) -> bool {
        self.cte.is_some()
    }

    /// `WITH c AS (…)`, to start the statement with.
    pub(crate) fn with(&self) -> String {
        match &self.cte {
            Some(cte) => format!("WITH {cte} "),
            None => String::new(),
        }
    }

    /// Whether row `o` was read by a cursor.
    pub(crate) fn covered(&self) -> &'static str {
        if self.cte.is_some() { COVERED } else { "false" }
    }

    /// The unpublished rows of `table` (parked and held ones included), to read `FROM … o`.
    /// With cursors, four parts that each use an index: parked rows, rows after the highest
    /// cursor (which no cursor has read: counted without a look at the cursors, which costs a
    /// look at each cursor per row), rows after the lowest cursor up to the highest, and rows
    /// at or below the lowest of transactions some cursor's snapshot did not see.
    pub(crate) fn unpublished(&self, table: &OutboxTable) -> String {
        let t = table.quoted();
        if self.cte.is_none() {
            return format!("(SELECT * FROM {t} WHERE published_at IS NULL) o");
        }
        const LOW: &str = "(SELECT COALESCE(min(upto_seq), 0) FROM c)";
        const HIGH: &str = "(SELECT COALESCE(max(upto_seq), 0) FROM c)";
        format!(
            "(SELECT o.* FROM {t} o WHERE o.published_at IS NULL AND o.parked_at IS NOT NULL \
             UNION ALL SELECT o.* FROM {t} o WHERE o.published_at IS NULL AND o.parked_at IS NULL \
             AND o.seq > {HIGH} \
             UNION ALL SELECT o.* FROM {t} o WHERE o.published_at IS NULL AND o.parked_at IS NULL \
             AND o.seq > {LOW} AND o.seq <= {HIGH} AND NOT {COVERED} \
             UNION ALL SELECT o.* FROM {t} o WHERE o.published_at IS NULL AND o.parked_at IS NULL \
             AND o.seq <= {LOW} AND ((o.txid >= (SELECT min(pg_snapshot_xmax(snap)) FROM c) \
             AND o.txid < pg_snapshot_xmax(pg_current_snapshot())) \
             OR o.txid = ANY(ARRAY(SELECT pg_snapshot_xip(snap) FROM c))) AND NOT {COVERED}) o"
        )
    }
}
