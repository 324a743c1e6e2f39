//! A TCP proxy in front of a NATS server that loses what the server sends, or is down: a
//! relay behind it publishes, JetStream stores the messages, and the acks never come back.
//!
//! States: passing both ways; deaf ([`NatsProxy::lose_replies`]: the client's bytes reach
//! the server, the server's are dropped, so acks are lost while messages are stored); down
//! ([`NatsProxy::down`]: every connection is cut and new ones are closed at once).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const PASS: u8 = 0;
const DEAF: u8 = 1;
const DOWN: u8 = 2;

/// The proxy; its threads stop on `Drop`.
pub struct NatsProxy {
    port: u16,
    state: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
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
        };
        let (state, stop, conns) = (proxy.state.clone(), proxy.stop.clone(), proxy.conns.clone());
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
                let st = state.clone();
                std::thread::spawn(move || pump(client, server, st, false));
                let st = state.clone();
                std::thread::spawn(move || pump(s2, c2, st, true));
            }
        });
        proxy
    }

    /// Its URL, for the relay.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
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

    /// Passes both ways again.
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

/// Copies `from` to `to` until either closes; `from_server` bytes are dropped while deaf.
fn pump(mut from: TcpStream, mut to: TcpStream, state: Arc<AtomicU8>, from_server: bool) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        match state.load(Ordering::Relaxed) {
            DOWN => break,
            DEAF if from_server => continue,
            _ => {}
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
