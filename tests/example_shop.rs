//! The example service (`examples/shop.rs`) run as a user runs it: the built binary with its
//! own database, stream and port, driven over HTTP, its events read back from JetStream.
//!
//! Build the examples first: `cargo build --examples && cargo test --test example_shop`.

mod support;

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use diesel::prelude::*;
use serde_json::{Value, json};
use support::{Proc, TestStream, example_bin, free_port, pg_base, wait_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A database name of its own that the shop creates; dropped (`WITH (FORCE)`) on `Drop`.
struct ShopDb {
    name: String,
    url: String,
}

impl ShopDb {
    fn new() -> Self {
        let name = format!("shop_t_{}", uuid::Uuid::now_v7().simple());
        ShopDb {
            url: format!("{}/{name}", pg_base()),
            name,
        }
    }
}

impl Drop for ShopDb {
    fn drop(&mut self) {
        if let Ok(mut admin) = PgConnection::establish(&format!("{}/postgres", pg_base())) {
            let _ = diesel::sql_query(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .execute(&mut admin);
        }
    }
}

/// The shop binary with a clean environment: `database_url`, the stream's NATS, name and
/// prefix, and `addr`.
fn shop_command(
    database_url: &str,
    nats_url: &str,
    stream: &TestStream,
    addr: SocketAddr,
) -> Command {
    let mut cmd = Command::new(example_bin("shop"));
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env(
            "RUST_LOG",
            std::env::var("OUTBOX_TEST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .env("DATABASE_URL", database_url)
        .env("NATS_URL", nats_url)
        .env("OUTBOX_STREAM", &stream.name)
        .env("OUTBOX_SUBJECT_PREFIX", &stream.prefix)
        .env("SHOP_ADDR", addr.to_string());
    cmd
}

fn local_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// One HTTP/1.1 request (`Connection: close`); the status and the JSON body.
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> std::io::Result<(u16, Value)> {
    let exchange = async {
        let mut socket = tokio::net::TcpStream::connect(addr).await?;
        let mut request =
            format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
        let body = body.map(|b| b.to_string());
        if let Some(body) = &body {
            request.push_str("Content-Type: application/json\r\n");
            request.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        request.push_str("\r\n");
        request.push_str(body.as_deref().unwrap_or(""));
        socket.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        socket.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{method} {path}"))
        })??;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {head:?}")))?;
    Ok((status, serde_json::from_str(body).unwrap_or(Value::Null)))
}

async fn call(addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    http(addr, method, path, body)
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// Waits until the shop answers HTTP (its database is made and migrated by then).
async fn wait_ready(shop: &mut Proc, addr: SocketAddr) {
    wait_until(Duration::from_secs(60), "the shop to answer HTTP", || {
        assert!(shop.is_running(), "the shop exited during start-up");
        async move { matches!(http(addr, "GET", "/orders/0", None).await, Ok((404, _))) }
    })
    .await;
}

async fn place(addr: SocketAddr, customer: &str, quantity: u32, price_cents: i64) -> i64 {
    let order = json!({ "customer": customer, "items": [{ "sku": "tea", "quantity": quantity, "price_cents": price_cents }] });
    let (status, body) = call(addr, "POST", "/orders", Some(order)).await;
    assert_eq!(status, 201, "place: {body}");
    assert_eq!(body["status"], "placed");
    assert_eq!(body["total_cents"], i64::from(quantity) * price_cents);
    body["id"].as_i64().expect("order id")
}

#[tokio::test]
async fn each_state_change_publishes_exactly_one_event_in_order() {
    let (db, stream, addr) = (ShopDb::new(), TestStream::new(), local_addr());
    let mut shop = Proc::spawn(
        "shop",
        shop_command(&db.url, &stream.nats_url, &stream, addr).stdout(Stdio::null()),
    );
    wait_ready(&mut shop, addr).await;

    let a = place(addr, "ada", 2, 450).await;
    let b = place(addr, "grace", 1, 380).await;
    let (status, body) = call(addr, "POST", &format!("/orders/{a}/pay"), None).await;
    assert_eq!((status, &body["status"]), (200, &json!("paid")), "{body}");
    let reason = json!({ "reason": "changed my mind" });
    let (status, body) = call(addr, "POST", &format!("/orders/{b}/cancel"), Some(reason)).await;
    assert_eq!(
        (status, &body["status"]),
        (200, &json!("cancelled")),
        "{body}"
    );

    // refused changes record nothing
    let (status, _) = call(addr, "POST", &format!("/orders/{a}/pay"), None).await;
    assert_eq!(status, 409, "paying twice");
    let (status, _) = call(addr, "POST", &format!("/orders/{b}/pay"), None).await;
    assert_eq!(status, 409, "paying a cancelled order");
    let (status, _) = call(addr, "POST", "/orders/999999/cancel", None).await;
    assert_eq!(status, 404);
    let (status, _) = call(
        addr,
        "POST",
        "/orders",
        Some(json!({ "customer": "x", "items": [] })),
    )
    .await;
    assert_eq!(status, 422);

    let c = place(addr, "alan", 3, 275).await;
    let (status, _) = call(addr, "POST", &format!("/orders/{c}/cancel"), None).await;
    assert_eq!(status, 200);

    let (status, body) = call(addr, "GET", &format!("/orders/{a}"), None).await;
    assert_eq!(
        (status, &body["status"], &body["customer"]),
        (200, &json!("paid"), &json!("ada"))
    );

    wait_until(
        Duration::from_secs(60),
        "6 events in the stream",
        || async { stream.count().await >= 6 },
    )
    .await;
    let outbox_rows: i64 = diesel::dsl::select(diesel::dsl::sql::<diesel::sql_types::BigInt>(
        "(SELECT count(*) FROM outbox)",
    ))
    .get_result(&mut PgConnection::establish(&db.url).expect("connect to the shop's database"))
    .expect("count outbox rows");
    assert_eq!(outbox_rows, 6, "refused changes record nothing");
    let got = stream.read_all().await;
    assert_eq!(got.len(), 6, "one message per state change: {got:#?}");

    let mut per_order: HashMap<String, Vec<&str>> = HashMap::new();
    let mut ids = HashSet::new();
    for m in &got {
        assert_eq!(
            m.subject,
            format!("{}.order.{}", stream.prefix, m.aggregate_id)
        );
        assert_eq!(m.aggregate_type, "order");
        assert!(
            ids.insert(m.msg_id.clone()),
            "Nats-Msg-Id {} repeats",
            m.msg_id
        );
        assert_eq!(
            m.payload["order_id"].to_string(),
            m.aggregate_id,
            "payload of {}",
            m.event_type
        );
        per_order
            .entry(m.aggregate_id.clone())
            .or_default()
            .push(m.event_type.as_str());
    }
    let expected = HashMap::from([
        (a.to_string(), vec!["order.placed", "order.paid"]),
        (b.to_string(), vec!["order.placed", "order.cancelled"]),
        (c.to_string(), vec!["order.placed", "order.cancelled"]),
    ]);
    assert_eq!(
        per_order, expected,
        "each order's events, in the order its changes happened"
    );

    let event = |id: i64, event_type: &str| {
        got.iter()
            .find(|m| m.aggregate_id == id.to_string() && m.event_type == event_type)
            .map(|m| m.payload.clone())
            .unwrap_or_else(|| panic!("no {event_type} for order {id}"))
    };
    let placed = event(a, "order.placed");
    assert_eq!(
        (&placed["customer"], &placed["total_cents"]),
        (&json!("ada"), &json!(900))
    );
    assert_eq!(placed["items"][0]["sku"], "tea");
    assert_eq!(event(a, "order.paid")["total_cents"], 900);
    assert_eq!(event(b, "order.cancelled")["reason"], "changed my mind");
    assert_eq!(event(c, "order.cancelled")["reason"], Value::Null);

    shop.signal("TERM");
    assert_eq!(
        shop.wait_exit(Duration::from_secs(20)),
        Some(0),
        "SIGTERM stops the shop cleanly"
    );
}

#[tokio::test]
async fn demo_flag_places_orders_that_reach_the_stream() {
    let (db, stream, addr) = (ShopDb::new(), TestStream::new(), local_addr());
    let mut shop = Proc::spawn(
        "shop",
        shop_command(&db.url, &stream.nats_url, &stream, addr)
            .arg("--demo")
            .stdout(Stdio::null()),
    );
    wait_ready(&mut shop, addr).await;
    // three orders, each placed and then paid or cancelled
    wait_until(Duration::from_secs(60), "the demo's 6 events", || async {
        stream.count().await >= 6
    })
    .await;
    let got = stream.read_all().await;
    let placed = got
        .iter()
        .filter(|m| m.event_type == "order.placed")
        .count();
    assert_eq!((got.len(), placed), (6, 3));
}

/// Runs the shop until it exits (at most 60 s); its exit code and everything it printed.
fn run_to_exit(mut cmd: Command) -> (Option<i32>, String) {
    let mut shop = Proc::spawn("shop", cmd.stdout(Stdio::piped()).stderr(Stdio::piped()));
    let code = shop.wait_exit(Duration::from_secs(60));
    let mut output = String::new();
    if let Some(mut out) = shop.child.stdout.take() {
        let _ = out.read_to_string(&mut output);
    }
    if let Some(mut err) = shop.child.stderr.take() {
        let _ = err.read_to_string(&mut output);
    }
    (code, output)
}

#[test]
fn unreachable_database_exits_non_zero_naming_database_url() {
    let stream = TestStream::new();
    let url = format!("postgres://postgres@127.0.0.1:{}/shop_nowhere", free_port());
    let (code, output) = run_to_exit(shop_command(&url, &stream.nats_url, &stream, local_addr()));
    assert!(
        matches!(code, Some(c) if c != 0),
        "exit code {code:?}; output:\n{output}"
    );
    assert!(output.contains("cannot reach PostgreSQL"), "{output}");
    assert!(
        output.contains("DATABASE_URL="),
        "names DATABASE_URL: {output}"
    );
    assert!(
        !output.contains("panicked") && !output.contains("RUST_BACKTRACE"),
        "{output}"
    );
}

#[test]
fn unreachable_nats_exits_non_zero_naming_nats_url() {
    let (db, stream) = (ShopDb::new(), TestStream::new());
    let nats = format!("nats://127.0.0.1:{}", free_port());
    let (code, output) = run_to_exit(shop_command(&db.url, &nats, &stream, local_addr()));
    assert!(
        matches!(code, Some(c) if c != 0),
        "exit code {code:?}; output:\n{output}"
    );
    assert!(output.contains("cannot reach NATS"), "{output}");
    assert!(output.contains("NATS_URL="), "names NATS_URL: {output}");
    assert!(
        !output.contains("panicked") && !output.contains("RUST_BACKTRACE"),
        "{output}"
    );
}

/// Issue 21: after `--demo` (which pays and cancels orders 1-3 of a new database), the
/// commands the shop printed still work when pasted as printed, in order.
#[tokio::test]
async fn the_printed_curl_commands_work_as_printed_after_the_demo() {
    use std::io::BufRead;
    let (db, stream, addr) = (ShopDb::new(), TestStream::new(), local_addr());
    let mut shop = Proc::spawn(
        "shop",
        shop_command(&db.url, &stream.nats_url, &stream, addr)
            .arg("--demo")
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    let stdout = shop.child.stdout.take().expect("stdout");
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut printed = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !printed.iter().any(|l: &String| l.starts_with("demo: done")) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => printed.push(line),
            Err(_) => panic!("the demo did not finish; printed:\n{}", printed.join("\n")),
        }
    }
    // the commands: the indented lines between "Try it" and "Watch the events"
    let from = printed
        .iter()
        .position(|l| l.starts_with("Try it in another terminal"))
        .expect("the guide");
    let script: Vec<&str> = printed[from..]
        .iter()
        .take_while(|l| !l.starts_with("Watch the events"))
        .filter(|l| l.starts_with("  "))
        .map(String::as_str)
        .collect();
    assert!(script.len() >= 5, "{printed:#?}");
    let out = Command::new("sh")
        .arg("-ec")
        .arg(script.join("\n"))
        .output()
        .expect("run the printed commands with sh");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let responses: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let statuses: Vec<&str> = responses
        .iter()
        .map(|r| r["status"].as_str().unwrap_or("no status"))
        .collect();
    assert_eq!(statuses, ["paid", "cancelled", "cancelled"], "{text}");
    // the demo's orders were 1-3: the printed commands made new ones
    assert!(
        responses.iter().all(|r| r["id"].as_i64() > Some(3)),
        "{text}"
    );
    shop.signal("TERM");
    assert_eq!(shop.wait_exit(Duration::from_secs(20)), Some(0));
}

/// The consumer example with a clean environment: its own database `url`, the stream's NATS,
/// name and prefix.
fn consumer_command(url: &str, stream: &TestStream) -> Command {
    let mut cmd = Command::new(example_bin("consumer"));
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info")
        .env("CONSUMER_DATABASE_URL", url)
        .env("NATS_URL", &stream.nats_url)
        .env("OUTBOX_STREAM", &stream.name)
        .env("CONSUMER_FILTER", format!("{}.>", stream.prefix));
    cmd
}

/// Reads a child's pipe line by line on a thread of its own.
fn lines_of(pipe: impl Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Issue 21: two consumers started at the same moment (the README says two runs with one
/// name share the work) both create-if-missing one database; neither may fail. Their events
/// go to stdout, their logs to stderr, without colour codes when not on a terminal.
#[tokio::test]
async fn two_consumers_started_together_share_a_new_database_and_keep_logs_off_stdout() {
    let (db, stream) = (ShopDb::new(), TestStream::new());
    let js = stream.js().await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.name.clone(),
        subjects: vec![format!("{}.>", stream.prefix)],
        ..Default::default()
    })
    .await
    .expect("the stream");
    let mut consumers: Vec<(Proc, _, _)> = (0..2)
        .map(|_| consumer_command(&db.url, &stream))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|mut cmd| {
            let mut p = Proc::spawn(
                "consumer",
                cmd.stdout(Stdio::piped()).stderr(Stdio::piped()),
            );
            let out = lines_of(p.child.stdout.take().expect("stdout"));
            let err = lines_of(p.child.stderr.take().expect("stderr"));
            (p, out, err)
        })
        .collect();
    let mut logs = [Vec::<String>::new(), Vec::new()];
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    for (i, (p, _, err)) in consumers.iter_mut().enumerate() {
        while !logs[i]
            .iter()
            .any(|l| l.contains("outbox consumer started"))
        {
            match err.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => logs[i].push(line),
                Err(_) => {
                    assert!(
                        p.is_running() && std::time::Instant::now() < deadline,
                        "consumer {i} did not start:\n{}",
                        logs[i].join("\n")
                    );
                }
            }
        }
    }
    for n in 1..=4_i64 {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", uuid::Uuid::now_v7().to_string().as_str());
        headers.insert("Outbox-Event-Type", "order.paid");
        let body = json!({ "order_id": n, "total_cents": 100 }).to_string();
        js.publish_with_headers(format!("{}.order.{n}", stream.prefix), headers, body.into())
            .await
            .expect("publish")
            .await
            .expect("ack");
    }
    // every event printed once, by one consumer or the other, and nothing else on stdout
    let mut printed = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while printed.len() < 4 && std::time::Instant::now() < deadline {
        for (_, out, _) in &consumers {
            while let Ok(line) = out.try_recv() {
                printed.push(line);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (p, _, _) in &consumers {
        p.signal("INT");
    }
    for (i, (p, out, err)) in consumers.iter_mut().enumerate() {
        assert_eq!(
            p.wait_exit(Duration::from_secs(20)),
            Some(0),
            "consumer {i}"
        );
        printed.extend(out.try_iter());
        logs[i].extend(err.try_iter());
    }
    assert_eq!(
        printed.len(),
        4,
        "one line per event on stdout: {printed:#?}"
    );
    for line in &printed {
        assert!(
            line.starts_with(&format!("{}.order.", stream.prefix)) && line.contains("Paid"),
            "stdout holds only events: {line:?}"
        );
    }
    for (i, lines) in logs.iter().enumerate() {
        let text = lines.join("\n");
        assert!(
            !text.contains('\u{1b}'),
            "no colour codes in a pipe: {text}"
        );
        assert!(
            text.contains(" INFO "),
            "consumer {i} logs to stderr: {text}"
        );
        assert!(!text.contains("duplicate key"), "{text}");
    }
}
