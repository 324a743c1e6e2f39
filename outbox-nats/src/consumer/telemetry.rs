//! The consumer's metrics, named `outbox_consumer_*`, labelled with the durable name.

/// Counter: messages the consumer finished with, by `consumer` and `outcome` (`handled`,
/// `duplicate`, `skipped`, `handler_error`, `database_error`, `undecodable`, `terminated`).
pub const MESSAGES: &str = "outbox_consumer_messages_total";
/// Histogram: seconds from the start of a message's transaction to its end, by `consumer`.
pub const HANDLE_SECONDS: &str = "outbox_consumer_handle_seconds";
/// Counter: acks, naks and terms that could not be sent, by `consumer`.
pub const ACK_ERRORS: &str = "outbox_consumer_ack_errors_total";

pub(super) fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(
        MESSAGES,
        Unit::Count,
        "Messages the consumer finished with, by outcome"
    );
    describe_histogram!(
        HANDLE_SECONDS,
        Unit::Seconds,
        "Time spent in a message's transaction"
    );
    describe_counter!(
        ACK_ERRORS,
        Unit::Count,
        "Acks, naks and terms that could not be sent"
    );
}
