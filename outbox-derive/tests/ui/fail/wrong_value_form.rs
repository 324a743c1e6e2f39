use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = order, event_type)]
struct NotAString {
    #[outbox(aggregate_id = true)]
    order_id: i64,
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type("order"), rename_all = 1, crate = "not a path")]
struct ListForm(#[outbox(aggregate_id("x"))] i64);

#[derive(Serialize, OutboxEvent)]
#[outbox]
#[outbox = "order"]
struct BareAttribute(#[outbox] i64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = )]
struct Syntax(#[outbox(aggregate_id)] i64);

fn main() {}
