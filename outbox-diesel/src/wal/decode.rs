//! From pgoutput messages to outbox rows: which relation is the outbox table, a captured
//! insert as an [`OutboxRow`], and a parked row released by `retry` (an update) looked up by
//! its `seq`.

use super::captured::rows_by_seq;
use super::*;

impl fmt::Debug for Captured {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Captured::Row(r) => write!(f, "Row({})", r.seq),
            Captured::Released(seq) => write!(f, "Released({seq})"),
        }
    }
}

impl WalReader {
    /// Adds what one change means for the outbox to the open transaction's `rows`: an insert
    /// (not written back as parked) is an event, an update that releases a parked row brings
    /// it back; a relation is remembered; the rest is ignored.
    pub(super) fn capture(
        &mut self,
        message: Message,
        rows: Option<&mut Vec<Captured>>,
    ) -> Result<(), WalError> {
        match message {
            Message::Relation(r) => {
                // the table made again under its name (`partition_table` copies it into a
                // partitioned one): its rows now come under the new table's OID
                if Some(r.oid) != self.table_oid
                    && r.name == self.table.name()
                    && self.table_namespace.as_deref() == Some(r.namespace.as_str())
                {
                    tracing::info!(table = %self.table, oid = r.oid, "the outbox table was made again; reading its rows under its new OID");
                    self.table_oid = Some(r.oid);
                }
                self.relations.insert(r.oid, r);
            }
            Message::Insert { relation, tuple } => {
                if let (Some(rows), Some(rel)) = (rows, self.our_relation(relation))
                    && !is_set(&tuple, rel, "parked_at")
                {
                    rows.push(Captured::Row(Box::new(self.to_row(rel, &tuple)?)));
                }
            }
            Message::Update { relation, tuple } => {
                if let (Some(rows), Some(rel)) = (rows, self.our_relation(relation))
                    && is_null(&tuple, rel, "parked_at")
                    && is_null(&tuple, rel, "published_at")
                    && is_set(&tuple, rel, "last_error")
                {
                    let seq = text(&tuple, rel, "seq")
                        .and_then(|s| s.parse::<i64>().ok())
                        .ok_or_else(|| self.bad("seq", "missing in an update".into()))?;
                    rows.push(Captured::Released(seq));
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The transactions with their rows: a released parked row is read as it is now.
    pub(super) async fn resolve(
        &mut self,
        conn: &mut AsyncPgConnection,
        transactions: Vec<Read>,
    ) -> Result<Vec<Transaction>, WalError> {
        let released: Vec<i64> = transactions
            .iter()
            .flat_map(|t| t.captured.iter())
            .filter_map(|c| match c {
                Captured::Released(seq) => Some(*seq),
                Captured::Row(_) => None,
            })
            .collect();
        for t in &transactions {
            for c in &t.captured {
                if let Captured::Released(seq) = c {
                    self.released.push((t.commit_lsn, *seq));
                }
            }
        }
        let mut current_rows: HashMap<i64, OutboxRow> = if released.is_empty() {
            HashMap::new()
        } else {
            rows_by_seq(conn, &self.table, &released)
                .await?
                .into_iter()
                .map(|r| (r.seq, r))
                .collect()
        };
        let transactions = transactions
            .into_iter()
            .map(|t| Transaction {
                xid: t.xid,
                commit_lsn: t.commit_lsn,
                end_lsn: t.end_lsn,
                commit_time: t.commit_time,
                rows: t
                    .captured
                    .into_iter()
                    .filter_map(|c| match c {
                        Captured::Row(r) => Some(*r),
                        Captured::Released(seq) => current_rows.remove(&seq),
                    })
                    .collect(),
            })
            .collect::<Vec<_>>();
        Ok(transactions)
    }

    pub(super) fn our_relation(&self, oid: u32) -> Option<&Relation> {
        if Some(oid) != self.table_oid {
            return None;
        }
        self.relations.get(&oid)
    }

    pub(super) fn bad(&self, column: &'static str, reason: String) -> WalError {
        WalError::BadRow {
            table: self.table.to_string(),
            column,
            reason,
        }
    }

    pub(super) fn to_row(&self, rel: &Relation, t: &Tuple) -> Result<OutboxRow, WalError> {
        let need = |column: &'static str| {
            text(t, rel, column).ok_or_else(|| self.bad(column, "missing or NULL".into()))
        };
        let json = |column: &'static str| -> Result<serde_json::Value, WalError> {
            serde_json::from_str(need(column)?).map_err(|e| self.bad(column, e.to_string()))
        };
        Ok(OutboxRow {
            seq: need("seq")?
                .parse()
                .map_err(|e: std::num::ParseIntError| self.bad("seq", e.to_string()))?,
            id: need("id")?
                .parse()
                .map_err(|e: uuid::Error| self.bad("id", e.to_string()))?,
            aggregate_type: need("aggregate_type")?.to_owned(),
            aggregate_id: need("aggregate_id")?.to_owned(),
            event_type: need("event_type")?.to_owned(),
            payload: RawJson::from_postgres(need("payload")?.to_owned()),
            headers: match text(t, rel, "headers") {
                Some(_) => json("headers")?,
                None => serde_json::Value::Object(Default::default()),
            },
            created_at: text(t, rel, "created_at")
                .and_then(parse_timestamptz)
                .unwrap_or_else(Utc::now),
            attempts: text(t, rel, "attempts")
                .and_then(|a| a.parse().ok())
                .unwrap_or(0),
        })
    }
}

pub(super) enum Captured {
    Row(Box<OutboxRow>),
    Released(i64),
}

pub(super) fn text<'t>(t: &'t Tuple, rel: &Relation, column: &str) -> Option<&'t str> {
    match t.get(rel, column)? {
        Value::Text(s) => Some(s.as_str()),
        _ => None,
    }
}

pub(super) fn is_set(t: &Tuple, rel: &Relation, column: &str) -> bool {
    matches!(t.get(rel, column), Some(Value::Text(_)))
}

pub(super) fn is_null(t: &Tuple, rel: &Relation, column: &str) -> bool {
    matches!(t.get(rel, column), Some(Value::Null) | None)
}

/// Parses `timestamptz` output in the ISO style (`2026-12-01 10:00:00.123456+00`).
pub(super) fn parse_timestamptz(s: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f%#z")
        .ok()
        .map(|d| d.with_timezone(&Utc))
}
