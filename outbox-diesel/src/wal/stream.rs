//! The streaming reading path: a replication connection of the reader's own
//! (`START_REPLICATION`), transactions received as they commit and handed over in parts
//! within the read's limits, positions confirmed by standby status updates.

use std::future::Future;
use std::task::Poll;

use super::decode::Captured;
use super::error::server_sqlstate;
use super::slot::end_stale_sender;
use super::*;

/// Where and how a streaming reader connects.
#[derive(Clone)]
pub(super) struct StreamConfig {
    pub(super) host: String,
    pub(super) port: u16,
    pub(super) user: String,
    pub(super) password: String,
    pub(super) database: String,
    pub(super) tls: pgwire_replication::TlsConfig,
    pub(super) wait: Duration,
}

/// How long a read takes what comes after its first message: the transactions committed
/// meanwhile are published together (one write to NATS for them, where a transaction at a
/// time cost nats-server about twice the CPU per event under a steady stream), and a read
/// holds none for longer. A read took each message that came within a timer's tick of the
/// one before, with no bound: under a steady stream it went on to its limits, holding its
/// first transactions for tens of milliseconds.
const GATHER: Duration = Duration::from_millis(1);

/// Messages the replication client receives ahead of the reader at most: with the reader's
/// own read (its byte and message limits), what a streaming reader holds. A count, as the
/// client's channel takes: with rows of 900 KB, 256 held 230 MB while the broker did not answer
/// (each transaction of one row is three messages: begin, row, commit); 64 hold at most 58 MB
/// of such rows, and cost no more per event than 256 in a backlog's drain (16 cost about 1 µs
/// of the relay's CPU per event more: a read waits on the client for each message past them).
pub(super) const READ_AHEAD_MESSAGES: usize = 64;

/// A streaming reader's replication connection and what it has received.
pub(super) struct Stream {
    pub(super) client: pgwire_replication::ReplicationClient,
    /// The transaction being received, with its events not handed over yet.
    open: Option<Open>,
    /// The end of the last commit received (of any transaction), or the server's position
    /// from a keepalive between transactions: everything before it was received.
    received_to: Option<Lsn>,
    /// What [`Stream::wait_readable`] received, for the next read to take first.
    ahead: Option<Received>,
}

/// What the replication client's `recv` returns.
type Received = pgwire_replication::Result<Option<pgwire_replication::ReplicationEvent>>;

impl Stream {
    /// See [`WalReader::wait_readable`].
    pub(super) async fn wait_readable(&mut self, until: tokio::time::Instant) -> bool {
        if self.ahead.is_some() {
            return true;
        }
        // `recv` is cancel-safe (a channel's), and what it returned is kept before any
        // other await
        match tokio::time::timeout_at(until, self.client.recv()).await {
            Ok(received) => {
                self.ahead = Some(received);
                true
            }
            Err(_) => false,
        }
    }

    /// The next event: the one received ahead, or one that arrives by `until`; with `until`
    /// past, only one that has arrived (a timer whose deadline has passed fires at the
    /// timer's next tick, up to a millisecond later).
    async fn next_event(&mut self, until: tokio::time::Instant) -> Option<Received> {
        if let Some(received) = self.ahead.take() {
            return Some(received);
        }
        // once the worker has ended, `recv` goes on from the channel's end to the worker's
        // outcome (its error): that is awaited, never polled once and dropped
        if until <= tokio::time::Instant::now() && self.client.is_running() {
            // polled once: `recv` is cancel-safe (a channel's)
            let mut recv = std::pin::pin!(self.client.recv());
            return match std::future::poll_fn(|cx| Poll::Ready(recv.as_mut().poll(cx))).await {
                Poll::Ready(received) => Some(received),
                Poll::Pending => None,
            };
        }
        tokio::time::timeout_at(until, self.client.recv())
            .await
            .ok()
    }
}

/// The password is never shown.
impl fmt::Debug for StreamConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &"***")
            .field("database", &self.database)
            .field("wait", &self.wait)
            .finish()
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("received_to", &self.received_to)
            .field("open", &self.open.as_ref().map(|o| (o.xid, o.rows.len())))
            .finish_non_exhaustive()
    }
}

/// A transaction being received by a streaming reader.
pub(super) struct Open {
    xid: u32,
    commit_lsn: Lsn,
    commit_time: DateTime<Utc>,
    /// Its events received and not handed over yet.
    rows: Vec<Captured>,
    /// Whether a part of it was handed over: its commit is then returned even without rows
    /// left, for its end.
    parted: bool,
    /// Confirmed already (it ends at or before the confirmed position): passed over.
    stale: bool,
}

