//! What the server says of a slot: whether it is there and usable by this database, its
//! confirmed position, how far it lags and which session holds its reader's advisory lock
//! (`outbox-relay status`, the relay's lag metrics).

use super::*;

#[derive(QueryableByName)]
struct SlotRow {
    #[diesel(sql_type = Nullable<Text>)]
    plugin: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    database: Option<String>,
    #[diesel(sql_type = Nullable<Bool>)]
    here: Option<bool>,
    #[diesel(sql_type = Nullable<Text>)]
    wal_status: Option<String>,
    #[diesel(sql_type = Nullable<BigInt>)]
    confirmed: Option<i64>,
}

impl WalReader {
    /// Whether the slot exists; an error when it is not a usable slot of this database.
    pub(super) async fn check_slot(&self, conn: &mut AsyncPgConnection) -> Result<bool, WalError> {
        let found: Vec<SlotRow> = diesel::sql_query(
            "SELECT s.plugin::text AS plugin, d.datname::text AS database, \
             d.datname = current_database() AS here, s.wal_status, \
             (s.confirmed_flush_lsn - '0/0'::pg_lsn)::bigint AS confirmed \
             FROM pg_replication_slots s LEFT JOIN pg_database d ON d.oid = s.datoid \
             WHERE s.slot_name = $1",
        )
        .bind::<Text, _>(&self.slot)
        .load(conn)
        .await?;
        if let Some(s) = found.as_slice().first() {
            if s.plugin.as_deref() != Some("pgoutput") || s.here != Some(true) {
                return Err(WalError::SlotMismatch {
                    slot: self.slot.clone(),
                    found: format!(
                        "a slot of plugin {} in database {}",
                        s.plugin.as_deref().unwrap_or("none (physical)"),
                        s.database.as_deref().unwrap_or("none")
                    ),
                });
            }
            if s.wal_status.as_deref() == Some("lost") || s.confirmed.is_none() {
                return Err(WalError::SlotLost {
                    slot: self.slot.clone(),
                    state: s.wal_status.clone().unwrap_or_else(|| "invalid".into()),
                });
            }
            return Ok(true);
        }
        Ok(false)
    }

    /// The slot's confirmed position now.
    pub async fn confirmed(&self, conn: &mut AsyncPgConnection) -> Result<Option<Lsn>, WalError> {
        let p: Vec<Position> = diesel::sql_query(
            "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint AS lsn \
             FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind::<Text, _>(&self.slot)
        .load(conn)
        .await?;
        Ok(p.as_slice()
            .first()
            .and_then(|p| p.lsn)
            .map(|l| Lsn(l as u64)))
    }
}

/// A replication slot's state and how far it lags.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct SlotLag {
    /// The slot.
    #[diesel(sql_type = Text)]
    pub slot: String,
    /// Its confirmed position (`X/X`).
    #[diesel(sql_type = Nullable<Text>)]
    pub confirmed_flush_lsn: Option<String>,
    /// Bytes of WAL written since its confirmed position: what a reader has yet to confirm.
    #[diesel(sql_type = BigInt)]
    pub lag_bytes: i64,
    /// Bytes of WAL the slot keeps on disk (from its restart position).
    #[diesel(sql_type = BigInt)]
    pub retained_bytes: i64,
    /// PostgreSQL's `wal_status`: `reserved`, `extended`, `unreserved` (about to be lost) or
    /// `lost`.
    #[diesel(sql_type = Nullable<Text>)]
    pub wal_status: Option<String>,
    /// Bytes that may still be written before the slot is lost to `max_slot_wal_keep_size`;
    /// `None` when that setting is unlimited.
    #[diesel(sql_type = Nullable<BigInt>)]
    pub safe_wal_size: Option<i64>,
    /// The relay session that holds the reader's lock.
    #[diesel(sql_type = Nullable<Integer>)]
    pub reader_pid: Option<i32>,
}

/// The lag of `slot`, or `None` when it does not exist.
pub async fn slot_lag(
    conn: &mut AsyncPgConnection,
    slot: &str,
) -> diesel::QueryResult<Option<SlotLag>> {
    let rows: Vec<SlotLag> = diesel::sql_query(format!(
        "SELECT s.slot_name::text AS slot, s.confirmed_flush_lsn::text AS confirmed_flush_lsn, \
         COALESCE((pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint, 0) AS lag_bytes, \
         COALESCE((pg_current_wal_lsn() - s.restart_lsn)::bigint, 0) AS retained_bytes, \
         s.wal_status, s.safe_wal_size, \
         (SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
          AND l.objsubid = 2 AND l.classid = {SLOT_LOCK_KEY} AND l.objid = hashtext(s.slot_name::text)::oid \
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) LIMIT 1) AS reader_pid \
         FROM pg_replication_slots s WHERE s.slot_name = $1"
    ))
    .bind::<Text, _>(slot)
    .load(conn)
    .await?;
    Ok(rows.into_iter().next())
}
