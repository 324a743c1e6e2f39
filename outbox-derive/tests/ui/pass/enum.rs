use outbox_diesel::OutboxEvent;
use serde::Serialize;
use std::fmt;

#[derive(Serialize, Clone, Copy, PartialEq, Debug)]
struct OrderId(u64);

impl fmt::Display for OrderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ord-{}", self.0)
    }
}

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", rename_all = "kebab-case")]
enum OrderEvent {
    Placed {
        #[outbox(aggregate_id)]
        id: OrderId,
        total: i64,
    },
    LineAdded {
        sku: String,
        #[outbox(aggregate_id)]
        order: OrderId,
    },
    #[outbox(event_type = "order.cancelled")]
    Cancelled(#[outbox(aggregate_id)] OrderId),
    Refunded(i64, #[outbox(aggregate_id)] OrderId, String),
}

// Default rule (snake_case), and an explicit event type that looks like a default one.
#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "cart")]
enum CartEvent {
    ItemAdded(#[outbox(aggregate_id)] u32),
    #[outbox(event_type = "checked_out")]
    CheckoutDone {
        #[outbox(aggregate_id)]
        cart: u32,
    },
}

// An enum without variants has no values; it still implements the trait.
#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "nothing")]
enum Never {}

fn main() {
    let id = OrderId(7);
    let events = [
        OrderEvent::Placed { id, total: 100 },
        OrderEvent::LineAdded { sku: "tea".into(), order: id },
        OrderEvent::Cancelled(id),
        OrderEvent::Refunded(100, id, "damaged".into()),
    ];
    let seen: Vec<(&str, &str, String)> = events
        .iter()
        .map(|e| (e.aggregate_type(), e.event_type(), e.aggregate_id()))
        .collect();
    assert_eq!(
        seen,
        [
            ("order", "placed", "ord-7".to_owned()),
            ("order", "line-added", "ord-7".to_owned()),
            ("order", "order.cancelled", "ord-7".to_owned()),
            ("order", "refunded", "ord-7".to_owned()),
        ]
    );
    assert_eq!(
        OrderEvent::event_types(),
        ["placed", "line-added", "order.cancelled", "refunded"]
    );
    if let OrderEvent::Placed { total, .. } = &events[0] {
        assert_eq!(*total, 100);
    }
    if let OrderEvent::LineAdded { sku, .. } = &events[1] {
        assert_eq!(sku, "tea");
    }
    if let OrderEvent::Refunded(amount, _, why) = &events[3] {
        assert_eq!((*amount, why.as_str()), (100, "damaged"));
    }

    assert_eq!(CartEvent::ItemAdded(1).event_type(), "item_added");
    assert_eq!(CartEvent::CheckoutDone { cart: 2 }.event_type(), "checked_out");
    assert_eq!(CartEvent::CheckoutDone { cart: 2 }.aggregate_id(), "2");
    assert_eq!(CartEvent::event_types(), ["item_added", "checked_out"]);

    assert_eq!(Never::event_types(), [] as [&str; 0]);
}
