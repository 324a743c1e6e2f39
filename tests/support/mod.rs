//! Test support: a database and a stream per test, private servers, process guards.
//!
//! Every test gets its own database (`outbox_t_<uuid>`, dropped after) and its own stream and
//! subject prefix (deleted after), so tests run in parallel without seeing each other.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use diesel::prelude::*;
use futures_util::StreamExt;

pub mod checker;
pub mod events;
pub mod proxy;
pub mod servers;
pub mod slot;
pub mod statements;
pub mod task;

/// The PostgreSQL server the tests use: `OUTBOX_TEST_PG` or the machine's on 127.0.0.1:5432.
pub fn pg_base() -> String {
    std::env::var("OUTBOX_TEST_PG").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

/// The NATS server the tests use: `OUTBOX_TEST_NATS` or the machine's on 127.0.0.1:4222.
pub fn nats_url() -> String {
    std::env::var("OUTBOX_TEST_NATS").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A client of the server, or of the first reachable server of a comma-separated seed list.
pub async fn nats_connect(url: &str) -> Result<async_nats::Client, async_nats::ConnectError> {
    let seeds: Vec<async_nats::ServerAddr> = url
        .split(',')
        .filter_map(|u| u.trim().parse().ok())
        .collect();
    async_nats::connect(seeds).await
}

fn unique(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::now_v7().simple())
}

/// A database of its own, with the outbox migrated in; dropped on `Drop`.
pub struct TestDb {
    pub name: String,
    pub url: String,
    admin_url: String,
}

impl TestDb {
    pub fn new() -> Self {
        Self::on(&pg_base())
    }

    /// A database on the server at `base` (`postgres://user@host:port`).
    pub fn on(base: &str) -> Self {
        let db = Self::empty_on(base);
        let mut conn = db.conn();
        outbox_diesel::run_migrations(&mut conn).expect("migrate the outbox");
        db
    }

    /// A database of its own with nothing in it: no outbox, no migration run.
    #[allow(dead_code)]
    pub fn empty() -> Self {
        Self::empty_on(&pg_base())
    }

    fn empty_on(base: &str) -> Self {
        let name = unique("outbox_t_");
        let admin_url = format!("{base}/postgres");
        let mut admin = PgConnection::establish(&admin_url)
            .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {admin_url}: {e}"));
        diesel::sql_query(format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .expect("create the test database");
        let url = format!("{base}/{name}");
        TestDb {
            name,
            url,
            admin_url,
        }
    }

    /// The URL of the server's `postgres` database.
    pub fn admin_url(&self) -> &str {
        &self.admin_url
    }

    pub fn conn(&self) -> PgConnection {
        PgConnection::establish(&self.url).expect("connect to the test database")
    }

    pub async fn async_conn(&self) -> diesel_async::AsyncPgConnection {
        use diesel_async::AsyncConnection;
        diesel_async::AsyncPgConnection::establish(&self.url)
            .await
            .expect("connect (async)")
    }

    /// Runs `sql` on a connection of its own; panics with `what` when it fails.
    pub fn execute(&self, sql: &str, what: &str) {
        diesel::sql_query(sql)
            .execute(&mut self.conn())
            .expect(what);
    }

    /// An async connection prepared as a relay's session prepares it (for its plans).
    pub async fn relay_session(&self) -> diesel_async::AsyncPgConnection {
        let mut conn = self.async_conn().await;
        outbox_diesel::relay::prepare_session(&mut conn)
            .await
            .expect("prepare the session");
        conn
    }

    /// Runs `sql` and returns the first column of the first row as i64.
    pub fn scalar(&self, sql: &str) -> i64 {
        #[derive(QueryableByName)]
        struct V {
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            v: i64,
        }
        let r: V = diesel::sql_query(format!("SELECT ({sql})::bigint AS v"))
            .get_result(&mut self.conn())
            .expect(sql);
        r.v
    }

    /// Runs `sql`, whose one column is text, and returns its rows; none when it fails (a
    /// table that does not exist), for a failure's report.
    pub fn strings(&self, sql: &str) -> Vec<String> {
        #[derive(QueryableByName)]
        struct V {
            #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
            v: Option<String>,
        }
        diesel::sql_query(format!("SELECT q.v::text AS v FROM ({sql}) AS q(v)"))
            .load::<V>(&mut self.conn())
            .map(|rows| rows.into_iter().filter_map(|r| r.v).collect())
            .unwrap_or_default()
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Ok(mut admin) = PgConnection::establish(&self.admin_url) {
            let _ = diesel::sql_query(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .execute(&mut admin);
        }
    }
}

/// A stream name and subject prefix of its own; the stream is deleted on `Drop`.
pub struct TestStream {
    pub name: String,
    pub prefix: String,
    pub nats_url: String,
}

impl TestStream {
    pub fn new() -> Self {
        Self::on(&nats_url())
    }

    pub fn on(url: &str) -> Self {
        let id = uuid::Uuid::now_v7().simple().to_string();
        TestStream {
            name: format!("T_{id}"),
            prefix: format!("t{id}"),
            nats_url: url.to_owned(),
        }
    }

    /// The stream's configuration: its name and subjects, JetStream's defaults for the rest.
    pub fn config(&self) -> jetstream::stream::Config {
        jetstream::stream::Config {
            name: self.name.clone(),
            subjects: vec![format!("{}.>", self.prefix)],
            ..Default::default()
        }
    }

    pub async fn js(&self) -> jetstream::Context {
        let client = nats_connect(&self.nats_url).await.expect("connect to NATS");
        jetstream::new(client)
    }

    /// Every message in the stream, in stream order.
    pub async fn read_all(&self) -> Vec<Received> {
        read_stream(&self.js().await, &self.name).await
    }

    /// Messages in the stream (0 when it does not exist).
    pub async fn count(&self) -> u64 {
        let js = self.js().await;
        match js.get_stream(&self.name).await {
            Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0),
            Err(_) => 0,
        }
    }
}

impl Drop for TestStream {
    fn drop(&mut self) {
        let (url, name) = (self.nats_url.clone(), self.name.clone());
        // Drop may run inside a runtime: delete from a thread of its own
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(rt) = rt {
                rt.block_on(async {
                    let delete = async {
                        if let Ok(c) = nats_connect(&url).await {
                            let _ = jetstream::new(c).delete_stream(&name).await;
                        }
                    };
                    let _ = tokio::time::timeout(Duration::from_secs(5), delete).await;
                });
            }
        })
        .join();
    }
}

