use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", event_type = "order.event")]
enum OrderEvent {
    Placed(#[outbox(aggregate_id)] i64),
    Cancelled(#[outbox(aggregate_id)] i64),
}

fn main() {}
