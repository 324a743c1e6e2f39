//! How a publish ended: a batch's end, and the sorting of JetStream's errors into the fence,
//! the row's fault, the stream's refusal and NATS's failure, which decide whether a row is
//! counted against, parked, or only retried.

use std::sync::atomic::Ordering;

use async_nats::jetstream;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use tracing::{error, warn};

use crate::health::Health;
use crate::metrics as m;

/// How a batch ended.
#[derive(Debug)]
pub(crate) enum BatchEnd {
    /// Every row sent was acked (or shutdown stopped it).
    Done,
    /// NATS failed in a way a retry may fix: back off.
    Transient,
    /// The lease may have lapsed: stop sending until the database confirms it.
    LeaseUnconfirmed,
    /// JetStream refused a message because its subject holds a newer one than the relay
    /// expected (see [`fence`](crate::fence)): no fault of the row. Stop, forget what was
    /// known of the subjects, check the session and read the rows again.
    Fenced,
    /// A row failed in a way that is about the row: count it, maybe park it.
    RowFailed {
        seq: i64,
        attempts: i32,
        error: String,
        park_now: bool,
    },
}

/// Sorts a publish error into "the fence" (a newer message on the subject of a fenced
/// publish: checked again, never counted against the row), "about this row" (counted, parked
/// after enough attempts), "about the stream" (JetStream refuses every message: retried after
/// a backoff, never counted against a row, the relay not ready meanwhile) and "about NATS"
/// (retried after a backoff). Counted always; logged when `report` (the batch's first
/// failure).
pub(crate) fn classify(
    seq: i64,
    attempts: i32,
    e: &PublishError,
    fence_only: bool,
    report: bool,
    health: &Health,
) -> BatchEnd {
    if fence_only && matches!(e.kind(), PublishErrorKind::WrongLastSequence) {
        metrics::counter!(m::PUBLISH_ERRORS, "kind" => "fenced").increment(1);
        metrics::counter!(m::EVENTS_FENCED).increment(1);
        if report {
            warn!(outbox.seq = seq, error = %e, "JetStream refused the event: its subject holds a newer message than this relay expected (another relay published it, or the event was stored before); nothing is parked, the relay checks its lease and reads the rows again");
        }
        return BatchEnd::Fenced;
    }
    let api_error = std::error::Error::source(e).and_then(|s| s.downcast_ref::<jetstream::Error>());
    let (kind, permanent) = match (e.kind(), api_error) {
        (PublishErrorKind::MaxPayloadExceeded, _) => ("max_payload", true),
        (PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence, _) => {
            ("rejected", true)
        }
        (PublishErrorKind::Other, Some(api)) if is_row_fault(api.error_code()) => {
            ("rejected", true)
        }
        (PublishErrorKind::Other, Some(_)) => ("stream_rejected", false),
        (PublishErrorKind::TimedOut, _) => ("timeout", false),
        (PublishErrorKind::StreamNotFound, _) => ("no_stream", false),
        (PublishErrorKind::BrokenPipe, _) => ("broken_pipe", false),
        _ => ("other", false),
    };
    metrics::counter!(m::PUBLISH_ERRORS, "kind" => kind).increment(1);
    if permanent {
        return BatchEnd::RowFailed {
            seq,
            attempts,
            error: e.to_string(),
            park_now: matches!(e.kind(), PublishErrorKind::MaxPayloadExceeded),
        };
    }
    if kind == "stream_rejected" {
        health.stream_refused.store(true, Ordering::Relaxed);
        if report {
            error!(outbox.seq = seq, error = %e, "JetStream refuses to store messages in the stream (a limit reached with discard new, storage or account limits, a sealed stream); nothing is parked, the relay retries with backoff until the stream accepts messages again");
        }
    } else if report {
        warn!(outbox.seq = seq, error = %e, kind, "publish failed; the batch stops here and is retried");
    }
    BatchEnd::Transient
}

/// Whether a JetStream error code of a publish is about the message itself (its size or the
/// headers it carries), so that other messages may still be stored; every other code is about
/// the stream (its limits with `discard: new`, storage, account limits, a sealed, offline or
/// missing stream), which refuses every message alike. The codes are nats-server's
/// (`server/errors.json`).
pub(crate) fn is_row_fault(code: jetstream::ErrorCode) -> bool {
    matches!(
        code.0,
        // message size exceeds the stream's maximum; header size exceeds 64k
        10054 | 10097
        // the row's own headers: expected stream, last sequence or message id
        | 10060 | 10063 | 10070 | 10071 | 10164 | 10193
        // the row's own headers: per-message TTL, counters, schedules
        | 10165 | 10166 | 10168..=10172 | 10188..=10192 | 10203 | 10212 | 10223
        // the row's own headers: atomic and batch publishing
        | 10174..=10177 | 10179 | 10199..=10201 | 10205..=10208
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fenced_refusal_is_no_row_fault_and_other_wrong_sequences_still_are() {
        let health = Health::default();
        let wrong = PublishError::new(PublishErrorKind::WrongLastSequence);
        assert!(matches!(
            classify(1, 0, &wrong, true, true, &health),
            BatchEnd::Fenced
        ));
        // the row's own Nats-Expected-Last-Sequence (or no fence): the row's fault, as before
        assert!(matches!(
            classify(1, 0, &wrong, false, true, &health),
            BatchEnd::RowFailed {
                park_now: false,
                ..
            }
        ));
        let timeout = PublishError::new(PublishErrorKind::TimedOut);
        assert!(matches!(
            classify(1, 0, &timeout, true, true, &health),
            BatchEnd::Transient
        ));
    }

    #[test]
    fn stream_limits_are_not_row_faults_and_message_faults_are() {
        use jetstream::ErrorCode;
        for stream_wide in [
            ErrorCode::STREAM_STORE_FAILED, // maximum messages / bytes exceeded
            ErrorCode::STORAGE_RESOURCES_EXCEEDED, // account storage
            ErrorCode::INSUFFICIENT_RESOURCES,
            ErrorCode::STREAM_SEALED,
            ErrorCode(10028), // account memory
            ErrorCode(10002), // account resources
            ErrorCode(10059), // stream not found
            ErrorCode(10118), // stream offline
        ] {
            assert!(!is_row_fault(stream_wide), "{stream_wide:?}");
        }
        for row in [
            ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM,
            ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM,
            ErrorCode(10166), // a Nats-TTL header on a stream without per-message TTL
        ] {
            assert!(is_row_fault(row), "{row:?}");
        }
    }
}
