//! # The shop: an order service that publishes its events through the outbox
//!
//! A small HTTP service (axum) that keeps orders in PostgreSQL and tells the world about them
//! on NATS JetStream, without ever losing or inventing an event:
//!
//! - every handler changes an order **and** records its event (`order.placed`, `order.paid`,
//!   `order.cancelled`) in **one** database transaction, through a diesel-async deadpool pool:
//!   `conn.transaction(async |conn| { ...; conn.record_event(&event).await?; Ok(..) })`;
//! - it follows the ordering rule: lock (or write) the order's row first, record the event as
//!   the transaction's last write, so the events of one order commit, and reach JetStream, in
//!   the order the changes happened;
//! - the relay (`outbox_nats::Relay`) runs in the same process and copies committed events to
//!   the stream `OUTBOX` (subjects `outbox.order.<id>`); Ctrl-C or SIGTERM stops the HTTP
//!   server and the relay together, gracefully.
//!
//! ## Run it
//!
//! With PostgreSQL on 127.0.0.1:5432 (user `postgres`, no password) and `nats-server -js` on
//! 127.0.0.1:4222 nothing needs configuring:
//!
//! ```text
//! cargo run --example shop               # then follow the curl commands it prints
//! cargo run --example shop -- --demo     # or SHOP_DEMO=1: it places a few orders itself
//! cargo run --example consumer           # in another terminal: watch the events arrive
//! ```
//!
//! It creates its database when missing, applies the outbox migration and its own `orders`
//! table, and the relay creates the stream. Settings (flag or environment variable):
//! `--database-url` / `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/outbox_shop`),
//! `--nats-url` / `NATS_URL` (default `nats://127.0.0.1:4222`), `--addr` / `SHOP_ADDR`
//! (default `127.0.0.1:3000`), `--stream` / `OUTBOX_STREAM` (default `OUTBOX`),
//! `--subject-prefix` / `OUTBOX_SUBJECT_PREFIX` (default `outbox`), `--demo` / `SHOP_DEMO`.
//!
//! ## The API
//!
//! ```text
//! POST /orders             {"customer":"ada","items":[{"sku":"tea","quantity":2,"price_cents":450}]}
//!                          -> 201 {"id":1,"status":"placed",...}             + order.placed
//! POST /orders/{id}/pay    -> 200 {"status":"paid",...}                       + order.paid
//! POST /orders/{id}/cancel [{"reason":"..."}] -> 200 {"status":"cancelled"}   + order.cancelled
//! GET  /orders/{id}        -> 200 the order
//! ```
//!
//! Only a `placed` order can be paid or cancelled; anything else is `409 Conflict` and
//! records nothing.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use diesel::prelude::*;
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::pooled_connection::deadpool::{Object, Pool, PoolError};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use outbox_diesel::{AsyncOutboxExt, OutboxEvent};
use outbox_nats::cli::NatsArgs;
use outbox_nats::{Relay, RelayConfig, redact_url};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// An order service that records its events in a transactional outbox and relays them to
/// NATS JetStream.
#[derive(Debug, Parser)]
#[command(name = "shop")]
struct Args {
    /// PostgreSQL URL; the database is created when missing.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/outbox_shop",
        hide_env_values = true
    )]
    database_url: String,
    /// NATS: `--nats-url` (a seed list too), credentials and TLS, as `outbox-relay` takes them.
    #[command(flatten)]
    nats: NatsArgs,
    /// Address the HTTP API listens on.
    #[arg(long, env = "SHOP_ADDR", default_value = "127.0.0.1:3000")]
    addr: SocketAddr,
    /// JetStream stream the relay publishes to (created when missing).
    #[arg(long, env = "OUTBOX_STREAM", default_value = "OUTBOX")]
    stream: String,
    /// First subject token: events go to `{prefix}.order.{id}`.
    #[arg(long, env = "OUTBOX_SUBJECT_PREFIX", default_value = "outbox")]
    subject_prefix: String,
    /// Place, pay and cancel a few orders at start-up, to see events flow without curl.
    #[arg(long, env = "SHOP_DEMO", value_parser = clap::builder::FalseyValueParser::new(), num_args = 0, default_missing_value = "true")]
    demo: bool,
}

