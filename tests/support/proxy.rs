//! A TCP proxy in front of a NATS server that loses what the server sends, or is down: a
//! relay behind it publishes, JetStream stores the messages, and the acks never come back.
//!
//! States: passing both ways; deaf ([`NatsProxy::lose_replies`]: the client's bytes reach
//! the server, the server's are dropped, so acks are lost while messages are stored); down
//! ([`NatsProxy::down`]: every connection is cut and new ones are closed at once); holding
//! ([`NatsProxy::hold`]: the client's bytes are kept, not forwarded, until
//! [`NatsProxy::up`] lets them through: what a process paused with publishes in its buffers
//! sends when it resumes). It passes any TCP protocol: in front of PostgreSQL it counts the
//! bytes the server sends ([`NatsProxy::bytes_from_server`]).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const PASS: u8 = 0;
const DEAF: u8 = 1;
const DOWN: u8 = 2;
const HOLD: u8 = 3;

/// The proxy; its threads stop on `Drop`.
pub struct NatsProxy {
    port: u16,
    state: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    /// The client's bytes kept while holding, every connection's.
    held: Arc<Mutex<Vec<u8>>>,
    /// The bytes the server sent, every connection's.
    from_server: Arc<AtomicU64>,
}

impl NatsProxy {
    /// A proxy on a free local port to the server at `upstream` (`nats://host:port` or
    /// `host:port`).
    pub fn start(upstream: &str) -> Self {
        let upstream = upstream
            .trim_start_matches("nats://")
            .split(',')
            .next()
            .unwrap_or_default()
            .to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener.set_nonblocking(true).expect("non-blocking accept");
        let port = listener.local_addr().expect("its address").port();
        let proxy = NatsProxy {
            port,
            state: Arc::new(AtomicU8::new(PASS)),
            stop: Arc::new(AtomicBool::new(false)),
            conns: Arc::default(),
            held: Arc::default(),
            from_server: Arc::default(),
        };
        let (state, stop, conns) = (proxy.state.clone(), proxy.stop.clone(), proxy.conns.clone());
        let (held, counted) = (proxy.held.clone(), proxy.from_server.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let client = match listener.accept() {
                    Ok((c, _)) => c,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    }
                };
                if state.load(Ordering::Relaxed) == DOWN {
                    drop(client);
                    continue;
                }
                let _ = client.set_nonblocking(false);
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let mut kept = conns.lock().unwrap_or_else(|e| e.into_inner());
                for s in [&client, &server] {
                    if let Ok(c) = s.try_clone() {
                        kept.push(c);
                    }
                }
                drop(kept);
                let (c2, s2) = match (client.try_clone(), server.try_clone()) {
                    (Ok(c), Ok(s)) => (c, s),
                    _ => continue,
                };
                let (st, h, n) = (state.clone(), held.clone(), counted.clone());
                std::thread::spawn(move || pump(client, server, st, false, h, n));
                let (st, h, n) = (state.clone(), held.clone(), counted.clone());
                std::thread::spawn(move || pump(s2, c2, st, true, h, n));
            }
        });
        proxy
    }

    /// Its URL, for the relay.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Its address, `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The bytes the server has sent through it so far (dropped ones included).
    pub fn bytes_from_server(&self) -> u64 {
        self.from_server.load(Ordering::Relaxed)
    }

    /// From now on the server's bytes (acks, replies, pings) are dropped.
    pub fn lose_replies(&self) {
        self.state.store(DEAF, Ordering::Relaxed);
    }

    /// Cuts every connection and refuses new ones until [`NatsProxy::up`].
    pub fn down(&self) {
        self.state.store(DOWN, Ordering::Relaxed);
        for c in self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    /// From now on the client's bytes are kept, not forwarded, until [`NatsProxy::up`].
    pub fn hold(&self) {
        self.state.store(HOLD, Ordering::Relaxed);
    }

    /// The JetStream publishes (`HPUB` lines: the relay's messages carry headers) held so far.
    pub fn held_publishes(&self) -> usize {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.windows(5).filter(|w| w == b"HPUB ").count()
    }

    /// Passes both ways again; what was held goes through first.
    pub fn up(&self) {
        self.state.store(PASS, Ordering::Relaxed);
    }
}

impl Drop for NatsProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.down();
    }
}

/// Copies `from` to `to` until either closes; `from_server` bytes are dropped while deaf, the
/// client's kept in `held` while holding (one connection's held bytes are let through in
/// order; the test holds one relay's single connection).
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    state: Arc<AtomicU8>,
    from_server: bool,
    held: Arc<Mutex<Vec<u8>>>,
    counted: Arc<AtomicU64>,
) {
    let mut buf = [0u8; 16 * 1024];
    if !from_server {
        // wake up now and then to let held bytes through once the proxy passes again
        let _ = from.set_read_timeout(Some(Duration::from_millis(20)));
    }
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                0
            }
            Err(_) => break,
        };
        if from_server {
            counted.fetch_add(n as u64, Ordering::Relaxed);
        }
        let now = state.load(Ordering::Relaxed);
        match now {
            DOWN => break,
            DEAF if from_server => continue,
            HOLD if !from_server => {
                held.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(&buf[..n]);
                continue;
            }
            _ => {}
        }
        if !from_server {
            let kept = std::mem::take(&mut *held.lock().unwrap_or_else(|e| e.into_inner()));
            if !kept.is_empty() && to.write_all(&kept).is_err() {
                break;
            }
        }
        if n > 0 && to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