/// A message read back from a stream.
#[derive(Debug, Clone)]
pub struct Received {
    pub stream_seq: u64,
    pub subject: String,
    pub msg_id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub headers: async_nats::HeaderMap,
    pub payload: serde_json::Value,
}

/// Every message of `stream` as JetStream stored it, in stream order (an ordered consumer
/// from the first message); empty when the stream does not exist.
pub async fn read_raw(js: &jetstream::Context, stream: &str) -> Vec<jetstream::Message> {
    let Ok(mut s) = js.get_stream(stream).await else {
        return Vec::new();
    };
    let total = s.info().await.expect("stream info").state.messages;
    if total == 0 {
        return Vec::new();
    }
    let consumer = s
        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
        .await
        .expect("ordered consumer");
    let mut messages = consumer.messages().await.expect("consume");
    let mut out = Vec::with_capacity(total as usize);
    while (out.len() as u64) < total {
        let next = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "reading the stream timed out after {} of {total}",
                    out.len()
                )
            })
            .expect("stream ended")
            .expect("message");
        out.push(next);
    }
    out
}

pub async fn read_stream(js: &jetstream::Context, stream: &str) -> Vec<Received> {
    read_raw(js, stream)
        .await
        .into_iter()
        .map(|next| {
            let h = next.headers.clone().unwrap_or_default();
            let get = |k: &str| h.get(k).map(|v| v.as_str().to_owned()).unwrap_or_default();
            let info = next.info().expect("jetstream message info");
            Received {
                stream_seq: info.stream_sequence,
                subject: next.subject.to_string(),
                msg_id: get("Nats-Msg-Id"),
                aggregate_type: get("Outbox-Aggregate-Type"),
                aggregate_id: get("Outbox-Aggregate-Id"),
                event_type: get("Outbox-Event-Type"),
                payload: serde_json::from_slice(&next.payload).unwrap_or(serde_json::Value::Null),
                headers: h.clone(),
            }
        })
        .collect()
}

/// Polls `f` every 50 ms until it returns true; panics with `what` after `timeout`.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits up to `timeout` until `n` rows of `db`'s outbox are marked published.
pub async fn wait_published(db: &TestDb, n: i64, timeout: Duration) {
    wait_until(timeout, &format!("{n} rows published"), || async {
        db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NOT NULL") >= n
    })
    .await;
}

/// Message ids per aggregate, in stream order.
pub fn by_aggregate(msgs: &[Received]) -> HashMap<String, Vec<String>> {
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    for m in msgs {
        out.entry(m.aggregate_id.clone())
            .or_default()
            .push(m.msg_id.clone());
    }
    out
}

/// The directory cargo puts binaries in (`target/debug`), found from this test's own path.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/debug/deps/<test> -> target/debug
    exe.parent()
        .and_then(|p| p.parent())
        .expect("target dir")
        .to_path_buf()
}

/// The `outbox-relay` binary; `cargo test --workspace` builds it.
pub fn relay_bin() -> PathBuf {
    let p = target_dir().join("outbox-relay");
    assert!(
        p.exists(),
        "{} is missing: build it first with `cargo build --workspace --bins --examples`",
        p.display()
    );
    p
}

/// An example binary (`target/debug/examples/NAME`).
pub fn example_bin(name: &str) -> PathBuf {
    let p = target_dir().join("examples").join(name);
    assert!(
        p.exists(),
        "{} is missing: build it first with `cargo build --workspace --bins --examples`",
        p.display()
    );
    p
}

/// Reads `pipe` to its end on a thread of its own (so that a child filling one pipe cannot
/// block while another is read); join the thread for the text.
pub fn read_in_background(
    mut pipe: impl std::io::Read + Send + 'static,
) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = pipe.read_to_string(&mut s);
        s
    })
}