// ---------------------------------------------------------------------------------------------
// The domain: orders and their events
// ---------------------------------------------------------------------------------------------

diesel::table! {
    orders (id) {
        id -> BigInt,
        customer -> Text,
        items -> Jsonb,
        total_cents -> BigInt,
        status -> Text,
        created_at -> Timestamptz,
        updated_at -> Timestamptz,
    }
}

const ORDERS_DDL: &str = "
    CREATE TABLE IF NOT EXISTS orders (
        id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        customer    text        NOT NULL,
        items       jsonb       NOT NULL,
        total_cents bigint      NOT NULL CHECK (total_cents >= 0),
        status      text        NOT NULL DEFAULT 'placed'
                                CHECK (status IN ('placed', 'paid', 'cancelled')),
        created_at  timestamptz NOT NULL DEFAULT now(),
        updated_at  timestamptz NOT NULL DEFAULT now()
    )";

const PLACED: &str = "placed";
const PAID: &str = "paid";
const CANCELLED: &str = "cancelled";

#[derive(Debug, Serialize, Queryable, Selectable)]
#[diesel(table_name = orders, check_for_backend(diesel::pg::Pg))]
struct Order {
    id: i64,
    customer: String,
    items: serde_json::Value,
    total_cents: i64,
    status: String,
    created_at: chrono::DateTime<chrono::Utc>,
    updated_at: chrono::DateTime<chrono::Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Item {
    sku: String,
    quantity: u32,
    price_cents: i64,
}

#[derive(Debug, Deserialize)]
struct NewOrder {
    customer: String,
    items: Vec<Item>,
}

#[derive(Debug, Default, Deserialize)]
struct Cancel {
    reason: Option<String>,
}

/// Everything that happens to an order. Each variant is one event type; the payload is the
/// variant's fields (`untagged`: the type travels in the `Outbox-Event-Type` header).
#[derive(Debug, Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
#[serde(untagged)]
enum OrderEvent {
    #[outbox(event_type = "order.placed")]
    Placed {
        #[outbox(aggregate_id)]
        order_id: i64,
        customer: String,
        items: Vec<Item>,
        total_cents: i64,
    },
    #[outbox(event_type = "order.paid")]
    Paid {
        #[outbox(aggregate_id)]
        order_id: i64,
        total_cents: i64,
    },
    #[outbox(event_type = "order.cancelled")]
    Cancelled {
        #[outbox(aggregate_id)]
        order_id: i64,
        reason: Option<String>,
    },
}

/// What a request can fail with; each maps to an HTTP status.
#[derive(Debug)]
enum ShopError {
    Invalid(String),
    NotFound(i64),
    Conflict(String),
    Unavailable(PoolError),
    Database(diesel::result::Error),
}

impl From<diesel::result::Error> for ShopError {
    fn from(e: diesel::result::Error) -> Self {
        ShopError::Database(e)
    }
}

impl From<PoolError> for ShopError {
    fn from(e: PoolError) -> Self {
        ShopError::Unavailable(e)
    }
}

impl IntoResponse for ShopError {
    fn into_response(self) -> Response {
        let (status, message) = match self {
            ShopError::Invalid(m) => (StatusCode::UNPROCESSABLE_ENTITY, m),
            ShopError::NotFound(id) => (StatusCode::NOT_FOUND, format!("no order {id}")),
            ShopError::Conflict(m) => (StatusCode::CONFLICT, m),
            ShopError::Unavailable(e) => {
                warn!(error = %e, "no database connection");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the database is not available".into(),
                )
            }
            ShopError::Database(e) => {
                error!(error = %e, "database error");
                (StatusCode::INTERNAL_SERVER_ERROR, "internal error".into())
            }
        };
        (status, Json(serde_json::json!({ "error": message }))).into_response()
    }
}

/// The order service: each method is one business transaction.
#[derive(Clone)]
struct Shop {
    pool: Pool<AsyncPgConnection>,
}

impl Shop {
    async fn conn(&self) -> Result<Object<AsyncPgConnection>, ShopError> {
        Ok(self.pool.get().await?)
    }

