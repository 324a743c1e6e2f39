use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", rename_all = "kebab")]
enum OrderEvent {
    Placed(#[outbox(aggregate_id)] i64),
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", rename_all = "Title Case")]
struct OrderPlaced(#[outbox(aggregate_id)] i64);

fn main() {}
