use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(agregate_type = "order", serialize_with = "x")]
struct OrderPlaced {
    #[outbox(agregate_id)]
    order_id: i64,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", aggregate = "order")]
enum OrderEvent {
    #[outbox(evnt_type = "order.placed")]
    Placed(#[outbox(aggregate_id, skip)] i64),
    #[outbox(outbox::event_type = "order.cancelled")]
    Cancelled(#[outbox(aggregate_id)] i64),
}

fn main() {}
