//! The slot's life: setting it up, the relay's record of it (its last confirmed position, so
//! a lost slot is an error and not a silent restart), creating it with its snapshot,
//! advancing it and closing the reader. The publication is in `publication.rs`, what the
//! server says of a slot (its state, lag and reader's lock) in `status.rs`.

use super::error::{classify, maybe_busy};
use super::*;

/// Where a reader's slot stands, as [`WalReader::setup`] finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SlotState {
    /// The slot exists and every row recorded before it was published: read it.
    Ready,
    /// There is no slot: [`WalReader::create_slot`] makes it, with the snapshot of the rows
    /// recorded before it.
    Missing,
    /// The slot exists, but the rows recorded before it were not all published (the relay
    /// stopped during its first start): [`WalReader::create_slot`] makes it again.
    Unfinished,
}

/// The name of the relay's record of its slots, beside the outbox table.
pub const SLOTS_TABLE: &str = "outbox_relay_slots";

#[derive(QueryableByName)]
pub(super) struct SlotRecord {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    confirmed: Option<i64>,
    #[diesel(sql_type = diesel::sql_types::Timestamptz)]
    updated_at: DateTime<Utc>,
}

impl WalReader {
    /// Prepares `conn` (UTC, ISO dates, so timestamps decode the same everywhere), creates the
    /// publication and the relay's record of its slots (`outbox_relay_slots`, beside the
    /// table) when missing, and says where the slot stands. A streaming reader's missing slot
    /// is made by [`WalReader::create_slot`]; a reader that reads with SQL creates it here
    /// (and sees only what commits after that).
    ///
    /// A missing slot that the record says was read before is [`WalError::SlotMissing`],
    /// unless the reader [recovers](WalReader::recover).
    pub async fn setup(&mut self, conn: &mut AsyncPgConnection) -> Result<SlotState, WalError> {
        check_slot_name(&self.slot).map_err(|reason| WalError::SlotMismatch {
            slot: self.slot.clone(),
            found: reason,
        })?;
        conn.batch_execute("SET TimeZone = 'UTC'; SET DateStyle = 'ISO, YMD'")
            .await?;
        let found: Oid = diesel::sql_query(format!(
            "SELECT c.oid::bigint AS oid, n.nspname::text AS namespace FROM (SELECT to_regclass({})) r(t) \
             LEFT JOIN pg_class c ON c.oid = r.t LEFT JOIN pg_namespace n ON n.oid = c.relnamespace",
            quote_literal(&self.table.quoted())
        ))
        .get_result(conn)
        .await?;
        let oid = found
            .oid
            .ok_or_else(|| WalError::TableMissing(self.table.to_string()))?;
        self.table_oid = Some(oid as u32);
        self.table_namespace = found.namespace;
        self.ensure_publication(conn).await?;
        self.ensure_record(conn).await?;
        let record = self.record(conn).await?;
        let exists = self.check_slot(conn).await?;
        match (exists, record) {
            (true, Some(r)) if r.state == "snapshot" => Ok(SlotState::Unfinished),
            (true, r) => {
                if r.is_none() {
                    // a slot made before the record existed, or by hand
                    self.write_record(conn, "streaming", None).await?;
                }
                Ok(SlotState::Ready)
            }
            (false, Some(r)) if r.state == "streaming" && !self.recover => {
                Err(WalError::SlotMissing {
                    slot: self.slot.clone(),
                    confirmed: Lsn(r.confirmed.unwrap_or_default() as u64),
                    recorded_at: r.updated_at,
                })
            }
            (false, _) if self.streaming.is_none() => {
                self.create_slot_sql(conn).await?;
                self.write_record(conn, "streaming", None).await?;
                Ok(SlotState::Ready)
            }
            (false, _) => Ok(SlotState::Missing),
        }
    }

