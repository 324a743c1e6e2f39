//! Private servers for the tests that stop or restart one: a `nats-server` on a free port
//! with its store in a temp dir, and a PostgreSQL cluster made with `initdb`.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{Proc, free_port};

/// The `nats-server` binary: `OUTBOX_NATS_SERVER` or the one on PATH.
pub fn nats_server_bin() -> PathBuf {
    std::env::var_os("OUTBOX_NATS_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| "nats-server".into())
}

/// A private `nats-server -js` on 127.0.0.1; killed on `Drop`, its store removed.
pub struct NatsServer {
    pub port: u16,
    pub dir: PathBuf,
    proc: Option<Proc>,
    /// `--tls ...` arguments, for a server that speaks TLS only.
    tls: Vec<String>,
}

impl NatsServer {
    pub fn start() -> Self {
        let dir =
            std::env::temp_dir().join(format!("outbox-nats-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("nats temp dir");
        let mut s = NatsServer {
            port: free_port(),
            dir,
            proc: None,
            tls: Vec::new(),
        };
        s.restart();
        s
    }

    /// A server that speaks TLS only, with `certs`' server certificate (it names
    /// `localhost`); with `verify`, clients must show a certificate signed by `certs`' CA.
    pub fn start_tls(certs: &TestCerts, verify: bool) -> Self {
        let dir =
            std::env::temp_dir().join(format!("outbox-nats-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("nats temp dir");
        let path = |p: &PathBuf| p.display().to_string();
        let mut tls = vec![
            "--tlscert".to_owned(),
            path(&certs.server_cert),
            "--tlskey".to_owned(),
            path(&certs.server_key),
            "--tlscacert".to_owned(),
            path(&certs.ca),
        ];
        tls.push(if verify { "--tlsverify" } else { "--tls" }.to_owned());
        let mut s = NatsServer {
            port: free_port(),
            dir,
            proc: None,
            tls,
        };
        s.restart();
        s
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts it (again, on the same port and store) and waits until it accepts connections.
    pub fn restart(&mut self) {
        self.stop();
        let proc = Proc::spawn(
            "nats-server",
            Command::new(nats_server_bin())
                .args([
                    "-a",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-js",
                    "-sd",
                ])
                .arg(&self.dir)
                .args(&self.tls)
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        self.proc = Some(proc);
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "nats-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Freezes it (SIGSTOP): connections stay open and nothing answers.
    pub fn pause(&self) {
        if let Some(p) = &self.proc {
            p.signal("STOP");
        }
    }

    /// Thaws it after [`NatsServer::pause`] (SIGCONT).
    pub fn resume(&self) {
        if let Some(p) = &self.proc {
            p.signal("CONT");
        }
    }

    /// Kills it (SIGKILL).
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A private PostgreSQL cluster on 127.0.0.1 (trust auth, user `postgres`); stopped and
/// removed on `Drop`. `initdb` refuses root, so as root it runs the server as `postgres`.
pub struct PgCluster {
    pub port: u16,
    pub dir: PathBuf,
    running: bool,
    tls: bool,
    /// Settings passed as `-c name=value` at every start, after the defaults.
    pub settings: Vec<String>,
}

/// Certificates made for a test: a CA, a server certificate naming `localhost` only (not
/// `127.0.0.1`), and a client certificate for the role `tlsclient`; PEM files in a temp dir
/// removed on `Drop`.
pub struct TestCerts {
    pub dir: PathBuf,
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TestCerts {
    pub fn make() -> Self {
        use rcgen::{
            BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair,
            KeyUsagePurpose,
        };
        let dir =
            std::env::temp_dir().join(format!("outbox-certs-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("certs temp dir");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "outbox test CA");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("CA key"))
            .expect("CA certificate");
        let leaf = |names: Vec<String>, cn: &str| {
            let key = KeyPair::generate().expect("key");
            let mut params = CertificateParams::new(names).expect("params");
            params.distinguished_name.push(DnType::CommonName, cn);
            let cert = params.signed_by(&key, &ca).expect("sign");
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(vec!["localhost".into()], "localhost");
        let (client_cert, client_key) = leaf(Vec::new(), "tlsclient");
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).expect("write a certificate");
            path
        };
        TestCerts {
            ca: write("ca.crt", &ca.pem()),
            server_cert: write("server.crt", &server_cert),
            server_key: write("server.key", &server_key),
            client_cert: write("client.crt", &client_cert),
            client_key: write("client.key", &client_key),
            dir,
        }
    }
}

impl Drop for TestCerts {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn pg_bindir() -> PathBuf {
    let out = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .expect("pg_config");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn as_postgres(bin: &str) -> Command {
    let path = pg_bindir().join(bin);
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0"))
        .unwrap_or(false);
    if is_root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(path);
        c
    } else {
        Command::new(path)
    }
}

impl PgCluster {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A cluster started with `settings` (`name=value`), e.g. a library to preload.
    pub fn start_with(settings: &[&str]) -> Self {
        let mut c = Self::init();
        c.settings.extend(settings.iter().map(|s| s.to_string()));
        c.restart();
        c
    }

    /// A cluster whose messages are German (`lc_messages = de_DE.UTF-8`): what the server
    /// says in words changes, its SQLSTATEs and its state do not. The locale must exist on the
    /// machine (`localedef -i de_DE -f UTF-8 de_DE.UTF-8`; scripts/test.sh makes it).
    pub fn start_german() -> Self {
        let locales = Command::new("locale")
            .arg("-a")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).to_lowercase())
            .unwrap_or_default();
        assert!(
            locales.contains("de_de.utf8"),
            "the de_DE.UTF-8 locale is missing: run `localedef -i de_DE -f UTF-8 de_DE.UTF-8` (scripts/test.sh does)"
        );
        let mut c = Self::init();
        c.settings.push("lc_messages=de_DE.UTF-8".into());
        c.restart();
        c
    }

    /// A cluster that accepts TLS connections only (`ssl = on` with `certs`' server
    /// certificate; `pg_hba.conf`: `hostssl` lines alone, trust for every role but
    /// `tlsclient`, which authenticates with its client certificate).
    pub fn start_tls(certs: &TestCerts) -> Self {
        let mut c = Self::init();
        let data = c.dir.join("data");
        for (from, to) in [
            (&certs.server_cert, "server.crt"),
            (&certs.server_key, "server.key"),
            (&certs.ca, "ca.crt"),
        ] {
            std::fs::copy(from, data.join(to)).expect("copy a certificate");
            let _ = Command::new("chown")
                .arg("postgres:postgres")
                .arg(data.join(to))
                .status();
            let _ = Command::new("chmod").arg("600").arg(data.join(to)).status();
        }
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\n\
             hostssl all tlsclient 127.0.0.1/32 cert\n\
             hostssl all all 127.0.0.1/32 trust\n\
             hostssl replication all 127.0.0.1/32 trust\n",
        )
        .expect("write pg_hba.conf");
        c.tls = true;
        c.restart();
        c
    }

    /// A primary and its synchronous streaming standby (made with `pg_basebackup`): every
    /// commit on the primary waits until the standby has it.
    pub fn start_with_standby() -> (Self, Self) {
        let primary = Self::start();
        let dir = std::env::temp_dir().join(format!("outbox-pg-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("pg temp dir");
        let _ = Command::new("chown")
            .args(["postgres:postgres"])
            .arg(&dir)
            .status();
        let ok = as_postgres("pg_basebackup")
            .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
            .args(["-U", "postgres", "-X", "stream", "-R", "-D"])
            .arg(dir.join("data"))
            .stdout(Stdio::null())
            .status()
            .expect("pg_basebackup");
        assert!(ok.success(), "pg_basebackup failed");
        let mut standby = PgCluster {
            port: free_port(),
            dir,
            running: false,
            tls: false,
            settings: Vec::new(),
        };
        standby.restart();
        let ok = as_postgres("psql")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &primary.port.to_string(),
                "-U",
                "postgres",
            ])
            .args(["-d", "postgres", "-X", "-q", "-v", "ON_ERROR_STOP=1"])
            .args([
                "-c",
                "ALTER SYSTEM SET synchronous_standby_names = '*'",
                "-c",
                "SELECT pg_reload_conf()",
            ])
            .stdout(Stdio::null())
            .status()
            .expect("psql");
        assert!(ok.success(), "cannot make the standby synchronous");
        (primary, standby)
    }

    /// Promotes a standby to primary and waits until it accepts writes.
    pub fn promote(&mut self) {
        let ok = as_postgres("pg_ctl")
            .args(["-w", "-D"])
            .arg(self.dir.join("data"))
            .arg("promote")
            .stdout(Stdio::null())
            .status()
            .expect("pg_ctl promote");
        assert!(ok.success(), "pg_ctl promote failed");
    }

    fn init() -> Self {
        let dir = std::env::temp_dir().join(format!("outbox-pg-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("pg temp dir");
        let _ = Command::new("chown")
            .args(["postgres:postgres"])
            .arg(&dir)
            .status();
        let ok = as_postgres("initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(dir.join("data"))
            .stdout(Stdio::null())
            .status()
            .expect("initdb");
        assert!(ok.success(), "initdb failed");
        PgCluster {
            port: free_port(),
            dir,
            running: false,
            tls: false,
            settings: Vec::new(),
        }
    }

    pub fn base_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    pub fn restart(&mut self) {
        self.stop();
        let mut opts = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c fsync=off -c wal_level=logical",
            self.port,
            self.dir.display()
        );
        for setting in &self.settings {
            opts.push_str(&format!(" -c {setting}"));
        }
        if self.tls {
            opts.push_str(
                " -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key -c ssl_ca_file=ca.crt",
            );
        }
        let ok = as_postgres("pg_ctl")
            .args(["-w", "-t", "30", "-D"])
            .arg(self.dir.join("data"))
            .args(["-o", &opts, "-l"])
            .arg(self.dir.join("log"))
            .arg("start")
            .stdout(Stdio::null())
            .status()
            .expect("pg_ctl start");
        assert!(
            ok.success(),
            "pg_ctl start failed; see {}",
            self.dir.join("log").display()
        );
        self.running = true;
    }

    /// Stops it at once (`-m immediate`: like a crash).
    pub fn stop(&mut self) {
        if self.running {
            let _ = as_postgres("pg_ctl")
                .args(["-D"])
                .arg(self.dir.join("data"))
                .args(["-m", "immediate", "stop"])
                .stdout(Stdio::null())
                .status();
            self.running = false;
        }
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A three-node JetStream cluster on 127.0.0.1 (client and route ports free, a store per
/// node); every node killed on `Drop`, the stores removed.
pub struct NatsCluster {
    pub name: String,
    pub nodes: Vec<ClusterNode>,
    dir: PathBuf,
}

/// One node of a [`NatsCluster`].
pub struct ClusterNode {
    pub name: String,
    pub port: u16,
    pub route_port: u16,
    proc: Option<Proc>,
}

impl NatsCluster {
    /// Starts three nodes and waits until JetStream has a meta leader.
    pub fn start() -> Self {
        let id = uuid::Uuid::now_v7().simple().to_string();
        let dir = std::env::temp_dir().join(format!("outbox-natsc-{id}"));
        std::fs::create_dir_all(&dir).expect("nats cluster temp dir");
        let nodes = (0..3)
            .map(|i| ClusterNode {
                name: format!("n{i}"),
                port: free_port(),
                route_port: free_port(),
                proc: None,
            })
            .collect();
        let mut c = NatsCluster {
            name: format!("c{}", &id[id.len() - 8..]),
            nodes,
            dir,
        };
        for i in 0..3 {
            c.spawn(i);
        }
        c.wait_ready();
        c
    }

    /// The seed list of every node: `nats://127.0.0.1:p0,nats://127.0.0.1:p1,...`.
    pub fn urls(&self) -> String {
        (0..self.nodes.len())
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Node `i`'s client URL.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].port)
    }

    /// The node named `name` (`n0`, `n1`, `n2`), as JetStream reports a leader.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    fn spawn(&mut self, i: usize) {
        let routes = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, n)| format!("nats://127.0.0.1:{}", n.route_port))
            .collect::<Vec<_>>()
            .join(",");
        let node = &self.nodes[i];
        let store = self.dir.join(&node.name);
        let log = self.dir.join(format!("{}.log", node.name));
        let proc = Proc::spawn(
            "nats-server",
            Command::new(nats_server_bin())
                .args(["-a", "127.0.0.1", "-p", &node.port.to_string()])
                .args(["-n", &node.name, "--cluster_name", &self.name])
                .args([
                    "--cluster",
                    &format!("nats://127.0.0.1:{}", node.route_port),
                    "--routes",
                    &routes,
                    "-js",
                    "-sd",
                ])
                .arg(&store)
                .arg("-l")
                .arg(&log)
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        self.nodes[i].proc = Some(proc);
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.nodes[i].port)).is_err() {
            let exited = self.nodes[i]
                .proc
                .as_mut()
                .and_then(|p| p.child.try_wait().ok().flatten());
            if exited.is_some() || start.elapsed() > Duration::from_secs(10) {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                panic!(
                    "nats-server {} did not start on port {} (exit: {exited:?}); its log ends:\n{}",
                    self.nodes[i].name,
                    self.nodes[i].port,
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills node `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.nodes[i].proc.take() {
            p.kill();
        }
    }

    /// Starts node `i` again (same ports and store); does not wait for JetStream.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i);
    }

    /// Stops every node (SIGTERM, as an orchestrator restarts a cluster), then starts them all
    /// again and waits for a meta leader.
    pub fn restart_all(&mut self) {
        for node in &mut self.nodes {
            if let Some(p) = node.proc.as_mut() {
                p.signal("TERM");
            }
        }
        for node in &mut self.nodes {
            if let Some(mut p) = node.proc.take() {
                p.wait_exit(Duration::from_secs(10));
                p.kill();
            }
        }
        for i in 0..self.nodes.len() {
            self.spawn(i);
        }
        self.wait_ready();
    }

    /// Waits (up to 60 s) until JetStream answers through the running nodes.
    pub fn wait_ready(&self) {
        let urls: Vec<String> = (0..self.nodes.len())
            .filter(|i| self.nodes[*i].proc.is_some())
            .map(|i| self.url(i))
            .collect();
        let ready = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let start = Instant::now();
                // ready when a stream on every running node can be made and takes a message
                let replicas = urls.len();
                while start.elapsed() < Duration::from_secs(60) {
                    if let Ok(c) = super::nats_connect(&urls.join(",")).await {
                        let js = async_nats::jetstream::new(c);
                        let name = format!("PROBE_{}", uuid::Uuid::now_v7().simple());
                        let probe = async {
                            js.create_stream(async_nats::jetstream::stream::Config {
                                name: name.clone(),
                                subjects: vec![format!("probe.{name}")],
                                num_replicas: replicas,
                                storage: async_nats::jetstream::stream::StorageType::Memory,
                                ..Default::default()
                            })
                            .await
                            .ok()?;
                            let ack = js.publish(format!("probe.{name}"), "x".into()).await.ok()?;
                            ack.await.ok()
                        };
                        let ok = tokio::time::timeout(Duration::from_secs(3), probe)
                            .await
                            .ok()
                            .flatten()
                            .is_some();
                        let _ =
                            tokio::time::timeout(Duration::from_secs(2), js.delete_stream(&name))
                                .await;
                        if ok {
                            return true;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                false
            })
        })
        .join()
        .expect("cluster readiness thread");
        assert!(
            ready,
            "the NATS cluster has no JetStream meta leader after 60 s"
        );
    }

    /// Waits (up to 60 s) until `stream` has a leader and every other node is a current
    /// replica of it.
    pub async fn wait_stream_current(&self, stream: &str) {
        let urls: Vec<String> = (0..self.nodes.len()).map(|i| self.url(i)).collect();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(60) {
            let current = async {
                let client = super::nats_connect(&urls.join(",")).await.ok()?;
                let js = async_nats::jetstream::new(client);
                let mut s = js.get_stream(stream).await.ok()?;
                let info = s.info().await.ok()?;
                let cluster = info.cluster.as_ref()?;
                Some(
                    cluster.leader.is_some()
                        && cluster.replicas.len() + 1 == self.nodes.len()
                        && cluster.replicas.iter().all(|r| r.current && !r.offline),
                )
            };
            if let Ok(Some(true)) = tokio::time::timeout(Duration::from_secs(3), current).await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("stream {stream} has no current replica set after 60 s");
    }

    /// The name of `stream`'s current leader node, if it has one.
    pub async fn stream_leader(&self, stream: &str) -> Option<String> {
        let urls: Vec<String> = (0..self.nodes.len())
            .filter(|i| self.nodes[*i].proc.is_some())
            .map(|i| self.url(i))
            .collect();
        let client = super::nats_connect(&urls.join(",")).await.ok()?;
        let js = async_nats::jetstream::new(client);
        let mut s = js.get_stream(stream).await.ok()?;
        let info = tokio::time::timeout(Duration::from_secs(2), s.info())
            .await
            .ok()?
            .ok()?;
        info.cluster.as_ref().and_then(|c| c.leader.clone())
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