impl WalReader {
    pub(super) async fn read_stream(
        &mut self,
        conn: &mut AsyncPgConnection,
        cfg: &StreamConfig,
        limit: usize,
        max_bytes: usize,
    ) -> Result<WalBatch, WalError> {
        if self.stream.is_none() {
            self.connect(conn, cfg).await?;
        }
        let Some(mut st) = self.stream.take() else {
            return Ok(WalBatch::default());
        };
        let result = self.receive(&mut st, cfg, limit, max_bytes).await;
        match result {
            Ok((transactions, messages, caught_up)) => {
                // never inside the transaction being received: `received_to` is a commit's
                // end, or a position between transactions
                let caught_up_to = if caught_up && st.open.is_none() {
                    st.received_to
                } else {
                    transactions
                        .iter()
                        .rev()
                        .find_map(|t| t.end_lsn)
                        .or(st.received_to)
                };
                self.stream = Some(st);
                let transactions = self.resolve(conn, transactions).await?;
                Ok(WalBatch {
                    transactions,
                    caught_up_to,
                    messages,
                })
            }
            // the connection is gone: the next read connects again from the confirmed position
            Err(e) => {
                st.client.abort();
                Err(e)
            }
        }
    }

    /// Receives until `limit` messages or `max_bytes` of them, or until nothing more comes
    /// within [`GATHER`] of the first message (waited for up to `cfg.wait`). A limit reached
    /// inside a transaction hands over its events received so far as a part; the rest follows
    /// on later reads. Returns the transactions (and parts) with events, the messages
    /// received, and whether it stopped for want of more.
    pub(super) async fn receive(
        &mut self,
        st: &mut Stream,
        cfg: &StreamConfig,
        limit: usize,
        max_bytes: usize,
    ) -> Result<(Vec<Read>, usize, bool), WalError> {
        use pgwire_replication::ReplicationEvent as Event;
        let deadline = tokio::time::Instant::now() + cfg.wait;
        let mut transactions = Vec::new();
        let mut messages = 0usize;
        let mut bytes = 0usize;
        let mut gather_until = None;
        loop {
            if messages >= limit || bytes >= max_bytes {
                if let Some(open) = st.open.as_mut()
                    && !open.rows.is_empty()
                {
                    open.parted = true;
                    transactions.push(Read {
                        xid: open.xid,
                        commit_lsn: open.commit_lsn,
                        end_lsn: None,
                        commit_time: open.commit_time,
                        captured: std::mem::take(&mut open.rows),
                    });
                }
                return Ok((transactions, messages, false));
            }
            // wait for the first message; then take what comes within `GATHER` of it (a
            // transaction being received is finished on a later read if it is not all here)
            let until = if messages == 0 {
                deadline
            } else {
                *gather_until.get_or_insert_with(|| tokio::time::Instant::now() + GATHER)
            };
            let event = match st.next_event(until).await {
                None => return Ok((transactions, messages, true)),
                Some(Ok(Some(e))) => e,
                Some(Ok(None)) => {
                    return Err(self.stream_error("the server ended the replication stream"));
                }
                Some(Err(e)) => return Err(self.stream_error(e)),
            };
            match event {
                Event::Begin {
                    xid,
                    final_lsn,
                    commit_time_micros,
                } => {
                    messages += 1;
                    let commit_lsn = Lsn(final_lsn.0);
                    st.open = Some(Open {
                        xid,
                        commit_lsn,
                        // the protocol's own Begin: PostgreSQL's epoch, not decoded by `pgoutput`
                        commit_time: pgoutput::pg_time(commit_time_micros),
                        rows: Vec::new(),
                        parted: false,
                        stale: confirms(self.acked, commit_lsn),
                    });
                }
                Event::XLogData { data, .. } => {
                    messages += 1;
                    bytes += data.len();
                    let message = pgoutput::decode(&data)?;
                    let rows = st.open.as_mut().filter(|o| !o.stale).map(|o| &mut o.rows);
                    self.capture(message, rows)?;
                }
                Event::Commit { end_lsn, .. } => {
                    messages += 1;
                    let end = Lsn(end_lsn.0);
                    st.received_to = st.received_to.max(Some(end));
                    // Begin carried the commit time already
                    if let Some(open) = st.open.take()
                        && (!open.rows.is_empty() || open.parted)
                        && !open.stale
                        && end > self.acked
                    {
                        transactions.push(Read {
                            xid: open.xid,
                            commit_lsn: open.commit_lsn,
                            end_lsn: Some(end),
                            commit_time: open.commit_time,
                            captured: open.rows,
                        });
                    }
                }
                Event::KeepAlive { wal_end, .. } => {
                    if st.open.is_none() {
                        st.received_to = st.received_to.max(Some(Lsn(wal_end.0)));
                    }
                }
                Event::Message { .. } | Event::StoppedAt { .. } => {}
            }
        }
    }

