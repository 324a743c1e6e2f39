use outbox_diesel::OutboxEvent;
use serde::Serialize;

macro_rules! renamed {
    ($name:ident, $rule:literal) => {
        #[derive(Serialize, OutboxEvent)]
        #[outbox(aggregate_type = "order", rename_all = $rule)]
        enum $name {
            OrderPlaced(#[outbox(aggregate_id)] u8),
            V2Shipped(#[outbox(aggregate_id)] u8),
        }
    };
}

renamed!(Lower, "lowercase");
renamed!(Upper, "UPPERCASE");
renamed!(Pascal, "PascalCase");
renamed!(Camel, "camelCase");
renamed!(Snake, "snake_case");
renamed!(ScreamingSnake, "SCREAMING_SNAKE_CASE");
renamed!(Kebab, "kebab-case");
renamed!(ScreamingKebab, "SCREAMING-KEBAB-CASE");

// On a struct, the rule applies to the struct's name.
#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "order", rename_all = "SCREAMING-KEBAB-CASE")]
struct OrderPlaced {
    #[outbox(aggregate_id)]
    id: u8,
}

fn main() {
    assert_eq!(Lower::event_types(), ["orderplaced", "v2shipped"]);
    assert_eq!(Upper::event_types(), ["ORDERPLACED", "V2SHIPPED"]);
    assert_eq!(Pascal::event_types(), ["OrderPlaced", "V2Shipped"]);
    assert_eq!(Camel::event_types(), ["orderPlaced", "v2Shipped"]);
    assert_eq!(Snake::event_types(), ["order_placed", "v2_shipped"]);
    assert_eq!(ScreamingSnake::event_types(), ["ORDER_PLACED", "V2_SHIPPED"]);
    assert_eq!(Kebab::event_types(), ["order-placed", "v2-shipped"]);
    assert_eq!(ScreamingKebab::event_types(), ["ORDER-PLACED", "V2-SHIPPED"]);
    assert_eq!(Kebab::V2Shipped(1).event_type(), "v2-shipped");
    assert_eq!(OrderPlaced { id: 1 }.event_type(), "ORDER-PLACED");
}
