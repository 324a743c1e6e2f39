use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
struct OrderPlaced {
    order_id: i64,
    total_cents: i64,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
enum OrderEvent {
    Placed {
        #[outbox(aggregate_id)]
        id: i64,
    },
    Cancelled(i64, String),
    Empty {},
}

fn main() {}