    pub(super) fn record_table(&self) -> String {
        match self.table.schema() {
            Some(s) => format!("{}.{SLOTS_TABLE}", quote_ident(s)),
            None => SLOTS_TABLE.to_owned(),
        }
    }

    pub(super) async fn ensure_record(&self, conn: &mut AsyncPgConnection) -> Result<(), WalError> {
        let t = self.record_table();
        let found: Oid = diesel::sql_query(format!(
            "SELECT to_regclass({})::oid::bigint AS oid, NULL::text AS namespace",
            quote_literal(&t)
        ))
        .get_result(conn)
        .await?;
        if found.oid.is_some() {
            return Ok(());
        }
        let sql = format!(
            "CREATE TABLE IF NOT EXISTS {t} (slot_name text PRIMARY KEY, table_name text NOT NULL, \
             state text NOT NULL CHECK (state IN ('snapshot', 'streaming')), confirmed_lsn pg_lsn, \
             created_at timestamptz NOT NULL DEFAULT now(), updated_at timestamptz NOT NULL DEFAULT now())"
        );
        match conn.batch_execute(&sql).await {
            Ok(()) => Ok(()),
            // decided on the server's state, not on the message (worded in the language of
            // the server's lc_messages)
            Err(e @ DieselError::DatabaseError(..)) => {
                let now: Oid = diesel::sql_query(format!(
                    "SELECT to_regclass({})::oid::bigint AS oid, NULL::text AS namespace",
                    quote_literal(&t)
                ))
                .get_result(conn)
                .await?;
                if now.oid.is_some() {
                    // another relay created it meanwhile
                    return Ok(());
                }
                let may: Flag = diesel::sql_query(
                    "SELECT has_schema_privilege(COALESCE($1, current_schema()), 'CREATE') AS flag",
                )
                .bind::<Nullable<Text>, _>(self.table.schema())
                .get_result(conn)
                .await?;
                if may.flag == Some(false) {
                    Err(WalError::RecordRight {
                        table: t,
                        sql,
                        source: e,
                    })
                } else {
                    Err(e.into())
                }
            }
            Err(e) => Err(e.into()),
        }
    }

    pub(super) async fn record(
        &self,
        conn: &mut AsyncPgConnection,
    ) -> Result<Option<SlotRecord>, WalError> {
        let rows: Vec<SlotRecord> = diesel::sql_query(format!(
            "SELECT state, (confirmed_lsn - '0/0'::pg_lsn)::bigint AS confirmed, updated_at \
             FROM {} WHERE slot_name = $1",
            self.record_table()
        ))
        .bind::<Text, _>(&self.slot)
        .load(conn)
        .await?;
        Ok(rows.into_iter().next())
    }

    pub(super) async fn write_record(
        &self,
        conn: &mut AsyncPgConnection,
        state: &str,
        confirmed: Option<Lsn>,
    ) -> Result<(), WalError> {
        diesel::sql_query(format!(
            "INSERT INTO {} (slot_name, table_name, state, confirmed_lsn) VALUES ($1, $2, $3, $4::pg_lsn) \
             ON CONFLICT (slot_name) DO UPDATE SET table_name = EXCLUDED.table_name, \
             state = EXCLUDED.state, confirmed_lsn = EXCLUDED.confirmed_lsn, updated_at = now()",
            self.record_table()
        ))
        .bind::<Text, _>(&self.slot)
        .bind::<Text, _>(self.table.to_string())
        .bind::<Text, _>(state)
        .bind::<Nullable<Text>, _>(confirmed.map(|l| l.to_string()))
        .execute(conn)
        .await?;
        Ok(())
    }

