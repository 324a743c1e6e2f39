use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    order_id: i64,
    #[outbox(aggregate_id)]
    customer_id: i64,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
enum OrderEvent {
    Moved(#[outbox(aggregate_id)] i64, #[outbox(aggregate_id)] i64, #[outbox(aggregate_id)] i64),
}

fn main() {}
