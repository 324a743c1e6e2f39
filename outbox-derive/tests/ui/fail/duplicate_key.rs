use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", aggregate_type = "cart")]
#[outbox(event_type = "order.placed")]
#[outbox(event_type = "order.created", rename_all = "kebab-case", rename_all = "snake_case")]
struct OrderPlaced {
    #[outbox(aggregate_id, aggregate_id)]
    order_id: i64,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
enum OrderEvent {
    #[outbox(event_type = "order.placed")]
    #[outbox(event_type = "order.created")]
    Placed(#[outbox(aggregate_id)] i64),
}

fn main() {}