/// A child process killed (SIGKILL) and reaped on `Drop`.
pub struct Proc {
    pub child: Child,
    pub name: String,
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command) -> Self {
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc {
            child,
            name: name.to_owned(),
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Its `/proc/<pid>/status`; empty once it has exited.
    fn status(&self) -> String {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default()
    }

    /// Its peak resident memory so far (`VmHWM` of `/proc/<pid>/status`), in bytes; 0 once it
    /// has exited.
    pub fn peak_rss(&self) -> u64 {
        self.status()
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }

    /// What its memory is made of now (`/proc/<pid>/status`: resident, anonymous, file-backed,
    /// threads), for a failed bound on [`Proc::peak_rss`] to show.
    pub fn memory(&self) -> String {
        self.status()
            .lines()
            .filter(|l| {
                ["VmHWM:", "VmRSS:", "RssAnon:", "RssFile:", "Threads:"]
                    .iter()
                    .any(|k| l.starts_with(k))
            })
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status();
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits up to `timeout` for it to exit; its exit code, or `None` when it did not.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status.code().unwrap_or(-1));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `outbox-relay run` against `db` and `stream`, with fast test timings and extra `args`
/// (and `--fence` when `OUTBOX_TEST_FENCE` is set).
pub fn relay_command(db: &TestDb, stream: &TestStream, args: &[&str]) -> Command {
    let mut cmd = Command::new(relay_bin());
    cmd.arg("run")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env(
            "RUST_LOG",
            std::env::var("OUTBOX_TEST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .env("DATABASE_URL", &db.url)
        .env("NATS_URL", &stream.nats_url)
        .args(["--stream", &stream.name, "--subject-prefix", &stream.prefix])
        .args(["--poll-interval", "50ms", "--startup-timeout", "20s"])
        .args(args);
    if std::env::var_os("OUTBOX_TEST_FENCE").is_some() {
        // the whole suite with the fence on
        cmd.env("OUTBOX_FENCE", "true");
    }
    cmd
}

/// A relay process with its stderr in a temporary file, read back with [`Relay::logs`];
/// killed and its log removed on `Drop`.
pub struct Relay {
    pub proc: Proc,
    log: PathBuf,
}

impl Relay {
    pub fn start(mut cmd: Command) -> Self {
        let log = std::env::temp_dir().join(format!(
            "outbox-relay-{}.log",
            uuid::Uuid::now_v7().simple()
        ));
        let file = std::fs::File::create(&log).expect("relay log file");
        cmd.stdout(Stdio::null()).stderr(Stdio::from(file));
        Relay {
            proc: Proc::spawn("outbox-relay", &mut cmd),
            log,
        }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.proc.kill();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A relay process (see [`relay_command`]) with its admin listener (`/metrics`, `/healthz`,
/// `/readyz`) on a free port of its own, and extra `args`: the relay and the listener's address.
pub fn relay_with_metrics(db: &TestDb, stream: &TestStream, args: &[&str]) -> (Relay, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut all = vec!["--metrics-addr", addr.as_str()];
    all.extend_from_slice(args);
    let relay = Relay::start(relay_command(db, stream, &all));
    (relay, addr)
}

/// `GET path` over HTTP/1.0 from `addr`: the status code and the body.
pub async fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fetch = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, body) = text.split_once("\r\n\r\n")?;
        let code = head.split_whitespace().nth(1)?.parse().ok()?;
        Some((code, body.to_owned()))
    };
    tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .ok()
        .flatten()
}

/// A free TCP port on 127.0.0.1, for a server a test starts.
///
/// Taken below Linux's ephemeral range (32768–60999), from which the OS picks the local port
/// of every outgoing connection: a port asked of the OS (`bind` to port 0) comes from that
/// range, and between the test freeing it and the server binding it, a client connection of
/// another test (to PostgreSQL, to NATS) could take it as its own, so the server would not
/// start. Ports are handed out in turn from a start that differs per process, each checked
/// free by binding it.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        (std::process::id().wrapping_mul(7919)) % SPAN,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let port = (LOW + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOW}..{}", LOW + SPAN)
}

/// The partition owners of the outbox in `db`: (partition, backend pid), from the relays'
/// advisory locks.
pub fn partition_owners(db: &TestDb) -> Vec<(i32, i32)> {
    #[derive(QueryableByName)]
    struct O {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        partition: i32,
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
    }
    let rows: Vec<O> = diesel::sql_query(
        "SELECT l.objid::int AS partition, l.pid FROM pg_locks l WHERE l.locktype = 'advisory' \
         AND l.granted AND l.objsubid = 2 AND l.classid = 'outbox'::regclass::oid \
         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .load(&mut db.conn())
    .expect("partition owners");
    rows.into_iter().map(|o| (o.partition, o.pid)).collect()
}

/// How many partitions of the outbox in `db` each relay session owns, by its backend pid.
pub fn partitions_per_owner(db: &TestDb) -> std::collections::HashMap<i32, usize> {
    let mut per_pid = std::collections::HashMap::new();
    for (_, pid) in partition_owners(db) {
        *per_pid.entry(pid).or_default() += 1;
    }
    per_pid
}
