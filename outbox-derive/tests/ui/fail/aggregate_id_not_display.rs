use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize)]
struct OrderId(u64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    id: OrderId,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
enum OrderEvent {
    Cancelled(#[outbox(aggregate_id)] Vec<u8>),
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
struct Generic<Id> {
    #[outbox(aggregate_id)]
    id: Id,
}

fn main() {
    // The impl exists, but only for `Display` ids.
    let _ = Generic { id: OrderId(1) }.aggregate_id();
}
