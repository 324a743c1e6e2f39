//! The relays of a table telling each other that the work moved, on its members' channel.

use diesel::pg::PgNotification;
use diesel_async::AsyncPgConnection;
use futures_util::{FutureExt, StreamExt};
use outbox_diesel::relay as db;

/// The other relays of the table as this session hears them: each tells the others with
/// `NOTIFY` on the table's members' channel when it joins or releases partitions (ordered), or
/// lets go of its slot (log tailing), so that the work moves at once rather than at the next
/// look (`standby_interval`, 1 s by default).
pub(crate) struct Peers {
    channel: String,
    /// This session's backend pid: a session hears its own notifications too.
    me: i32,
}

impl Peers {
    /// Listens on `table`'s members' channel.
    pub(crate) async fn listen(
        conn: &mut AsyncPgConnection,
        table: &outbox_diesel::OutboxTable,
        me: i32,
    ) -> diesel::QueryResult<Self> {
        let channel = db::members_channel(conn, table).await?;
        db::listen_members(conn, &channel).await?;
        Ok(Peers { channel, me })
    }

    /// Stops listening and lets go of what was heard: a session that no longer waits for the
    /// others' word does not let it pile up in its connection.
    pub(crate) async fn unlisten(&self, conn: &mut AsyncPgConnection) -> diesel::QueryResult<()> {
        db::unlisten_members(conn, &self.channel).await?;
        self.moved(conn);
        Ok(())
    }

    /// Tells the other relays that the work moved (`what`: joined, released).
    pub(crate) async fn tell(
        &self,
        conn: &mut AsyncPgConnection,
        what: &str,
    ) -> diesel::QueryResult<()> {
        db::notify_members(conn, &self.channel, what).await
    }

    /// Whether `note` is another relay's word that the work moved.
    pub(crate) fn is_peer(&self, note: &PgNotification) -> bool {
        note.channel == self.channel && note.process_id != self.me
    }

    /// Takes the notifications this session has received and not yet taken, without
    /// waiting (writers' too: the read that follows sees what they announce); whether
    /// another relay's is among them.
    pub(crate) fn moved(&self, conn: &mut AsyncPgConnection) -> bool {
        let mut notes = std::pin::pin!(conn.notifications_stream());
        let mut moved = false;
        while let Some(Some(note)) = notes.next().now_or_never() {
            moved |= note.is_ok_and(|n| self.is_peer(&n));
        }
        moved
    }
}
