//! The SQL reading path: `pg_logical_slot_peek_binary_changes` on the caller's connection,
//! and `pg_replication_slot_advance` to confirm. `status` and readers without a replication
//! connection of their own use it.

use super::decode::Captured;
use super::error::classify;
use super::*;

#[derive(QueryableByName)]
pub(super) struct Change {
    #[diesel(sql_type = diesel::sql_types::Binary)]
    pub(super) data: Vec<u8>,
}

impl WalReader {
    pub(super) async fn read_sql(
        &mut self,
        conn: &mut AsyncPgConnection,
        limit: usize,
    ) -> Result<WalBatch, WalError> {
        let flush: Position =
            diesel::sql_query("SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::bigint AS lsn")
                .get_result(conn)
                .await?;
        let changes: Vec<Change> = match diesel::sql_query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1::name, NULL, $2, \
             'proto_version', '1', 'publication_names', $3)",
        )
        .bind::<Text, _>(&self.slot)
        .bind::<Integer, _>(i32::try_from(limit).unwrap_or(i32::MAX))
        .bind::<Text, _>(quote_ident(&self.publication))
        .load(conn)
        .await
        {
            Ok(changes) => changes,
            Err(e) => return Err(classify(conn, e, &self.slot).await),
        };
        let messages = changes.len();
        let mut transactions = Vec::new();
        let mut current: Option<(u32, Lsn, Vec<Captured>)> = None;
        let mut last_commit = None;
        for change in &changes {
            match pgoutput::decode(&change.data)? {
                Message::Begin { xid, final_lsn, .. } => {
                    current = Some((xid, Lsn(final_lsn), Vec::new()))
                }
                Message::Commit {
                    end_lsn,
                    commit_time_micros,
                    ..
                } => {
                    last_commit = Some(Lsn(end_lsn));
                    if let Some((xid, commit_lsn, captured)) = current.take()
                        && !captured.is_empty()
                    {
                        transactions.push(Read {
                            xid,
                            commit_lsn,
                            end_lsn: Some(Lsn(end_lsn)),
                            commit_time: pgoutput::commit_time(commit_time_micros),
                            captured,
                        });
                    }
                }
                other => self.capture(other, current.as_mut().map(|c| &mut c.2))?,
            }
        }
        let transactions = self.resolve(conn, transactions).await?;
        let caught_up_to = if messages < limit {
            flush.lsn.map(|l| Lsn(l as u64)).max(last_commit)
        } else {
            last_commit
        };
        Ok(WalBatch {
            transactions,
            caught_up_to,
            messages,
        })
    }

    pub(super) async fn advance_sql(
        &self,
        conn: &mut AsyncPgConnection,
        to: Lsn,
    ) -> Result<Lsn, WalError> {
        let p: Position = match diesel::sql_query(
            "SELECT (CASE WHEN s.confirmed_flush_lsn < $2::pg_lsn \
             THEN (SELECT end_lsn FROM pg_replication_slot_advance($1::name, $2::pg_lsn)) \
             ELSE s.confirmed_flush_lsn END - '0/0'::pg_lsn)::bigint AS lsn \
             FROM pg_replication_slots s WHERE s.slot_name = $1",
        )
        .bind::<Text, _>(&self.slot)
        .bind::<Text, _>(to.to_string())
        .get_result(conn)
        .await
        {
            Ok(p) => p,
            Err(e) => return Err(classify(conn, e, &self.slot).await),
        };
        Ok(Lsn(p.lsn.unwrap_or_default() as u64))
    }
}