    /// Records `confirmed` as the slot's last confirmed position in the relay's record (what
    /// [`WalError::SlotMissing`] reports when the slot is lost).
    pub async fn save_position(
        &self,
        conn: &mut AsyncPgConnection,
        confirmed: Lsn,
    ) -> Result<(), WalError> {
        diesel::sql_query(format!(
            "UPDATE {} SET confirmed_lsn = $2::pg_lsn, updated_at = now() \
             WHERE slot_name = $1 AND state = 'streaming' \
             AND (confirmed_lsn IS NULL OR confirmed_lsn < $2::pg_lsn)",
            self.record_table()
        ))
        .bind::<Text, _>(&self.slot)
        .bind::<Text, _>(confirmed.to_string())
        .execute(conn)
        .await?;
        Ok(())
    }

    /// Makes the streaming reader's slot (dropping an [unfinished](SlotState::Unfinished) one
    /// first) with an exported snapshot, and opens on `snapshot` a read-only repeatable-read
    /// transaction on that snapshot: it sees exactly the rows committed before the slot's
    /// consistent point, which the slot will not send. Read them with [`snapshot_rows`], end
    /// the transaction with [`end_snapshot`], then [`WalReader::finish_slot`]. Returns the
    /// consistent point.
    ///
    /// Until `finish_slot`, the record says the slot is unfinished, so that a relay that stops
    /// meanwhile makes it again (and publishes the rows before it again) on its next start.
    /// Creating a slot waits for the transactions running at that moment to end; `conn` is
    /// sent a query every [`keep_session_alive`](WalReader::keep_session_alive) meanwhile.
    pub async fn create_slot(
        &mut self,
        conn: &mut AsyncPgConnection,
        snapshot: &mut AsyncPgConnection,
    ) -> Result<Lsn, WalError> {
        let Some(cfg) = self.streaming.clone() else {
            return Err(self.stream_error("only a streaming reader makes its slot with a snapshot"));
        };
        let mut tries = 0;
        while self.check_slot(conn).await? {
            // the sender of a reader that stopped during its first start may linger a moment
            end_stale_sender(conn, &self.slot).await?;
            let dropped = match diesel::sql_query("SELECT pg_drop_replication_slot($1)")
                .bind::<Text, _>(&self.slot)
                .execute(conn)
                .await
            {
                Ok(n) => Ok(n),
                Err(e) => Err(classify(conn, e, &self.slot).await),
            };
            match dropped {
                Ok(_) => {
                    tracing::info!(slot = %self.slot, "unfinished replication slot dropped");
                }
                Err(e) if maybe_busy(&e) && tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e),
            }
        }
        self.write_record(conn, "snapshot", None).await?;
        tracing::info!(slot = %self.slot, "creating the replication slot (this waits for the transactions running now to end)");
        let mut client =
            pgwire_replication::ReplicationClient::connect_gated(self.replication_config(&cfg))
                .await
                .map_err(|e| self.connection_error(e))?;
        // the wait lasts until every transaction running now ends: the caller's session, which
        // holds the reader's lock, is kept alive meanwhile
        let every = self.keep_alive;
        let result = {
            let mut import = std::pin::pin!(self.export_and_import(&mut client, snapshot));
            loop {
                match tokio::time::timeout(every, import.as_mut()).await {
                    Ok(result) => break result,
                    Err(_) => {
                        if let Err(e) = diesel::sql_query("SELECT 1").execute(conn).await {
                            break Err(e.into());
                        }
                    }
                }
            }
        };
        client.abort();
        let at = result?;
        self.acked = Lsn(0);
        tracing::info!(slot = %self.slot, lsn = %at, "replication slot created");
        Ok(at)
    }

    pub(super) async fn export_and_import(
        &self,
        client: &mut pgwire_replication::ReplicationClient,
        snapshot: &mut AsyncPgConnection,
    ) -> Result<Lsn, WalError> {
        let rows = client
            .simple_query(&format!(
                "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput EXPORT_SNAPSHOT",
                self.slot
            ))
            .await
            .map_err(|e| self.connection_error(e))?;
        let col = |i: usize| {
            rows.as_slice()
                .first()
                .and_then(|r| r.get(i))
                .and_then(|v| v.as_ref())
                .map(|b| String::from_utf8_lossy(b).into_owned())
        };
        let (Some(point), Some(name)) = (col(1), col(2)) else {
            return Err(self.stream_error("CREATE_REPLICATION_SLOT returned no snapshot"));
        };
        let at: Lsn = point.parse().map_err(|e: String| self.stream_error(e))?;
        // the exported snapshot lives while the replication session is idle: import it now
        snapshot
            .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .await?;
        snapshot
            .batch_execute(&format!(
                "SET TRANSACTION SNAPSHOT {}",
                quote_literal(&name)
            ))
            .await?;
        Ok(at)
    }

    /// Records that every row recorded before the slot made by [`WalReader::create_slot`] was
    /// published: from now on the slot is read, and a missing slot is an error.
    pub async fn finish_slot(&self, conn: &mut AsyncPgConnection, at: Lsn) -> Result<(), WalError> {
        self.write_record(conn, "streaming", Some(at)).await
    }

    /// Creates the slot with the SQL function (no snapshot): for a reader that reads with SQL.
    pub(super) async fn create_slot_sql(
        &self,
        conn: &mut AsyncPgConnection,
    ) -> Result<Option<Lsn>, WalError> {
        let created: Result<Position, _> = diesel::sql_query(
            "SELECT (lsn - '0/0'::pg_lsn)::bigint AS lsn \
             FROM pg_create_logical_replication_slot($1, 'pgoutput')",
        )
        .bind::<Text, _>(&self.slot)
        .get_result(conn)
        .await;
        match created {
            Ok(p) => {
                let at = Lsn(p.lsn.unwrap_or_default() as u64);
                tracing::info!(slot = %self.slot, lsn = %at, "replication slot created");
                Ok(Some(at))
            }
            // another reader created it meanwhile
            Err(e) if self.check_slot(conn).await.unwrap_or(false) => {
                tracing::debug!(slot = %self.slot, error = %e, "replication slot created meanwhile");
                Ok(None)
            }
            Err(e) => Err(classify(conn, e, &self.slot).await),
        }
    }
}

