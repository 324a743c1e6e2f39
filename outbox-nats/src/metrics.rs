//! Metric names. Every metric goes through the `metrics` facade; the binary exports them in
//! Prometheus format on `--metrics-addr`.

/// Counter: events acked by JetStream.
pub const EVENTS_PUBLISHED: &str = "outbox_events_published_total";
/// Counter: rows in doubt found in the stream before a re-publish, and marked (or, with log
/// tailing, confirmed) instead of published again.
pub const EVENTS_RECONCILED: &str = "outbox_events_reconciled_total";
/// Counter (ordered modes): publishes JetStream refused because their subject held a newer
/// message than the relay expected (the fence, see `outbox_nats::fence`); the rows are read
/// again, never parked for it.
pub const EVENTS_FENCED: &str = "outbox_events_fenced_total";
/// Counter: acks that JetStream flagged as duplicates (already in the stream).
pub const DUPLICATES: &str = "outbox_duplicates_total";
/// Counter: failed publishes, by `kind`.
pub const PUBLISH_ERRORS: &str = "outbox_publish_errors_total";
/// Counter: rows parked.
pub const ROWS_PARKED: &str = "outbox_rows_parked_total";
/// Histogram: seconds from recording to JetStream's ack.
pub const COMMIT_TO_ACK: &str = "outbox_commit_to_ack_seconds";
/// Histogram: rows per batch.
pub const BATCH_ROWS: &str = "outbox_batch_rows";
/// Counter (ordered mode): late passes started: a transaction committed more rows at or below
/// a partition's cursor than a batch holds, and they are read in parts (see
/// `outbox_diesel::relay::LatePass`).
pub const LATE_PASSES: &str = "outbox_late_passes_total";
/// Gauge: partitions this relay owns.
pub const PARTITIONS_OWNED: &str = "outbox_partitions_owned";
/// Gauge: unpublished rows.
pub const BACKLOG_ROWS: &str = "outbox_backlog_rows";
/// Gauge: seconds since the oldest unpublished row was recorded.
pub const OLDEST_AGE: &str = "outbox_oldest_unpublished_age_seconds";
/// Gauge: parked rows.
pub const PARKED_ROWS: &str = "outbox_parked_rows";
/// Gauge: 1 when the oldest unpublished row is older than `--stall-after`.
pub const STALLED: &str = "outbox_stalled";
/// Gauge: 1 when the oldest unpublished row is older than the stream's duplicate window.
pub const BEYOND_DUPLICATE_WINDOW: &str = "outbox_backlog_beyond_duplicate_window";
/// Gauge: unpublished rows whose publishing failed at least once (`attempts > 0`).
pub const IN_DOUBT_ROWS: &str = "outbox_in_doubt_rows";
/// Gauge: seconds since the oldest in-doubt row was recorded.
pub const OLDEST_IN_DOUBT_AGE: &str = "outbox_oldest_in_doubt_age_seconds";
/// Gauge, by `partition` (ordered mode with `--partitions` above 1): unpublished rows.
pub const PARTITION_BACKLOG_ROWS: &str = "outbox_partition_backlog_rows";
/// Gauge, by `partition` (ordered mode with `--partitions` above 1): seconds since the
/// partition's oldest unpublished row was recorded.
pub const PARTITION_OLDEST_AGE: &str = "outbox_partition_oldest_unpublished_age_seconds";
/// Counter: published rows deleted (or archived) by cleanup.
pub const CLEANUP_DELETED: &str = "outbox_cleanup_rows_deleted_total";
/// Counter: partitions of a rotated table emptied whole by cleanup (`TRUNCATE`).
pub const CLEANUP_TRUNCATED: &str = "outbox_cleanup_partitions_truncated_total";
/// Histogram: seconds a cleanup round took, for rounds that removed rows.
pub const CLEANUP_DURATION: &str = "outbox_cleanup_duration_seconds";
/// Gauge: 1 while this relay reads the table's backlog figures for every relay of the table
/// (the others set their backlog gauges from what it sends).
pub const STATISTICS_READER: &str = "outbox_statistics_reader";
/// Gauge: when the backlog figures this relay reports were read (Unix time, seconds), by it or
/// by the relay that reads them for the table: `time() - outbox_statistics_read_timestamp_seconds`
/// is their age, which grows while no reading comes (a reading spaced after a slow one, a
/// statistics session that cannot reach the database).
pub const STATISTICS_READ_AT: &str = "outbox_statistics_read_timestamp_seconds";
/// Gauge: 1 while the NATS connection is up.
pub const NATS_CONNECTED: &str = "outbox_nats_connected";
/// Gauge: 1 while the relay is ready (what `/readyz` answers).
pub const READY: &str = "outbox_ready";

