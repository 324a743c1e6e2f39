//! The publication that log tailing reads through: checked, or created when missing, with
//! the reason when the relay may not create it.

use super::*;

#[derive(QueryableByName)]
struct PubRow {
    #[diesel(sql_type = Bool)]
    pubinsert: bool,
    #[diesel(sql_type = Bool)]
    pubupdate: bool,
    #[diesel(sql_type = Bool)]
    has_table: bool,
    /// Whether the publication sends a partitioned table's rows under the table's own name.
    #[diesel(sql_type = Bool)]
    pubviaroot: bool,
    /// Whether the table is partitioned ([`partition_table`](crate::partition_table)).
    #[diesel(sql_type = Bool)]
    partitioned: bool,
}

impl WalReader {
    pub(super) async fn ensure_publication(
        &self,
        conn: &mut AsyncPgConnection,
    ) -> Result<(), WalError> {
        let found: Vec<PubRow> = diesel::sql_query(format!(
            "SELECT p.pubinsert, p.pubupdate, (p.puballtables OR EXISTS (SELECT 1 FROM pg_publication_rel r \
             WHERE r.prpubid = p.oid AND r.prrelid = to_regclass({t}))) AS has_table, p.pubviaroot, \
             EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = to_regclass({t}) AND c.relkind = 'p') \
             AS partitioned FROM pg_publication p WHERE p.pubname = $1",
            t = quote_literal(&self.table.quoted())
        ))
        .bind::<Text, _>(&self.publication)
        .load(conn)
        .await?;
        match found.as_slice().first() {
            Some(p) if p.partitioned && !p.pubviaroot => Err(WalError::PublicationNotViaRoot {
                publication: self.publication.clone(),
                table: self.table.to_string(),
            }),
            Some(p) if p.pubinsert && p.has_table => {
                if !p.pubupdate {
                    tracing::warn!(publication = %self.publication, "the publication does not publish updates: `outbox-relay retry` of a parked event is not seen by log tailing");
                }
                Ok(())
            }
            Some(_) => Err(WalError::PublicationMismatch {
                publication: self.publication.clone(),
                table: self.table.to_string(),
            }),
            None => {
                let sql = format!(
                    "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert, update', \
                     publish_via_partition_root = true)",
                    quote_ident(&self.publication),
                    self.table.quoted()
                );
                match conn.batch_execute(&sql).await {
                    Ok(()) => {
                        tracing::info!(publication = %self.publication, table = %self.table, "publication created");
                        Ok(())
                    }
                    // decided on the server's state, not on the message (worded in the
                    // language of the server's lc_messages)
                    Err(e @ DieselError::DatabaseError(..)) => {
                        let now: Vec<PubRow> = diesel::sql_query(
                            "SELECT true AS pubinsert, true AS pubupdate, true AS has_table, \
                             true AS pubviaroot, false AS partitioned \
                             FROM pg_publication WHERE pubname = $1",
                        )
                        .bind::<Text, _>(&self.publication)
                        .load(conn)
                        .await?;
                        if !now.is_empty() {
                            // another relay created it meanwhile
                            return Ok(());
                        }
                        let may: Flag = diesel::sql_query(
                            "SELECT pg_has_role(current_user, c.relowner, 'USAGE') \
                             AND has_database_privilege(current_database(), 'CREATE') AS flag \
                             FROM pg_class c WHERE c.oid = to_regclass($1)",
                        )
                        .bind::<Text, _>(self.table.quoted())
                        .get_result(conn)
                        .await?;
                        if may.flag == Some(false) {
                            Err(WalError::PublicationRight {
                                publication: self.publication.clone(),
                                table: self.table.to_string(),
                                source: e,
                            })
                        } else {
                            Err(e.into())
                        }
                    }
                    Err(e) => Err(e.into()),
                }
            }
        }
    }
}
