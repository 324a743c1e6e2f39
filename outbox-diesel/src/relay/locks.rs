//! Locks and membership: the relay's advisory locks (partitions, slots), and the relays
//! taking part in balancing.

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text, Timestamptz};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::OutboxTable;

use super::prepared::Prepared;
use super::{Flag, Partition};

/// The first key of the lock that makes a relay the reader of a slot ([`AdvisoryLock::Slot`]).
/// It is `'OBLT'` in ASCII; a partition's lock has the outbox table's OID there instead, and
/// OIDs of user tables start at 16384 and stay far below it, so the two never meet.
pub const SLOT_LOCK_KEY: i32 = 0x4F42_4C54;

/// The first key of the lock that makes a relay the one that reads a table's statistics for
/// the others ([`AdvisoryLock::Statistics`]): `'OBST'` in ASCII, beside [`SLOT_LOCK_KEY`] and
/// as far from the OIDs of user tables.
pub const STATISTICS_LOCK_KEY: i32 = 0x4F42_5354;

/// A session advisory lock of the relay's: every kind in one place, with its key, so that no
/// two kinds meet. Each lasts until it is released or the session ends, so the work of a relay
/// that died is free as soon as PostgreSQL notices its connection is gone.
///
/// | lock | who holds it | key |
/// |---|---|---|
/// | [`Partition`](Self::Partition) | the owner of a partition (ordered mode), exclusive | `(<table OID>, <partition index>)` |
/// | [`Slot`](Self::Slot) | the one reader of a slot (log tailing), exclusive | `(SLOT_LOCK_KEY, hashtext(<slot>))` |
/// | [`PartitionCount`](Self::PartitionCount) | every relay of the table, shared: its partition count | `<table OID> << 32 \| 2^31 + <count>` |
/// | [`Statistics`](Self::Statistics) | the relay that reads the table's backlog for the others, exclusive | `(STATISTICS_LOCK_KEY, <table OID>)` |
///
/// The two-key form and the 64-bit form are apart in `pg_locks` (`objsubid` 2 and 1). A
/// relay's join ticket (see [`join_members`]) is the fifth kind: `<table OID> << 32 |
/// <ticket>`, below 2^31, taken by the query that picks it.
///
/// ```no_run
/// use outbox_diesel::OutboxTable;
/// use outbox_diesel::relay::{AdvisoryLock, Partition};
///
/// # async fn run(conn: &mut diesel_async::AsyncPgConnection) -> diesel::QueryResult<()> {
/// let table = OutboxTable::DEFAULT;
/// let lock = AdvisoryLock::Partition(&table, Partition { index: 3, count: 16 });
/// if lock.try_lock(conn).await? {
///     // ... publish partition 3
///     lock.unlock(conn).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum AdvisoryLock<'a> {
    /// A partition of a table: its owner.
    Partition(&'a OutboxTable, Partition),
    /// A replication slot: its one reader.
    Slot(&'a str),
    /// A relay of a table running with this many partitions (shared).
    PartitionCount(&'a OutboxTable, u32),
    /// The relay that reads a table's backlog statistics and sends them to the others.
    Statistics(&'a OutboxTable),
}

impl AdvisoryLock<'_> {
    /// Tries to take the lock without waiting; `true` when this session has it (or had it
    /// already).
    pub async fn try_lock(&self, conn: &mut AsyncPgConnection) -> QueryResult<bool> {
        match self {
            Self::PartitionCount(..) => self.call(conn, "pg_try_advisory_lock_shared").await,
            _ => self.call(conn, "pg_try_advisory_lock").await,
        }
    }

    /// Releases the lock; `false` when this session did not hold it.
    pub async fn unlock(&self, conn: &mut AsyncPgConnection) -> QueryResult<bool> {
        match self {
            Self::PartitionCount(..) => self.call(conn, "pg_advisory_unlock_shared").await,
            _ => self.call(conn, "pg_advisory_unlock").await,
        }
    }

    /// Calls the advisory lock `function` on this lock's key: a statement of fixed text for
    /// each function and kind, prepared once per session (a relay tries the partitions'
    /// locks at its looks while the shares move, a standby the slot's at each of its looks).
    async fn call(&self, conn: &mut AsyncPgConnection, function: &str) -> QueryResult<bool> {
        let f: Flag = match *self {
            Self::Partition(table, partition) => {
                let (quoted, index) = (table.quoted(), partition.index.to_string());
                Prepared {
                    pieces: &[
                        &format!("SELECT {function}(to_regclass("),
                        ")::oid::int, ",
                        "::int4) AS flag",
                    ],
                    binds: &[&quoted, &index],
                }
                .get_result(conn)
                .await?
            }
            Self::Slot(slot) => {
                Prepared {
                    pieces: &[
                        &format!("SELECT {function}({SLOT_LOCK_KEY}, hashtext("),
                        ")) AS flag",
                    ],
                    binds: &[slot],
                }
                .get_result(conn)
                .await?
            }
            Self::Statistics(table) => {
                let quoted = table.quoted();
                Prepared {
                    pieces: &[
                        &format!("SELECT {function}({STATISTICS_LOCK_KEY}, to_regclass("),
                        ")::oid::int) AS flag",
                    ],
                    binds: &[&quoted],
                }
                .get_result(conn)
                .await?
            }
            Self::PartitionCount(table, partitions) => {
                let (quoted, key) = (
                    table.quoted(),
                    (COUNT_KEY | i64::from(partitions)).to_string(),
                );
                Prepared {
                    pieces: &[
                        &format!("SELECT {function}((to_regclass("),
                        ")::oid::bigint << 32) | ",
                        "::int8) AS flag",
                    ],
                    binds: &[&quoted, &key],
                }
                .get_result(conn)
                .await?
            }
        };
        Ok(f.flag.unwrap_or(false))
    }
}

/// A relay session holding a partition's lease.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct PartitionOwner {
    /// The partition.
    #[diesel(sql_type = Integer)]
    pub partition: i32,
    /// The owner's backend process id (`pg_stat_activity.pid`).
    #[diesel(sql_type = Integer)]
    pub pid: i32,
    /// The owner's `application_name`.
    #[diesel(sql_type = Nullable<Text>)]
    pub application_name: Option<String>,
    /// The owner's address.
    #[diesel(sql_type = Nullable<Text>)]
    pub client_addr: Option<String>,
    /// Seconds since the owner's current state began.
    #[diesel(sql_type = diesel::sql_types::Double)]
    pub state_age_seconds: f64,
}

/// The sessions that hold partition leases of `table`, by partition.
pub async fn partition_owners(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<Vec<PartitionOwner>> {
    diesel::sql_query(
        "SELECT l.objid::int AS partition, l.pid, a.application_name, host(a.client_addr) AS client_addr, \
         COALESCE(EXTRACT(EPOCH FROM now() - a.state_change), 0)::float8 AS state_age_seconds \
         FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         AND l.classid = to_regclass($1)::oid ORDER BY 1",
    )
    .bind::<Text, _>(table.quoted())
    .load(conn)
    .await
}

/// A relay process taking part in the partition balancing of a table.
#[derive(Debug, Clone, PartialEq, QueryableByName, serde::Serialize)]
pub struct Member {
    /// Its session's backend pid.
    #[diesel(sql_type = Integer)]
    pub pid: i32,
    /// The partition count it runs with.
    #[diesel(sql_type = Integer)]
    pub partitions: i32,
    /// Its place in the order the live relays joined (1 for the first): the lowest is the
    /// oldest. Counted from `pg_locks`, which every role may read.
    #[diesel(sql_type = BigInt)]
    pub joined: i64,
    /// When its session started; `None` when this role may not see it (another role's
    /// session, without `pg_read_all_stats`).
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub backend_start: Option<DateTime<Utc>>,
}

/// The largest partition count: each partition is a session advisory lock in PostgreSQL's
/// shared lock table (`max_locks_per_transaction` × `max_connections` entries, 6,400 by
/// default), which the relays of every table share with the database's other locks.
pub const MAX_PARTITIONS: u32 = crate::partition_index::MAX_PARTITIONS;

/// The low half of a membership key with this bit set carries a partition count; without
/// it, a join ticket.
const COUNT_KEY: i64 = 1 << 31;

/// Announces this session as a relay of `table` running with `partitions` partitions, with
/// two session advisory locks on 64-bit keys whose high half is the table's OID:
///
/// - a shared lock on `2^31 + partitions`, which tells [`members`] the session's partition
///   count;
/// - an exclusive lock on its join ticket, one more than the highest ticket of the live
///   relays: the order in which they joined, which [`members`] reports as
///   [`Member::joined`].
///
/// Both show in `pg_locks`, which any role may read (unlike another role's
/// `pg_stat_activity` row), so relays running as different roles see each other. The
/// partition locks ([`AdvisoryLock::Partition`]) use the two-key form, another key space. The
/// locks last as long as the session. Returns the ticket.
pub async fn join_members(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partitions: u32,
) -> QueryResult<i64> {
    if partitions == 0 || partitions > MAX_PARTITIONS {
        return Err(diesel::result::Error::QueryBuilderError(
            format!("partition count {partitions} is out of range 1..={MAX_PARTITIONS}").into(),
        ));
    }
    // nobody takes these exclusively, so the shared lock is always granted
    if !AdvisoryLock::PartitionCount(table, partitions)
        .try_lock(conn)
        .await?
    {
        return Err(diesel::result::Error::QueryBuilderError(
            "the relays' partition-count lock was refused: a session holds it exclusively".into(),
        ));
    }
    let name = table.quoted();
    #[derive(QueryableByName)]
    struct Ticket {
        #[diesel(sql_type = BigInt)]
        ticket: i64,
        #[diesel(sql_type = Bool)]
        taken: bool,
    }
    // two relays joining at once may pick the same ticket: the one that gets its lock keeps
    // it, the other picks again
    for _ in 0..1000 {
        let t: Ticket = diesel::sql_query(
            "SELECT t.ticket, pg_try_advisory_lock((t.oid::bigint << 32) | t.ticket) AS taken \
             FROM (SELECT c.oid, COALESCE((SELECT max(l.objid::bigint) FROM pg_locks l \
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.classid = c.oid \
             AND l.objid::bigint < 2147483648 \
             AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())), \
             0) + 1 AS ticket FROM (SELECT to_regclass($1)::oid AS oid) c) t",
        )
        .bind::<Text, _>(&name)
        .get_result(conn)
        .await?;
        if t.ticket >= COUNT_KEY {
            return Err(diesel::result::Error::QueryBuilderError(
                "the relays' join tickets are exhausted (2^31 joins while some relay stayed up); stop every relay of the table once to restart them".into(),
            ));
        }
        if t.taken {
            return Ok(t.ticket);
        }
    }
    Err(diesel::result::Error::QueryBuilderError(
        "could not take a join ticket: other relays kept taking the same ones".into(),
    ))
}

/// Takes this session out of the relays of `table` ([`join_members`] returned its `ticket`):
/// releases its ticket and its partition-count lock, so that [`members`] no longer counts it
/// while its session lives on. A relay that stops leaves before it tells the others that its
/// partitions are free, so that their look at the shares, at once, counts it gone.
pub async fn leave_members(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
    partitions: u32,
    ticket: i64,
) -> QueryResult<()> {
    diesel::sql_query("SELECT pg_advisory_unlock((to_regclass($1)::oid::bigint << 32) | $2)")
        .bind::<Text, _>(table.quoted())
        .bind::<BigInt, _>(ticket)
        .execute(conn)
        .await?;
    AdvisoryLock::PartitionCount(table, partitions)
        .unlock(conn)
        .await
        .map(drop)
}

/// The relays of `table` alive now (see [`join_members`]), in the order they joined.
pub async fn members(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<Vec<Member>> {
    // once a second per relay: prepared once per session
    super::prepared::Prepared {
        pieces: &[
            "SELECT t.pid, (c.objid::bigint - 2147483648)::int AS partitions, \
             t.objid::bigint AS joined, a.backend_start \
             FROM pg_locks t JOIN pg_locks c ON c.pid = t.pid AND c.locktype = 'advisory' \
             AND c.granted AND c.objsubid = 1 AND c.database = t.database \
             AND c.classid = t.classid AND c.objid::bigint >= 2147483648 \
             LEFT JOIN pg_stat_activity a ON a.pid = t.pid \
             WHERE t.locktype = 'advisory' AND t.granted AND t.objsubid = 1 \
             AND t.objid::bigint < 2147483648 \
             AND t.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             AND t.classid = to_regclass(",
            ")::oid ORDER BY t.objid::bigint, t.pid",
        ],
        binds: &[&table.quoted()],
    }
    .load(conn)
    .await
}

/// The channel on which the relays of `table` tell each other that the work moved: an
/// ordered relay joined or released partitions, a log-tailing reader let go of its slot
/// ([`notify_members`]). It is
/// `outbox_relays_<table OID>`, which fits any table name in PostgreSQL's 63-byte channel
/// names. An error when the table does not exist.
pub async fn members_channel(
    conn: &mut AsyncPgConnection,
    table: &OutboxTable,
) -> QueryResult<String> {
    super::stats::channel_of(conn, table, "outbox_relays_").await
}

/// `LISTEN` on `channel` (a [`members_channel`]), for the other relays' [`notify_members`].
pub async fn listen_members(conn: &mut AsyncPgConnection, channel: &str) -> QueryResult<()> {
    super::session::listen_on(conn, channel).await
}

/// `UNLISTEN` on `channel` (a [`members_channel`]): a session that no longer waits for the
/// other relays' word (a log-tailing relay that took its slot).
pub async fn unlisten_members(conn: &mut AsyncPgConnection, channel: &str) -> QueryResult<()> {
    super::session::unlisten_on(conn, channel).await
}

/// Tells the other relays of a table that the shares moved, with `NOTIFY` on its
/// [`members_channel`] (`what` is the payload, e.g. `joined` or `released`), so that they
/// look at the shares at once rather than at their next look: a relay that joins gets its
/// share within moments, and partitions released are taken at once.
///
/// ```no_run
/// use outbox_diesel::OutboxTable;
/// use outbox_diesel::relay::{join_members, listen_members, members_channel, notify_members};
///
/// # async fn run(conn: &mut diesel_async::AsyncPgConnection) -> diesel::QueryResult<()> {
/// let table = OutboxTable::DEFAULT;
/// let channel = members_channel(conn, &table).await?;
/// listen_members(conn, &channel).await?;
/// join_members(conn, &table, 8).await?;
/// notify_members(conn, &channel, "joined").await?;
/// # Ok(()) }
/// ```
pub async fn notify_members(
    conn: &mut AsyncPgConnection,
    channel: &str,
    what: &str,
) -> QueryResult<()> {
    diesel::sql_query("SELECT pg_notify($1, $2)")
        .bind::<Text, _>(channel)
        .bind::<Text, _>(what)
        .execute(conn)
        .await
        .map(drop)
}
