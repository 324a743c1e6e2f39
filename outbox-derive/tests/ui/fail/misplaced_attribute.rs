use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", aggregate_id)]
struct OrderPlaced {
    #[outbox(aggregate_id, event_type = "order.placed")]
    order_id: i64,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
enum OrderEvent {
    #[outbox(aggregate_type = "cart", rename_all = "kebab-case")]
    Placed(#[outbox(aggregate_id)] i64),
    // Reported once: not also as "no field is marked".
    #[outbox(aggregate_id)]
    Cancelled(i64),
}

fn main() {}
