use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", event_type = "order..placed")]
struct DoubleDot(#[outbox(aggregate_id)] i64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", event_type = ".placed")]
struct LeadingDot(#[outbox(aggregate_id)] i64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", event_type = "order.")]
struct TrailingDot(#[outbox(aggregate_id)] i64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", event_type = "")]
struct Empty(#[outbox(aggregate_id)] i64);

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order")]
enum OrderEvent {
    #[outbox(event_type = "order.>")]
    Wildcard(#[outbox(aggregate_id)] i64),
    #[outbox(event_type = "order\tplaced")]
    Tab(#[outbox(aggregate_id)] i64),
}

fn main() {}
