use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(event_type = "order.placed")]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    order_id: i64,
}

#[derive(Serialize, OutboxEvent)]
enum OrderEvent {
    Placed(#[outbox(aggregate_id)] i64),
}

// Only the derive's errors: code using the types compiles against the fallback impl.
fn main() {
    let placed = OrderPlaced { order_id: 1 };
    let _ = (placed.aggregate_type(), placed.event_type(), placed.aggregate_id());
    let _ = OrderEvent::Placed(1).aggregate_id();
    let _ = OrderEvent::event_types();
}