    async fn place(&self, new: NewOrder) -> Result<Order, ShopError> {
        let customer = new.customer.trim().to_owned();
        if customer.is_empty() {
            return Err(ShopError::Invalid("customer must not be empty".into()));
        }
        if new.items.is_empty() {
            return Err(ShopError::Invalid(
                "an order needs at least one item".into(),
            ));
        }
        let mut total_cents: i64 = 0;
        for item in &new.items {
            if item.sku.trim().is_empty() || item.quantity == 0 || item.price_cents < 0 {
                return Err(ShopError::Invalid(format!(
                    "item {:?}: needs a sku, a quantity above 0 and a price_cents of 0 or more",
                    item.sku
                )));
            }
            total_cents = i64::from(item.quantity)
                .checked_mul(item.price_cents)
                .and_then(|line| total_cents.checked_add(line))
                .ok_or_else(|| ShopError::Invalid("the total is too large".into()))?;
        }
        let items = serde_json::to_value(&new.items)
            .map_err(|e| ShopError::Invalid(format!("items: {e}")))?;

        let mut conn = self.conn().await?;
        conn.transaction(async |conn| {
            // The INSERT creates (and so locks) the order's row ...
            let order = diesel::insert_into(orders::table)
                .values((
                    orders::customer.eq(&customer),
                    orders::items.eq(&items),
                    orders::total_cents.eq(total_cents),
                ))
                .returning(Order::as_returning())
                .get_result(conn)
                .await?;
            // ... and the event is the last write of the same transaction.
            conn.record_event(&OrderEvent::Placed {
                order_id: order.id,
                customer: order.customer.clone(),
                items: new.items.clone(),
                total_cents,
            })
            .await?;
            Ok(order)
        })
        .await
    }

    async fn pay(&self, id: i64) -> Result<Order, ShopError> {
        let mut conn = self.conn().await?;
        conn.transaction(async |conn| {
            let order = set_status(conn, id, PAID).await?;
            conn.record_event(&OrderEvent::Paid {
                order_id: id,
                total_cents: order.total_cents,
            })
            .await?;
            Ok(order)
        })
        .await
    }

    async fn cancel(&self, id: i64, reason: Option<String>) -> Result<Order, ShopError> {
        let mut conn = self.conn().await?;
        conn.transaction(async |conn| {
            let order = set_status(conn, id, CANCELLED).await?;
            conn.record_event(&OrderEvent::Cancelled {
                order_id: id,
                reason,
            })
            .await?;
            Ok(order)
        })
        .await
    }

    async fn get(&self, id: i64) -> Result<Order, ShopError> {
        let mut conn = self.conn().await?;
        orders::table
            .find(id)
            .select(Order::as_select())
            .first(&mut conn)
            .await
            .optional()?
            .ok_or(ShopError::NotFound(id))
    }
}

/// Moves a `placed` order to `status`, inside the caller's transaction.
///
/// `SELECT ... FOR UPDATE` locks the order's row before anything is written: a concurrent
/// change of the same order waits here until this transaction commits, so the two record
/// their events, and commit, one after the other. That is what keeps one order's events in
/// order on the stream.
async fn set_status(
    conn: &mut AsyncPgConnection,
    id: i64,
    status: &'static str,
) -> Result<Order, ShopError> {
    let current: String = orders::table
        .find(id)
        .select(orders::status)
        .for_update()
        .first(conn)
        .await
        .optional()?
        .ok_or(ShopError::NotFound(id))?;
    if current != PLACED {
        return Err(ShopError::Conflict(format!(
            "order {id} is {current}; only a placed order can become {status}"
        )));
    }
    Ok(diesel::update(orders::table.find(id))
        .set((
            orders::status.eq(status),
            orders::updated_at.eq(diesel::dsl::now),
        ))
        .returning(Order::as_returning())
        .get_result(conn)
        .await?)
}

// ---------------------------------------------------------------------------------------------
// HTTP
// ---------------------------------------------------------------------------------------------

fn router(shop: Shop) -> Router {
    Router::new()
        .route("/orders", post(place_order))
        .route("/orders/{id}", get(get_order))
        .route("/orders/{id}/pay", post(pay_order))
        .route("/orders/{id}/cancel", post(cancel_order))
        .with_state(shop)
}

async fn place_order(
    State(shop): State<Shop>,
    Json(new): Json<NewOrder>,
) -> Result<(StatusCode, Json<Order>), ShopError> {
    Ok((StatusCode::CREATED, Json(shop.place(new).await?)))
}

