//! Production connectivity: NATS seed lists and clusters, TLS to NATS and to PostgreSQL,
//! against private servers that each test starts and stops.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use diesel::prelude::*;
use diesel_async::AsyncPgConnection;
use outbox_diesel::{OutboxEvent, OutboxExt};
use outbox_nats::NatsOptions;
use outbox_nats::consumer::{Consumer, ConsumerConfig, Delivery};
use serde::{Deserialize, Serialize};
use std::process::Command;

use support::servers::{NatsCluster, NatsServer, PgCluster, TestCerts};
use support::{Proc, TestDb, TestStream, relay_command, wait_until};
use tokio_util::sync::CancellationToken;

const TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "order", event_type = "order.placed")]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    order_id: i64,
}

/// Records `n` events, one transaction each, order ids `from..from + n`.
fn record(db: &TestDb, from: i64, n: i64) {
    let mut conn = db.conn();
    for order_id in from..from + n {
        conn.transaction(|c| c.record_event(&OrderPlaced { order_id }))
            .expect("record");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_connect_through_a_seed_list_whose_first_seed_is_down() {
    let mut cluster = NatsCluster::start();
    let seeds = cluster.urls();
    let stream = TestStream::on(&seeds);
    // the stream exists on all three nodes before the first goes down: one made afterwards
    // can be placed on the dead node while the meta leader still counts it as up, and would
    // never answer; what this test checks is the seed list, not JetStream's placement
    let js = stream.js().await;
    js.create_stream(async_nats::jetstream::stream::Config {
        num_replicas: 3,
        ..stream.config()
    })
    .await
    .expect("a stream replicated on the three nodes");
    drop(js);
    cluster.kill(0);
    // when the first node was JetStream's meta leader, the other two elect one (seconds)
    cluster.wait_ready();
    let (db, consumer_db) = (TestDb::new(), TestDb::new());
    record(&db, 0, 20);

    let _relay = Proc::spawn("outbox-relay", &mut relay_command(&db, &stream, &[]));
    wait_until(TIMEOUT, "20 events in the stream", || async {
        stream.count().await == 20
    })
    .await;

    let nats = NatsOptions::new(seeds.clone())
        .connect()
        .await
        .expect("the consumer connects through the seed list");
    let handled = Arc::new(AtomicUsize::new(0));
    let counted = handled.clone();
    let config = ConsumerConfig::new("seeds", consumer_db.url.clone())
        .stream(stream.name.clone())
        .filter_subject(format!("{}.>", stream.prefix))
        .fetch_wait(Duration::from_millis(200));
    let shutdown = CancellationToken::new();
    let consumer = tokio::spawn(Consumer::new(config, nats).run(
        shutdown.clone(),
        async move |_conn: &mut AsyncPgConnection, _msg: Delivery<OrderPlaced>| {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok::<(), diesel::result::Error>(())
        },
    ));
    wait_until(TIMEOUT, "the consumer handled 20 events", || async {
        handled.load(Ordering::SeqCst) == 20
    })
    .await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), consumer)
        .await
        .expect("the consumer stops")
        .expect("consumer task")
        .expect("consumer result");
}

#[test]
fn relay_refuses_a_seed_list_with_a_bad_url_at_once() {
    let (db, stream) = (
        TestDb::new(),
        TestStream::on("nats://127.0.0.1:4222,nats://b:notaport"),
    );
    let mut relay = Proc::spawn(
        "outbox-relay",
        relay_command(&db, &stream, &[]).stderr(std::process::Stdio::piped()),
    );
    let code = relay.wait_exit(Duration::from_secs(10));
    assert_eq!(code, Some(2), "exits at once with a configuration error");
    let mut err = String::new();
    use std::io::Read;
    relay
        .child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("read stderr");
    assert!(
        err.contains("nats://b:notaport") && err.contains("comma-separated"),
        "names the bad seed and the form: {err}"
    );
}

