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
        let mut c = PgCluster {
            port: free_port(),
            dir,
            running: false,
        };
        c.restart();
        c
    }

    pub fn base_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    pub fn restart(&mut self) {
        self.stop();
        let opts = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c fsync=off -c wal_level=logical",
            self.port,
            self.dir.display()
        );
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
