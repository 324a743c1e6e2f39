//! The admin listener: `/metrics` (Prometheus), `/healthz` and `/readyz`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

use crate::health::Health;

/// Installs the Prometheus recorder as the process's `metrics` recorder, with buckets for the
/// latency and batch histograms.
pub fn install_recorder() -> Result<PrometheusHandle, metrics_exporter_prometheus::BuildError> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".into()),
            &[
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ],
        )?
        .set_buckets_for_metric(
            Matcher::Full(crate::metrics::BATCH_ROWS.into()),
            &[1.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0],
        )?
        .install_recorder()
}

/// Serves `/metrics`, `/healthz` (200 while the process runs) and `/readyz` (200 when the
/// relay is connected to PostgreSQL and NATS and owns work or stands by; 503 with the reason
/// otherwise) on `addr` until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    handle: PrometheusHandle,
    health: Arc<Health>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(move || std::future::ready(handle.render())))
        .route("/healthz", get(|| std::future::ready("ok")))
        .route(
            "/readyz",
            get(move || {
                std::future::ready(match health.not_ready_because() {
                    None => (StatusCode::OK, "ready".to_owned()),
                    Some(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")),
                })
            }),
        );
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}