/// A relay of `mode` over `url` until the stream holds the events recorded after it started.
async fn relays_over(db: &TestDb, url: &str, mode: &str) {
    let stream = TestStream::new();
    let slot = format!("tls_{}", uuid::Uuid::now_v7().simple());
    let mut args = vec!["--mode", mode];
    if mode == "log-tailing" {
        args.extend(["--slot", &slot]);
    }
    let mut cmd = relay_command(db, &stream, &args);
    cmd.env("DATABASE_URL", url);
    let _relay = Proc::spawn("outbox-relay", &mut cmd);
    if mode == "log-tailing" {
        wait_until(TIMEOUT, "the relay reading its slot", || async {
            db.scalar(&format!(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{slot}' AND active"
            )) == 1
        })
        .await;
    }
    let before = stream.count().await;
    record(db, 0, 10);
    wait_until(
        TIMEOUT,
        &format!("10 events relayed over TLS ({mode})"),
        || async { stream.count().await == before + 10 },
    )
    .await;
}

/// `outbox-relay` run against `url` with a short start-up timeout: its exit code and stderr.
fn relay_refused(url: &str) -> (Option<i32>, String) {
    relay_refused_with(url, &support::nats_url(), &[])
}

/// `outbox-relay` run against `db_url` and `nats_url` with a short start-up timeout and
/// `args`: its exit code and stderr.
fn relay_refused_with(db_url: &str, nats_url: &str, args: &[&str]) -> (Option<i32>, String) {
    let stream = TestStream::on(nats_url);
    let out = Command::new(support::relay_bin())
        .arg("run")
        .env_clear()
        .env("RUST_LOG", "error")
        .env("DATABASE_URL", db_url)
        .env("NATS_URL", nats_url)
        .args(["--stream", &stream.name, "--subject-prefix", &stream.prefix])
        .args(["--startup-timeout", "2s"])
        .args(args)
        .output()
        .expect("run outbox-relay");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_relay_mode_relays_over_tls_verified_against_the_test_ca() {
    let certs = TestCerts::make();
    let cluster = PgCluster::start_tls(&certs);
    for mode in ["ordered", "unordered", "log-tailing"] {
        let db = TestDb::on(&cluster.base_url());
        let url = format!(
            "postgres://postgres@localhost:{}/{}?sslmode=verify-full&sslrootcert={}",
            cluster.port,
            db.name,
            certs.ca.display()
        );
        relays_over(&db, &url, mode).await;
        // the key=value form, and the operating commands
        let kv = format!(
            "host=localhost port={} user=postgres dbname={} sslmode=verify-ca sslrootcert='{}'",
            cluster.port,
            db.name,
            certs.ca.display()
        );
        let status = Command::new(support::relay_bin())
            .env_clear()
            .env("DATABASE_URL", &kv)
            .args(["status", "--json"])
            .output()
            .expect("run outbox-relay status");
        assert!(
            status.status.success(),
            "status over TLS: {}",
            String::from_utf8_lossy(&status.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificate_authenticates_the_relay() {
    let certs = TestCerts::make();
    let cluster = PgCluster::start_tls(&certs);
    let db = TestDb::on(&cluster.base_url());
    db.execute("CREATE ROLE tlsclient LOGIN SUPERUSER", "create the role");
    let url = format!(
        "postgres://tlsclient@localhost:{}/{}?sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
        cluster.port,
        db.name,
        certs.ca.display(),
        certs.client_cert.display(),
        certs.client_key.display()
    );
    relays_over(&db, &url, "ordered").await;
    let without = format!(
        "postgres://tlsclient@localhost:{}/{}?sslmode=verify-full&sslrootcert={}",
        cluster.port,
        db.name,
        certs.ca.display()
    );
    let (code, err) = relay_refused(&without);
    assert_ne!(code, Some(0), "no client certificate, no connection");
    assert!(err.contains("certificate"), "says why: {err}");
}

#[test]
fn verify_full_refuses_a_server_certificate_for_another_host_name() {
    let certs = TestCerts::make();
    let cluster = PgCluster::start_tls(&certs);
    let db = TestDb::on(&cluster.base_url());
    // the certificate names localhost, not 127.0.0.1
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/{}?sslmode=verify-full&sslrootcert={}",
        cluster.port,
        db.name,
        certs.ca.display()
    );
    let (code, err) = relay_refused(&url);
    assert!(matches!(code, Some(c) if c != 0), "refused: {err}");
    assert!(
        err.contains("not valid for name") && err.contains("sslrootcert"),
        "names the mismatch and what to check: {err}"
    );
    // another CA than the server's
    let other = TestCerts::make();
    let url = format!(
        "postgres://postgres@localhost:{}/{}?sslmode=verify-ca&sslrootcert={}",
        cluster.port,
        db.name,
        other.ca.display()
    );
    let (code, err) = relay_refused(&url);
    assert!(matches!(code, Some(c) if c != 0), "refused: {err}");
    assert!(
        err.contains("invalid peer certificate"),
        "says the certificate is not the CA's: {err}"
    );
}

#[test]
fn tls_only_server_refuses_plaintext() {
    let certs = TestCerts::make();
    let cluster = PgCluster::start_tls(&certs);
    let db = TestDb::on(&cluster.base_url());
    let url = format!(
        "postgres://postgres@localhost:{}/{}?sslmode=disable",
        cluster.port, db.name
    );
    let (code, err) = relay_refused(&url);
    assert!(matches!(code, Some(c) if c != 0), "refused: {err}");
    assert!(
        err.contains("no encryption") && err.contains("sslmode"),
        "says that the server wants TLS: {err}"
    );
}

/// A client of a TLS-only server, trusting the test CA, with the client certificate.
async fn tls_client(server: &NatsServer, certs: &TestCerts) -> async_nats::Client {
    outbox_diesel::ensure_crypto_provider();
    async_nats::ConnectOptions::new()
        .require_tls(true)
        .add_root_certificates(certs.ca.clone())
        .add_client_certificate(certs.client_cert.clone(), certs.client_key.clone())
        .connect(format!("tls://localhost:{}", server.port))
        .await
        .expect("a TLS client")
}

async fn stream_count(client: &async_nats::Client, stream: &str) -> u64 {
    let js = async_nats::jetstream::new(client.clone());
    match js.get_stream(stream).await {
        Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0),
        Err(_) => 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_publishes_over_tls_and_mutual_tls_to_nats() {
    let certs = TestCerts::make();
    for verify in [false, true] {
        let server = NatsServer::start_tls(&certs, verify);
        let db = TestDb::new();
        let stream = TestStream::on(&format!("tls://localhost:{}", server.port));
        let ca = certs.ca.display().to_string();
        let (cert, key) = (
            certs.client_cert.display().to_string(),
            certs.client_key.display().to_string(),
        );
        let mut args = vec!["--nats-tls-required", "--nats-tls-ca", &ca];
        if verify {
            args.extend(["--nats-tls-cert", &cert, "--nats-tls-key", &key]);
        }
        record(&db, 0, 10);
        let _relay = Proc::spawn("outbox-relay", &mut relay_command(&db, &stream, &args));
        let client = tls_client(&server, &certs).await;
        wait_until(TIMEOUT, "10 events relayed over TLS", || async {
            stream_count(&client, &stream.name).await == 10
        })
        .await;
    }
}

#[test]
fn nats_requiring_client_certificates_refuses_a_relay_without_one() {
    let certs = TestCerts::make();
    let server = NatsServer::start_tls(&certs, true);
    let db = TestDb::new();
    let ca = certs.ca.display().to_string();
    let nats = format!("tls://localhost:{}", server.port);
    let (code, err) = relay_refused_with(
        &db.url,
        &nats,
        &["--nats-tls-required", "--nats-tls-ca", &ca],
    );
    assert!(matches!(code, Some(c) if c != 0), "refused: {err}");
    assert!(err.contains("cannot connect to NATS"), "says so: {err}");
    // and a CA that did not sign the server's certificate
    let other = TestCerts::make();
    let ca = other.ca.display().to_string();
    let (cert, key) = (
        certs.client_cert.display().to_string(),
        certs.client_key.display().to_string(),
    );
    let (code, err) = relay_refused_with(
        &db.url,
        &nats,
        &[
            "--nats-tls-required",
            "--nats-tls-ca",
            &ca,
            "--nats-tls-cert",
            &cert,
            "--nats-tls-key",
            &key,
        ],
    );
    assert!(matches!(code, Some(c) if c != 0), "refused: {err}");
}

#[derive(Debug, Clone, Serialize, Deserialize, OutboxEvent)]
#[outbox(aggregate_type = "tick", event_type = "tick")]
struct Tick {
    #[outbox(aggregate_id)]
    agg: String,
    n: i64,
}

/// Commits one event every few milliseconds (aggregates `a0`..`a4`, `n` counting up) until
/// stopped; returns how many committed.
struct Writer {
    stop: Arc<std::sync::atomic::AtomicBool>,
    done: Option<std::thread::JoinHandle<i64>>,
}

impl Writer {
    fn start(db: &TestDb) -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let mut conn = db.conn();
        let done = std::thread::spawn(move || {
            let mut n = 0;
            while !flag.load(Ordering::SeqCst) {
                let e = Tick {
                    agg: format!("a{}", n % 5),
                    n,
                };
                conn.transaction(|c| c.record_event(&e)).expect("record");
                n += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            n
        });
        Writer {
            stop,
            done: Some(done),
        }
    }

    fn stop(mut self) -> i64 {
        self.stop.store(true, Ordering::SeqCst);
        self.done
            .take()
            .expect("running")
            .join()
            .expect("writer thread")
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Kills the stream's leader (SIGKILL), measures how long until the stream grows again, and
/// starts the node again.
async fn kill_the_leader(cluster: &mut NatsCluster, stream: &TestStream) -> Duration {
    let start = std::time::Instant::now();
    let leader = loop {
        if let Some(l) = cluster.stream_leader(&stream.name).await {
            break l;
        }
        assert!(start.elapsed() < TIMEOUT, "the stream has no leader");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let i = cluster
        .index_of(&leader)
        .expect("the leader is a node of the cluster");
    let before = stream_last_seq(cluster, stream).await;
    let killed = std::time::Instant::now();
    cluster.kill(i);
    wait_until(TIMEOUT, "the relay publishing again", || async {
        stream_last_seq(cluster, stream).await > before
    })
    .await;
    let resumed = killed.elapsed();
    cluster.restart(i);
    resumed
}

async fn stream_last_seq(cluster: &NatsCluster, stream: &TestStream) -> u64 {
    let urls: Vec<String> = (0..3).map(|i| cluster.url(i)).collect();
    let Ok(Ok(client)) = tokio::time::timeout(
        Duration::from_secs(2),
        support::nats_connect(&urls.join(",")),
    )
    .await
    else {
        return 0;
    };
    let js = async_nats::jetstream::new(client);
    let info = async {
        let mut s = js.get_stream(&stream.name).await.ok()?;
        s.info().await.ok().map(|i| i.state.last_sequence)
    };
    tokio::time::timeout(Duration::from_secs(2), info)
        .await
        .ok()
        .flatten()
        .unwrap_or(0)
}

/// Every committed event in the stream once (ids distinct, `committed` of them), and, where
/// the mode promises it, each aggregate's events in commit order.
async fn check_stream(stream: &TestStream, committed: i64, ordered: bool) {
    wait_until(TIMEOUT, &format!("{committed} distinct events"), || async {
        let msgs = stream.read_all().await;
        let ids: std::collections::HashSet<_> = msgs.iter().map(|m| m.msg_id.clone()).collect();
        ids.len() as i64 >= committed
    })
    .await;
    let msgs = stream.read_all().await;
    let ids: std::collections::HashSet<_> = msgs.iter().map(|m| m.msg_id.clone()).collect();
    assert_eq!(
        ids.len() as i64,
        committed,
        "every committed event, none other"
    );
    assert_eq!(
        msgs.len(),
        ids.len(),
        "no duplicate inside the duplicate window"
    );
    if ordered {
        let mut last: std::collections::HashMap<String, i64> = Default::default();
        for m in &msgs {
            let n = m.payload["n"].as_i64().expect("n");
            let prev = last.insert(m.aggregate_id.clone(), n);
            assert!(
                prev.is_none_or(|p| p < n),
                "aggregate {} out of order: {prev:?} then {n}",
                m.aggregate_id
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_stream_loses_nothing_when_its_leader_is_killed_again_and_again() {
    leader_kills(2).await;
}

/// The long version: twenty leader kills per mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: minutes"]
async fn long_replicated_stream_leader_killed_20_times_per_mode() {
    leader_kills(20).await;
}

/// `kills` leader kills per mode while a writer commits, then a follower restarted and the
/// whole cluster restarted; the stream checked after.
async fn leader_kills(kills: usize) {
    let mut cluster = NatsCluster::start();
    for mode in ["ordered", "unordered", "log-tailing"] {
        let db = TestDb::new();
        let stream = TestStream::on(&cluster.urls());
        let slot = format!("rep_{}", uuid::Uuid::now_v7().simple());
        let mut args = vec!["--mode", mode, "--stream-replicas", "3"];
        if mode == "log-tailing" {
            args.extend(["--slot", &slot]);
        }
        let _relay = Proc::spawn("outbox-relay", &mut relay_command(&db, &stream, &args));
        wait_until(TIMEOUT, "the relay made the stream", || async {
            cluster.stream_leader(&stream.name).await.is_some()
        })
        .await;
        if mode == "log-tailing" {
            wait_until(TIMEOUT, "the relay reading its slot", || async {
                db.scalar(&format!(
                    "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{slot}' AND active"
                )) == 1
            })
            .await;
        }
        let writer = Writer::start(&db);
        for _ in 0..kills {
            let resumed = kill_the_leader(&mut cluster, &stream).await;
            eprintln!("{mode}: publishing again {resumed:?} after the stream leader was killed");
            cluster.wait_stream_current(&stream.name).await;
        }
        // a follower restarted, then the whole cluster
        let leader = cluster
            .stream_leader(&stream.name)
            .await
            .unwrap_or_default();
        let follower = (0..3)
            .find(|i| cluster.index_of(&leader) != Some(*i))
            .unwrap_or(0);
        cluster.restart(follower);
        cluster.wait_stream_current(&stream.name).await;
        let before = stream_last_seq(&cluster, &stream).await;
        let stopped = std::time::Instant::now();
        cluster.restart_all();
        wait_until(
            TIMEOUT,
            "the relay publishing after the cluster restart",
            || async { stream_last_seq(&cluster, &stream).await > before },
        )
        .await;
        eprintln!(
            "{mode}: publishing again {:?} after the whole cluster was stopped",
            stopped.elapsed()
        );
        let committed = writer.stop();
        check_stream(&stream, committed, mode != "unordered").await;
        // the fault suite's checker over the table and the stream: every count 0
        if mode != "log-tailing" {
            wait_until(TIMEOUT, "every row marked published", || async {
                db.scalar("SELECT count(*) FROM outbox_audit WHERE published_at IS NULL") == 0
            })
            .await;
        }
        let report = support::checker::check(&db, &stream).await;
        eprintln!("{mode}: {report}");
        match mode {
            "ordered" => report.assert_exact_and_ordered(),
            "unordered" => report.assert_exact(),
            _ => report.assert_captured_in_order(),
        }
        let js = stream.js().await;
        let replicas = js
            .get_stream(&stream.name)
            .await
            .expect("stream")
            .info()
            .await
            .expect("info")
            .config
            .num_replicas;
        assert_eq!(
            replicas, 3,
            "the relay made the stream with --stream-replicas"
        );
    }
}

/// Commits events through `url` (several hosts, `target_session_attrs=read-write`),
/// reconnecting after errors, until stopped; returns the ids whose commit was acknowledged.
struct FailoverWriter {
    stop: Arc<std::sync::atomic::AtomicBool>,
    done: Option<std::thread::JoinHandle<Vec<String>>>,
}

impl FailoverWriter {
    fn start(url: String) -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let done = std::thread::spawn(move || {
            let mut acked = Vec::new();
            let mut conn: Option<PgConnection> = None;
            let mut n = 0;
            while !flag.load(Ordering::SeqCst) {
                let Some(c) = conn.as_mut() else {
                    conn = PgConnection::establish(&url).ok();
                    if conn.is_none() {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    continue;
                };
                let e = Tick {
                    agg: format!("a{}", n % 5),
                    n,
                };
                n += 1;
                let id = c.transaction(|c| {
                    c.record_event(&e)?;
                    diesel::select(diesel::dsl::sql::<diesel::sql_types::Text>(
                        "(SELECT id::text FROM outbox ORDER BY seq DESC LIMIT 1)",
                    ))
                    .get_result::<String>(c)
                });
                match id {
                    Ok(id) => acked.push(id),
                    Err(_) => conn = None,
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            acked
        });
        FailoverWriter {
            stop,
            done: Some(done),
        }
    }

    fn stop(mut self) -> Vec<String> {
        self.stop.store(true, Ordering::SeqCst);
        self.done
            .take()
            .expect("running")
            .join()
            .expect("writer thread")
    }
}

impl Drop for FailoverWriter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_relays_follow_a_promoted_standby_and_lose_nothing_committed() {
    for mode in ["ordered", "unordered"] {
        let (mut primary, mut standby) = PgCluster::start_with_standby();
        let db = TestDb::on(&primary.base_url());
        let url = format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{}?target_session_attrs=read-write",
            primary.port, standby.port, db.name
        );
        let stream = TestStream::new();
        let mut cmd = relay_command(&db, &stream, &["--mode", mode]);
        cmd.env("DATABASE_URL", &url);
        let _relay = Proc::spawn("outbox-relay", &mut cmd);
        let writer = FailoverWriter::start(url.clone());
        wait_until(TIMEOUT, "events relayed from the primary", || async {
            stream.count().await >= 100
        })
        .await;
        primary.stop();
        standby.promote();
        let after = stream.count().await;
        wait_until(
            TIMEOUT,
            "events relayed from the promoted standby",
            || async { stream.count().await >= after + 100 },
        )
        .await;
        let acked = writer.stop();
        // what the surviving database holds
        let survivor = PgConnection::establish(&format!(
            "postgres://postgres@127.0.0.1:{}/{}",
            standby.port, db.name
        ))
        .expect("connect to the new primary");
        let mut survivor = survivor;
        let rows: std::collections::HashSet<String> =
            diesel::dsl::sql::<diesel::sql_types::Text>("SELECT id::text FROM outbox")
                .load::<String>(&mut survivor)
                .expect("outbox ids")
                .into_iter()
                .collect();
        let missing_acked = acked.iter().filter(|id| !rows.contains(*id)).count();
        assert_eq!(
            missing_acked, 0,
            "{mode}: an acknowledged commit is not on the standby"
        );
        wait_until(
            TIMEOUT,
            "every row of the new primary in the stream",
            || async {
                let ids: std::collections::HashSet<String> = stream
                    .read_all()
                    .await
                    .into_iter()
                    .map(|m| m.msg_id)
                    .collect();
                rows.iter().all(|id| ids.contains(id))
            },
        )
        .await;
        let msgs = stream.read_all().await;
        let ids: std::collections::HashSet<String> =
            msgs.iter().map(|m| m.msg_id.clone()).collect();
        assert!(
            ids.iter().all(|id| rows.contains(id)),
            "{mode}: an event in the stream whose row the surviving database does not hold"
        );
        assert_eq!(
            msgs.len(),
            ids.len(),
            "{mode}: duplicates reached the stream"
        );
        if mode == "ordered" {
            let mut last: std::collections::HashMap<String, i64> = Default::default();
            for m in &msgs {
                let n = m.payload["n"].as_i64().expect("n");
                let prev = last.insert(m.aggregate_id.clone(), n);
                assert!(
                    prev.is_none_or(|p| p < n),
                    "aggregate {} out of order across the failover: {prev:?} then {n}",
                    m.aggregate_id
                );
            }
        }
        eprintln!(
            "{mode}: {} acknowledged commits, {} rows on the new primary, {} in the stream",
            acked.len(),
            rows.len(),
            ids.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_helper_commits_over_tls() {
    let certs = TestCerts::make();
    let cluster = PgCluster::start_tls(&certs);
    let (db, consumer_db, stream) = (
        TestDb::new(),
        TestDb::on(&cluster.base_url()),
        TestStream::new(),
    );
    record(&db, 0, 10);
    let _relay = Proc::spawn("outbox-relay", &mut relay_command(&db, &stream, &[]));
    let url = format!(
        "postgres://postgres@localhost:{}/{}?sslmode=verify-full&sslrootcert={}",
        cluster.port,
        consumer_db.name,
        certs.ca.display()
    );
    let nats = support::nats_connect(&stream.nats_url)
        .await
        .expect("connect to NATS");
    let config = ConsumerConfig::new("tls", url)
        .stream(stream.name.clone())
        .filter_subject(format!("{}.>", stream.prefix))
        .fetch_wait(Duration::from_millis(200))
        .startup_timeout(Duration::from_secs(20));
    let shutdown = CancellationToken::new();
    let consumer = tokio::spawn(Consumer::new(config, nats).run(
        shutdown.clone(),
        async move |conn: &mut AsyncPgConnection, _msg: Delivery<OrderPlaced>| {
            diesel_async::RunQueryDsl::execute(diesel::sql_query("SELECT 1"), conn).await?;
            Ok::<(), diesel::result::Error>(())
        },
    ));
    wait_until(TIMEOUT, "10 events in the consumer's inbox", || async {
        consumer_db.scalar("SELECT count(*) FROM processed_messages") == 10
    })
    .await;
    assert_eq!(
        consumer_db.scalar(
            "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() AND NOT s.ssl"
        ),
        0,
        "every connection of the consumer uses TLS"
    );
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), consumer)
        .await
        .expect("the consumer stops")
        .expect("consumer task")
        .expect("consumer result");
}