impl WalReader {
    /// Ends a streaming reader's replication connection after telling the server the last
    /// confirmed position, and confirms it on `conn` too, so that a clean stop leaves nothing
    /// to read again. Reading afterwards connects again.
    pub async fn close(&mut self, conn: &mut AsyncPgConnection) -> Result<(), WalError> {
        if let Some(mut st) = self.stream.take() {
            let stopped = tokio::time::timeout(Duration::from_secs(5), st.client.shutdown()).await;
            if !matches!(stopped, Ok(Ok(()))) {
                st.client.abort();
            }
        }
        if self.streaming.is_none() || self.acked == Lsn(0) {
            return Ok(());
        }
        // the sender lets go of the slot as it exits
        for _ in 0..100 {
            match self.advance_sql(conn, self.acked).await {
                Err(e) if maybe_busy(&e) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => {
                    other?;
                    return self.save_position(conn, self.acked).await;
                }
            }
        }
        Ok(())
    }
}

/// Ends the walsender that holds `slot`, if any (not a SQL session that reads it for an
/// instant, such as `outbox-relay status`).
pub(super) async fn end_stale_sender(
    conn: &mut AsyncPgConnection,
    slot: &str,
) -> Result<(), WalError> {
    diesel::sql_query(
        "SELECT pg_terminate_backend(s.active_pid) FROM pg_replication_slots s \
         JOIN pg_stat_activity a ON a.pid = s.active_pid \
         WHERE s.slot_name = $1 AND a.backend_type = 'walsender'",
    )
    .bind::<Text, _>(slot)
    .execute(conn)
    .await?;
    Ok(())
}

impl WalReader {
    /// Confirms the slot up to `to` with `pg_replication_slot_advance`, when no replication
    /// connection of this reader holds the slot.
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
