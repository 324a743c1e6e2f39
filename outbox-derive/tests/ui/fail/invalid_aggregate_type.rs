use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order.line")]
struct Dot(#[outbox(aggregate_id)] i64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order*")]
struct Star(#[outbox(aggregate_id)] i64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = ">")]
struct Gt(#[outbox(aggregate_id)] i64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "sales order")]
struct Space(#[outbox(aggregate_id)] i64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order\u{7}")]
struct Control(#[outbox(aggregate_id)] i64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "")]
struct Empty(#[outbox(aggregate_id)] i64);

fn main() {}