async fn pay_order(
    State(shop): State<Shop>,
    Path(id): Path<i64>,
) -> Result<Json<Order>, ShopError> {
    Ok(Json(shop.pay(id).await?))
}

async fn cancel_order(
    State(shop): State<Shop>,
    Path(id): Path<i64>,
    body: Option<Json<Cancel>>,
) -> Result<Json<Order>, ShopError> {
    let Json(cancel) = body.unwrap_or_default();
    Ok(Json(shop.cancel(id, cancel.reason).await?))
}

async fn get_order(
    State(shop): State<Shop>,
    Path(id): Path<i64>,
) -> Result<Json<Order>, ShopError> {
    Ok(Json(shop.get(id).await?))
}

// ---------------------------------------------------------------------------------------------
// Start-up: database, NATS, relay, server
// ---------------------------------------------------------------------------------------------

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    logs::init();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shop: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let relay_config = RelayConfig::new(args.database_url.clone())
        .stream(args.stream.clone())
        .subject_prefix(args.subject_prefix.clone())
        .startup_timeout(Duration::from_secs(10));
    relay_config.validate().map_err(|e| {
        anyhow!(
            "{e} (set with --stream / OUTBOX_STREAM and --subject-prefix / OUTBOX_SUBJECT_PREFIX)"
        )
    })?;

    let url = args.database_url.clone();
    tokio::task::spawn_blocking(move || database::prepare(&url, "DATABASE_URL", &[ORDERS_DDL]))
        .await
        .context("database set-up task")??;
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new(&args.database_url);
    let pool = Pool::builder(manager)
        .max_size(8)
        .build()
        .context("database pool")?;
    let shop = Shop { pool };

    let nats = connect_nats(&args.nats).await?;
    let listener = tokio::net::TcpListener::bind(args.addr).await.map_err(|e| {
        anyhow!(
            "cannot listen on {}: {e}. Stop whatever uses it, or set SHOP_ADDR=127.0.0.1:<another port>",
            args.addr
        )
    })?;
    print_guide(&args);

    // `shutdown`: a signal (or a failed relay) stops the HTTP server; `stop_relay` follows once
    // the server has drained, so the relay outlives the last request's commit.
    let shutdown = CancellationToken::new();
    let stop_relay = CancellationToken::new();
    let signals = tokio::spawn(watch_signals(shutdown.clone()));
    let relay = tokio::spawn({
        let (relay, stop, shutdown) = (
            Relay::new(relay_config, nats),
            stop_relay.clone(),
            shutdown.clone(),
        );
        async move {
            let result = relay.run(stop).await;
            shutdown.cancel();
            result
        }
    });
    let demo = args
        .demo
        .then(|| tokio::spawn(demo(shop.clone(), shutdown.clone())));

    let served = axum::serve(listener, router(shop))
        .with_graceful_shutdown(shutdown.clone().cancelled_owned())
        .await;
    shutdown.cancel();
    stop_relay.cancel();
    if let Some(demo) = demo {
        let _ = demo.await;
    }
    let relayed = tokio::time::timeout(Duration::from_secs(15), relay).await;
    signals.abort();
    served.context("HTTP server")?;
    match relayed {
        Ok(Ok(Ok(()))) => {
            info!("shop stopped");
            Ok(())
        }
        Ok(Ok(Err(e))) => bail!("the outbox relay stopped: {e}"),
        Ok(Err(e)) => bail!("the outbox relay task failed: {e}"),
        Err(_) => bail!("the outbox relay did not stop within 15 s"),
    }
}

#[path = "support/database.rs"]
mod database;
#[path = "support/logs.rs"]
mod logs;

async fn connect_nats(nats: &NatsArgs) -> anyhow::Result<async_nats::Client> {
    let url = &nats.nats_url;
    let hint = "Start nats-server with JetStream (`nats-server -js`), or set NATS_URL=nats://HOST:PORT \
                (default nats://127.0.0.1:4222)";
    let client = match nats.options().connect().await {
        Ok(client) => client,
        Err(outbox_nats::ConnectError::Connect { source, .. }) => {
            bail!(
                "cannot reach NATS at {}: {source}.\n  {hint}",
                redact_url(url)
            )
        }
        Err(e) => bail!("{e}"),
    };
    // Any answer on JetStream's API subject means JetStream is on; no responders means off.
    let probe = client.request("$JS.API.INFO", bytes::Bytes::new());
    match tokio::time::timeout(Duration::from_secs(5), probe).await {
        Ok(Ok(_)) => Ok(client),
        Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => bail!(
            "NATS at {} runs without JetStream.\n  {hint}",
            redact_url(url)
        ),
        Ok(Err(e)) => bail!("NATS at {} did not answer: {e}.\n  {hint}", redact_url(url)),
        Err(_) => bail!(
            "NATS at {} did not answer within 5 s.\n  {hint}",
            redact_url(url)
        ),
    }
}

