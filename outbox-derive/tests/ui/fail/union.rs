use outbox_diesel::OutboxEvent;

#[derive(OutboxEvent)]
#[outbox(aggregate_type = "order")]
union OrderId {
    number: u64,
    bytes: [u8; 8],
}

fn main() {}
