//! `#[derive(OutboxEvent)]` for the [outbox-diesel] transactional outbox.
//!
//! Use it through `outbox_diesel::OutboxEvent`, which re-exports the derive next to the trait
//! (feature `derive`, on by default); see [`macro@OutboxEvent`] for its attributes.
//!
//! [outbox-diesel]: https://docs.rs/outbox-diesel

mod ast;
mod attr;
mod case;
mod ctxt;
mod expand;
mod fallback;
mod valid;

use proc_macro::TokenStream;

/// Derives `outbox_diesel::OutboxEvent`: the aggregate type, event type and aggregate id the
/// outbox records for each event.
///
/// The event's payload is its `serde::Serialize` form, so derive `Serialize` too.
///
/// # Structs
///
/// A struct is one event type. One field, marked `#[outbox(aggregate_id)]`, identifies the
/// aggregate; its type must implement `Display` and `aggregate_id()` returns its
/// `to_string()`.
///
/// ```
/// use outbox_diesel::OutboxEvent;
/// use serde::Serialize;
///
/// #[derive(Serialize, OutboxEvent)]
/// #[outbox(aggregate_type = "order", event_type = "order.placed")]
/// struct OrderPlaced {
///     #[outbox(aggregate_id)]
///     order_id: i64,
///     total_cents: i64,
/// }
///
/// let event = OrderPlaced { order_id: 42, total_cents: 1250 };
/// assert_eq!(event.aggregate_type(), "order");
/// assert_eq!(event.event_type(), "order.placed");
/// assert_eq!(event.aggregate_id(), "42");
/// assert_eq!(OrderPlaced::event_types(), ["order.placed"]);
/// ```
///
/// # Enums
///
/// An enum is one event type per variant, all of the same aggregate type. Each variant marks
/// its own aggregate id field, named or positional. `event_types()` lists the variants' event
/// types in declaration order, for consumers that route on the `Outbox-Event-Type` header.
///
/// ```
/// use outbox_diesel::OutboxEvent;
/// use serde::Serialize;
///
/// #[derive(Serialize, OutboxEvent)]
/// #[outbox(aggregate_type = "order", rename_all = "kebab-case")]
/// enum OrderEvent {
///     Placed { #[outbox(aggregate_id)] id: u64, total_cents: i64 },
///     LineAdded { #[outbox(aggregate_id)] order: u64, sku: String },
///     #[outbox(event_type = "order.cancelled")]
///     Cancelled(#[outbox(aggregate_id)] u64),
/// }
///
/// let event = OrderEvent::LineAdded { order: 7, sku: "tea".into() };
/// assert_eq!(event.event_type(), "line-added");
/// assert_eq!(event.aggregate_id(), "7");
/// assert_eq!(OrderEvent::Cancelled(7).event_type(), "order.cancelled");
/// assert_eq!(OrderEvent::event_types(), ["placed", "line-added", "order.cancelled"]);
/// ```
///
/// # Attributes
///
/// ```text
/// #[outbox(aggregate_type = "order")]      on the type, required
/// #[outbox(event_type = "order.placed")]   on a struct, or on an enum variant
/// #[outbox(rename_all = "kebab-case")]     on the type
/// #[outbox(crate = "my_crate::outbox")]    on the type
/// #[outbox(aggregate_id)]                  on exactly one field of the struct / of each variant
/// ```
///
/// - `aggregate_type = "..."`: the kind of aggregate (`order`). It becomes one token of the
///   NATS subject, so it must be a single subject token: not empty, and without `.`, `*`,
///   `>`, white space or control characters.
/// - `event_type = "..."`: the name of the event (`order.placed`), sent in the
///   `Outbox-Event-Type` header. It is one or more `.`-separated tokens, each following the
///   rule above. Dots are allowed because the default subject template
///   (`{prefix}.{aggregate_type}.{aggregate_id}`) keeps the event type out of the subject; a
///   template that includes `{event_type}` makes each of its dot-separated parts one subject
///   level, so the subject stays well formed. On an enum it goes on the variants, not on the
///   enum. Two variants with the same event type are an error.
/// - Without `event_type`, the event type is the struct's or variant's name converted by
///   `rename_all`: `OrderPlaced` becomes `order_placed` by default.
/// - `rename_all = "..."`: how default event types are made from names, with serde's rules
///   and spelling: `lowercase`, `UPPERCASE`, `PascalCase`, `camelCase`, `snake_case` (the
///   default), `SCREAMING_SNAKE_CASE`, `kebab-case`, `SCREAMING-KEBAB-CASE`. An explicit
///   `event_type` is used as written.
/// - `crate = "..."`: the path to `outbox_diesel` in generated code, for crates that
///   re-export it (default `::outbox_diesel`). The path must also reach
///   `outbox_diesel::__private`, as `pub use outbox_diesel;` or a glob re-export does.
/// - `aggregate_id`: marks the field that identifies the aggregate instance. Its type must
///   implement `Display`; generic field types get a `Display` bound on the impl.
///
/// # Errors
///
/// Invalid input is reported at compile time, each error on the offending key, literal,
/// field or variant, all in one compilation: a missing `aggregate_type`, a name that cannot
/// be a subject token (saying which character and why), a missing or doubled
/// `aggregate_id`, unknown attributes (with the nearest known one), duplicate or misplaced
/// keys, values of the wrong form, unit structs and variants (no field to be the aggregate
/// id), and unions.
///
/// ```compile_fail
/// use outbox_diesel::OutboxEvent;
/// use serde::Serialize;
///
/// #[derive(Serialize, OutboxEvent)]
/// #[outbox(aggregate_type = "order.line")] // a `.` would add a level to the subject
/// struct LineAdded {
///     #[outbox(aggregate_id)]
///     order_id: i64,
/// }
/// ```
#[proc_macro_derive(OutboxEvent, attributes(outbox))]
pub fn derive_outbox_event(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    expand::derive(&input).into()
}
