use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", event_type = "order.placed")]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    order_id: i64,
    total_cents: i64,
}

// Default event type: the name in snake_case.
#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "parcel")]
struct ParcelShipped {
    carrier: String,
    #[outbox(aggregate_id)]
    parcel: String,
}

// Tuple struct; the aggregate id need not be the first field.
#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "invoice", rename_all = "kebab-case")]
struct InvoicePaid(u32, #[outbox(aggregate_id)] u64);

// Several `#[outbox]` attributes combine; other attributes are left alone.
#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "user")]
#[serde(rename_all = "camelCase")]
#[outbox(event_type = "user.renamed.v2")]
struct UserRenamed<'a> {
    #[serde(rename = "id")]
    #[outbox(aggregate_id)]
    user_id: &'a str,
    new_name: &'a str,
}

// Input produced by `macro_rules!` (values arrive in invisible groups).
macro_rules! event {
    ($name:ident, $aggregate:expr, $event:expr) => {
        #[derive(Serialize, OutboxEvent)]
        #[outbox(aggregate_type = $aggregate, event_type = $event)]
        struct $name {
            #[outbox(aggregate_id)]
            id: u16,
        }
    };
}
event!(StockMoved, "stock", "stock.moved");

// Works through a generic bound.
fn describe<E: OutboxEvent>(event: &E) -> String {
    format!("{}/{}/{}", event.aggregate_type(), event.event_type(), event.aggregate_id())
}

fn main() {
    let placed = OrderPlaced { order_id: 42, total_cents: 1250 };
    assert_eq!(placed.aggregate_type(), "order");
    assert_eq!(placed.event_type(), "order.placed");
    assert_eq!(placed.aggregate_id(), "42");
    assert_eq!(OrderPlaced::event_types(), ["order.placed"]);
    assert_eq!(placed.total_cents, 1250);

    let shipped = ParcelShipped { carrier: "dhl".into(), parcel: "p-1".into() };
    assert_eq!(describe(&shipped), "parcel/parcel_shipped/p-1");
    assert_eq!(ParcelShipped::event_types(), ["parcel_shipped"]);
    assert_eq!(shipped.carrier, "dhl");

    let paid = InvoicePaid(3, 9_000_000_000);
    assert_eq!(describe(&paid), "invoice/invoice-paid/9000000000");
    assert_eq!(InvoicePaid::event_types(), ["invoice-paid"]);
    assert_eq!(paid.0, 3);

    let renamed = UserRenamed { user_id: "u-7", new_name: "Ada" };
    assert_eq!(describe(&renamed), "user/user.renamed.v2/u-7");
    assert_eq!(renamed.new_name, "Ada");

    let moved = StockMoved { id: 5 };
    assert_eq!(moved.aggregate_type(), "stock");
    assert_eq!(moved.event_type(), "stock.moved");
    assert_eq!(moved.aggregate_id(), "5");
    assert_eq!(StockMoved::event_types(), ["stock.moved"]);
    // The blanket impl for references.
    assert_eq!(describe(&&moved), "stock/stock.moved/5");
}
