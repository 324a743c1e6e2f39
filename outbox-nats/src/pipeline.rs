//! Publishing one batch of rows: pipelined, in order, never two unacked messages of one
//! aggregate at once, stopping at the first failure.

use std::collections::HashSet;

use async_nats::jetstream::{self, context::PublishErrorKind};
use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use outbox_diesel::relay::OutboxRow;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::RelayConfig;
use crate::lease::Lease;
use crate::metrics as m;
use crate::publish::to_message;

/// How a batch ended.
#[derive(Debug)]
pub(crate) enum BatchEnd {
    /// Every row sent was acked (or shutdown stopped it).
    Done,
    /// NATS failed in a way a retry may fix: back off.
    Transient,
    /// The lease may have lapsed: stop sending until the database confirms it.
    LeaseUnconfirmed,
    /// A row failed in a way that is about the row: count it, maybe park it.
    RowFailed {
        seq: i64,
        attempts: i32,
        error: String,
        park_now: bool,
    },
}

/// Publishes `rows` in order. Returns the `seq` of the acked rows and how it ended.
///
/// JetStream stores one connection's pipeline in send order, but a failed publish leaves a
/// hole that its retry fills after the later messages: so a row is sent only when no earlier
/// row of its aggregate waits for its ack, and nothing is sent after a failure.
#[tracing::instrument(name = "outbox.publish", level = "debug", skip_all, fields(batch.len = rows.len()))]
pub(crate) async fn publish_batch(
    js: &jetstream::Context,
    cfg: &RelayConfig,
    rows: &[OutboxRow],
    lease: &Lease,
    shutdown: &CancellationToken,
) -> (Vec<i64>, BatchEnd) {
    metrics::histogram!(m::BATCH_ROWS).record(rows.len() as f64);
    let mut acked = Vec::with_capacity(rows.len());
    let mut in_flight = FuturesOrdered::new();
    let mut in_flight_aggregates: HashSet<(&str, &str)> = HashSet::new();
    let mut end = BatchEnd::Done;
    'rows: for (i, row) in rows.iter().enumerate() {
        if shutdown.is_cancelled() {
            break;
        }
        let key = (row.aggregate_type.as_str(), row.aggregate_id.as_str());
        while in_flight_aggregates.contains(&key) || in_flight.len() >= cfg.max_in_flight {
            let Some((j, result)) = in_flight.next().await else {
                break;
            };
            let done: &OutboxRow = &rows[j];
            in_flight_aggregates
                .remove(&(done.aggregate_type.as_str(), done.aggregate_id.as_str()));
            if let Some(failure) = on_ack(done, result, &mut acked) {
                end = failure;
                break 'rows;
            }
        }
        if !lease.is_valid() {
            // a paused or cut-off relay must not publish what a new owner may have taken
            end = BatchEnd::LeaseUnconfirmed;
            break;
        }
        let msg = match to_message(row, &cfg.subject_template, &cfg.subject_prefix) {
            Ok(m) => m,
            Err(e) => {
                metrics::counter!(m::PUBLISH_ERRORS, "kind" => "invalid_row").increment(1);
                end = BatchEnd::RowFailed {
                    seq: row.seq,
                    attempts: row.attempts,
                    error: e.to_string(),
                    park_now: true,
                };
                break;
            }
        };
        let publish = jetstream::message::PublishMessage::build()
            .payload(msg.payload)
            .headers(msg.headers);
        match js.send_publish(msg.subject, publish).await {
            Ok(ack) => {
                in_flight_aggregates.insert(key);
                in_flight.push_back(async move { (i, ack.await) });
            }
            Err(e) => {
                end = classify(row, &e);
                break;
            }
        }
    }
    while let Some((j, result)) = in_flight.next().await {
        if let Some(failure) = on_ack(&rows[j], result, &mut acked)
            && matches!(end, BatchEnd::Done | BatchEnd::LeaseUnconfirmed)
        {
            end = failure;
        }
    }
    (acked, end)
}

fn on_ack(
    row: &OutboxRow,
    result: Result<jetstream::publish::PublishAck, jetstream::context::PublishError>,
    acked: &mut Vec<i64>,
) -> Option<BatchEnd> {
    match result {
        Ok(ack) => {
            acked.push(row.seq);
            metrics::counter!(m::EVENTS_PUBLISHED).increment(1);
            if ack.duplicate {
                metrics::counter!(m::DUPLICATES).increment(1);
            }
            let latency = (chrono::Utc::now() - row.created_at)
                .to_std()
                .unwrap_or_default();
            metrics::histogram!(m::COMMIT_TO_ACK).record(latency.as_secs_f64());
            None
        }
        Err(e) => Some(classify(row, &e)),
    }
}

/// Sorts a publish error into "about this row" (counted, parked after enough attempts) and
/// "about NATS" (retried after a backoff, never counted against the row).
fn classify(row: &OutboxRow, e: &jetstream::context::PublishError) -> BatchEnd {
    let api_error = std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .is_some();
    let (kind, permanent) = match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => ("max_payload", true),
        PublishErrorKind::Other if api_error => ("rejected", true),
        PublishErrorKind::TimedOut => ("timeout", false),
        PublishErrorKind::StreamNotFound => ("no_stream", false),
        PublishErrorKind::BrokenPipe => ("broken_pipe", false),
        _ => ("other", false),
    };
    metrics::counter!(m::PUBLISH_ERRORS, "kind" => kind).increment(1);
    if permanent {
        BatchEnd::RowFailed {
            seq: row.seq,
            attempts: row.attempts,
            error: e.to_string(),
            park_now: matches!(e.kind(), PublishErrorKind::MaxPayloadExceeded),
        }
    } else {
        warn!(outbox.seq = row.seq, error = %e, kind, "publish failed; the batch stops here and is retried");
        BatchEnd::Transient
    }
}