    pub(super) fn stream_error(&self, reason: impl fmt::Display) -> WalError {
        WalError::Stream {
            slot: self.slot.clone(),
            reason: reason.to_string(),
        }
    }

    /// Opens the replication connection at the confirmed position. A replication connection
    /// still holding the slot after its relay lost the slot's lock (a paused or cut-off
    /// reader, whose sender lingers until `wal_sender_timeout`) is ended first: the caller
    /// holds the lock now.
    pub(super) async fn connect(
        &mut self,
        conn: &mut AsyncPgConnection,
        cfg: &StreamConfig,
    ) -> Result<(), WalError> {
        let confirmed = self.confirmed(conn).await?.unwrap_or_default();
        self.acked = self.acked.max(confirmed);
        let mut tries = 0;
        loop {
            let config = self.replication_config(cfg);
            let started = async {
                crate::ensure_crypto_provider();
                let mut client = pgwire_replication::ReplicationClient::connect(config).await?;
                client.wait_started().await?;
                Ok::<_, pgwire_replication::PgWireError>(client)
            };
            match started.await {
                Ok(client) => {
                    self.relations.clear();
                    self.stream = Some(Stream {
                        client,
                        open: None,
                        received_to: None,
                        ahead: None,
                    });
                    tracing::debug!(slot = %self.slot, lsn = %self.acked, "replication stream started");
                    return Ok(());
                }
                // object_in_use: the slot's previous sender has not ended yet
                Err(e) if server_sqlstate(&e) == Some("55006") && tries < 50 => {
                    tries += 1;
                    end_stale_sender(conn, &self.slot).await?;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(self.connection_error(e)),
            }
        }
    }

    pub(super) fn replication_config(
        &self,
        cfg: &StreamConfig,
    ) -> pgwire_replication::ReplicationConfig {
        pgwire_replication::ReplicationConfig::new(
            cfg.host.clone(),
            cfg.user.clone(),
            cfg.password.clone(),
            cfg.database.clone(),
            self.slot.clone(),
            // `publication_names` is a list of identifiers: quoted, a name keeps its case and
            // may hold any character
            quote_ident(&self.publication),
        )
        .with_port(cfg.port)
        .with_tls(cfg.tls.clone())
        .with_start_lsn(pgwire_replication::Lsn(self.acked.0))
        .with_ack_lsn(pgwire_replication::Lsn(self.acked.0))
        .with_status_interval(Duration::from_secs(1))
        .with_buffer_size(READ_AHEAD_MESSAGES)
        .with_options("-c TimeZone=UTC -c DateStyle=ISO,YMD")
        .with_application_name("outbox-relay")
    }

    pub(super) fn connection_error(&self, e: pgwire_replication::PgWireError) -> WalError {
        let reason = e.to_string();
        // insufficient_privilege (no REPLICATION) or an invalid authorization (pg_hba.conf,
        // credentials): retrying cannot fix them. Decided on the code, which does not change
        // with the server's lc_messages.
        let refused = matches!(e, pgwire_replication::PgWireError::Auth(_))
            || matches!(server_sqlstate(&e), Some(code) if code == "42501" || code.starts_with("28"));
        if refused {
            WalError::ReplicationConnection {
                slot: self.slot.clone(),
                reason,
            }
        } else {
            self.stream_error(reason)
        }
    }

    /// Checks that a streaming reader may open its replication connection (the role's
    /// `REPLICATION` attribute, `pg_hba.conf`, a free sender), without touching the slot: a
    /// start-up check, so that what retrying cannot fix is a clear error at once. Does nothing
    /// for a reader that reads with SQL.
    pub async fn check_replication(&self) -> Result<(), WalError> {
        let Some(cfg) = &self.streaming else {
            return Ok(());
        };
        crate::ensure_crypto_provider();
        let mut client =
            pgwire_replication::ReplicationClient::connect_gated(self.replication_config(cfg))
                .await
                .map_err(|e| self.connection_error(e))?;
        let identified = client.identify_system().await;
        client.abort();
        identified.map(drop).map_err(|e| self.connection_error(e))
    }
}
