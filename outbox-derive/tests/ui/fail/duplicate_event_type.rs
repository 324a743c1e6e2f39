use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", rename_all = "lowercase")]
enum OrderEvent {
    Placed(#[outbox(aggregate_id)] i64),
    #[outbox(event_type = "placed")]
    PlacedAgain(#[outbox(aggregate_id)] i64),
    LineAdded(#[outbox(aggregate_id)] i64),
    Lineadded(#[outbox(aggregate_id)] i64),
}

fn main() {}
