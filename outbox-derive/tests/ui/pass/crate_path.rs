// `crate = "..."` for crates that re-export outbox_diesel: generated code names the trait and
// serde through the given path only.
use serde::Serialize;

/// A platform crate's module re-exporting the outbox.
mod platform {
    pub use ::outbox_diesel as outbox;
}

#[derive(Serialize, outbox_diesel::OutboxEvent)]
#[outbox(aggregate_type = "order", crate = "crate::platform::outbox")]
struct OrderPlaced<Id> {
    #[outbox(aggregate_id)]
    id: Id,
}

/// A stand-in with the same methods, to show that the impl goes where `crate` points (and
/// that a generic type's `Serialize` bound goes through `<crate>::__private::serde`).
mod shim {
    pub use ::outbox_diesel::__private;

    pub trait OutboxEvent {
        fn aggregate_type(&self) -> &str;
        fn event_type(&self) -> &str;
        fn aggregate_id(&self) -> String;
        fn event_types() -> &'static [&'static str]
        where
            Self: Sized;
    }
}

#[derive(Serialize, outbox_diesel::OutboxEvent)]
#[outbox(aggregate_type = "shim", crate = "crate::shim")]
enum ShimEvent<T> {
    Poked(#[outbox(aggregate_id)] T),
}

fn main() {
    use platform::outbox::OutboxEvent as _;
    let placed = OrderPlaced { id: 9_u64 };
    assert_eq!(placed.aggregate_type(), "order");
    assert_eq!(placed.aggregate_id(), "9");

    let poked = ShimEvent::Poked(1_u8);
    assert_eq!(shim::OutboxEvent::aggregate_type(&poked), "shim");
    assert_eq!(shim::OutboxEvent::event_type(&poked), "poked");
    assert_eq!(shim::OutboxEvent::aggregate_id(&poked), "1");
    assert_eq!(<ShimEvent<u8> as shim::OutboxEvent>::event_types(), ["poked"]);
}