/// Gauge (log-tailing mode): bytes of WAL written since the slot's confirmed position.
pub const SLOT_LAG_BYTES: &str = "outbox_slot_lag_bytes";
/// Gauge (log-tailing mode): seconds since the oldest transaction read from the slot and not
/// yet confirmed committed; 0 when the reader has confirmed everything it read.
pub const SLOT_LAG_SECONDS: &str = "outbox_slot_lag_seconds";
/// Gauge (log-tailing mode): bytes of WAL the slot keeps on disk.
pub const SLOT_RETAINED_BYTES: &str = "outbox_slot_retained_bytes";
/// Gauge (log-tailing mode): 1 when the slot lags past `--slot-lag-warn-bytes` or
/// `--stall-after`.
pub const SLOT_LAGGING: &str = "outbox_slot_lagging";
/// Gauge (log-tailing mode): 1 while this relay is the slot's reader.
pub const SLOT_READER: &str = "outbox_slot_reader";
/// Counter (log-tailing mode): captured rows deleted from the table.
pub const CAPTURED_DELETED: &str = "outbox_captured_rows_deleted_total";

/// Registers the descriptions of every metric, and the counters without labels at zero: a
/// counter that exists from the start gives `rate()` and dashboards a series before its first
/// event (a duplicate, a parked row) instead of "no data".
pub fn describe() {
    use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram};
    for name in [
        EVENTS_PUBLISHED,
        EVENTS_RECONCILED,
        EVENTS_FENCED,
        DUPLICATES,
        ROWS_PARKED,
        CLEANUP_DELETED,
        CLEANUP_TRUNCATED,
        CAPTURED_DELETED,
    ] {
        counter!(name).increment(0);
    }
    describe_counter!(EVENTS_PUBLISHED, Unit::Count, "Events acked by JetStream");
    describe_counter!(
        EVENTS_RECONCILED,
        Unit::Count,
        "Rows in doubt found in the stream and marked instead of published again"
    );
    describe_counter!(
        EVENTS_FENCED,
        Unit::Count,
        "Publishes refused because their subject held a newer message than expected"
    );
    describe_counter!(
        DUPLICATES,
        Unit::Count,
        "Acks flagged duplicate by JetStream"
    );
    describe_counter!(PUBLISH_ERRORS, Unit::Count, "Failed publishes by kind");
    describe_counter!(
        ROWS_PARKED,
        Unit::Count,
        "Rows parked after failing for good"
    );
    describe_histogram!(
        COMMIT_TO_ACK,
        Unit::Seconds,
        "Time from recording to JetStream's ack"
    );
    describe_histogram!(BATCH_ROWS, Unit::Count, "Rows per batch");
    describe_gauge!(
        PARTITIONS_OWNED,
        Unit::Count,
        "Partitions owned by this relay"
    );
    describe_gauge!(BACKLOG_ROWS, Unit::Count, "Unpublished rows");
    describe_gauge!(
        OLDEST_AGE,
        Unit::Seconds,
        "Age of the oldest unpublished row"
    );
    describe_gauge!(PARKED_ROWS, Unit::Count, "Parked rows");
    describe_gauge!(
        STALLED,
        "1 when the oldest unpublished row is older than --stall-after"
    );
    describe_gauge!(
        SLOT_LAG_BYTES,
        Unit::Bytes,
        "WAL written since the slot's confirmed position"
    );
    describe_gauge!(
        SLOT_LAG_SECONDS,
        Unit::Seconds,
        "Age of the oldest unconfirmed transaction read from the slot"
    );
    describe_gauge!(
        SLOT_RETAINED_BYTES,
        Unit::Bytes,
        "WAL the slot keeps on disk"
    );
    describe_gauge!(
        SLOT_LAGGING,
        "1 when the slot lags past --slot-lag-warn-bytes or --stall-after"
    );
    describe_gauge!(SLOT_READER, "1 while this relay reads the slot");
    describe_gauge!(
        STATISTICS_READER,
        "1 while this relay reads the backlog figures for every relay of the table"
    );
    describe_gauge!(
        STATISTICS_READ_AT,
        Unit::Seconds,
        "When the backlog figures this relay reports were read (Unix time)"
    );
    describe_counter!(
        CAPTURED_DELETED,
        Unit::Count,
        "Captured rows deleted by log tailing"
    );
    describe_gauge!(
        BEYOND_DUPLICATE_WINDOW,
        "1 when the backlog is older than the duplicate window"
    );
    describe_gauge!(
        IN_DOUBT_ROWS,
        Unit::Count,
        "Unpublished rows whose publishing failed at least once"
    );
    describe_gauge!(
        OLDEST_IN_DOUBT_AGE,
        Unit::Seconds,
        "Age of the oldest in-doubt row"
    );
    describe_gauge!(
        PARTITION_BACKLOG_ROWS,
        Unit::Count,
        "Unpublished rows per partition"
    );
    describe_gauge!(
        PARTITION_OLDEST_AGE,
        Unit::Seconds,
        "Age of the oldest unpublished row per partition"
    );
    describe_counter!(
        CLEANUP_DELETED,
        Unit::Count,
        "Published rows deleted or archived by cleanup"
    );
    describe_counter!(
        CLEANUP_TRUNCATED,
        Unit::Count,
        "Partitions of a rotated outbox table emptied by cleanup"
    );
    describe_histogram!(
        CLEANUP_DURATION,
        Unit::Seconds,
        "Duration of cleanup rounds that removed rows"
    );
    describe_gauge!(NATS_CONNECTED, "1 while the NATS connection is up");
    describe_gauge!(READY, "1 while the relay is ready (/readyz)");
}