/// The first Ctrl-C / SIGTERM stops gracefully; a second one exits at once.
async fn watch_signals(shutdown: CancellationToken) {
    tokio::select! {
        () = signal() => {}
        () = shutdown.cancelled() => return,
    }
    eprintln!(
        "shop: stopping (finishing requests and in-flight publishes); signal again to exit now"
    );
    shutdown.cancel();
    signal().await;
    eprintln!("shop: exiting now; unpublished events stay in the outbox for the next start");
    std::process::exit(130);
}

async fn signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

fn print_guide(args: &Args) {
    let base = format!("http://{}", args.addr);
    let consumer = if args.stream == "OUTBOX" && args.subject_prefix == "outbox" {
        "cargo run --example consumer".to_owned()
    } else {
        format!(
            "cargo run --example consumer -- --stream {} --filter '{}.>'",
            args.stream, args.subject_prefix
        )
    };
    let place = format!(
        "curl -s -X POST {base}/orders -H 'content-type: application/json' \\\n       \
         -d '{{\"customer\":\"ada\",\"items\":[{{\"sku\":\"tea\",\"quantity\":2,\"price_cents\":450}}]}}'"
    );
    // the commands work as printed, in this order, whatever orders exist already: each one
    // uses the id the placing request returned
    println!(
        "\
shop listening on {base}
  database {db}, NATS {nats}, stream {stream} (subjects {prefix}.order.<id>)

Try it in another terminal (the shop keeps serving until Ctrl-C); run these in order:
Place an order and pay it:
  ID=$({place} | grep -o '\"id\":[0-9]*' | cut -d: -f2)
  curl -s -w '\\n' -X POST {base}/orders/$ID/pay
Place another and cancel it (only a placed order can be paid or cancelled):
  ID=$({place} | grep -o '\"id\":[0-9]*' | cut -d: -f2)
  curl -s -w '\\n' -X POST {base}/orders/$ID/cancel -H 'content-type: application/json' -d '{{\"reason\":\"changed my mind\"}}'
Read it:
  curl -s -w '\\n' {base}/orders/$ID
Watch the events, in another terminal:
  {consumer}
Stop the shop with Ctrl-C.
",
        db = redact_url(&args.database_url),
        nats = redact_url(&args.nats.nats_url),
        stream = args.stream,
        prefix = args.subject_prefix,
    );
}

/// Places a few orders and moves them along, as a client would, so events flow at once.
async fn demo(shop: Shop, shutdown: CancellationToken) {
    let customers = [
        ("ada", "tea", 2, 450),
        ("grace", "coffee", 1, 380),
        ("alan", "scone", 3, 275),
    ];
    for (n, (customer, sku, quantity, price_cents)) in customers.into_iter().enumerate() {
        if shutdown.is_cancelled() {
            return;
        }
        let new = NewOrder {
            customer: customer.into(),
            items: vec![Item {
                sku: sku.into(),
                quantity,
                price_cents,
            }],
        };
        let result = async {
            let order = shop.place(new).await?;
            println!(
                "demo: placed order {} for {customer} ({} cents)",
                order.id, order.total_cents
            );
            let order = if n == 1 {
                shop.cancel(order.id, Some("demo: changed my mind".into()))
                    .await?
            } else {
                shop.pay(order.id).await?
            };
            println!("demo: order {} is {}", order.id, order.status);
            Ok::<_, ShopError>(())
        };
        if let Err(e) = result.await {
            warn!(error = ?e, "demo order failed");
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(300)) => {}
            () = shutdown.cancelled() => return,
        }
    }
    println!("demo: done; watch the events with `cargo run --example consumer`");
}
