//! The [`OutboxEvent`] trait: what the outbox needs to know about a domain event.

use serde::Serialize;

/// A domain event that can be recorded in the outbox.
///
/// The outbox row takes its `aggregate_type`, `aggregate_id` and `event_type` from these
/// methods and its `payload` from the event's [`Serialize`] implementation
/// (`serde_json::to_value(&event)`).
///
/// Derive it with `#[derive(OutboxEvent)]` (feature `derive`, on by default): the derive
/// checks at compile time that the names can be NATS subject tokens and that exactly one
/// field is the aggregate id.
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
/// let e = OrderPlaced { order_id: 7, total_cents: 1250 };
/// assert_eq!(e.aggregate_type(), "order");
/// assert_eq!(e.event_type(), "order.placed");
/// assert_eq!(e.aggregate_id(), "7");
/// ```
///
/// Implemented by hand, the same rules apply at record time: an empty aggregate id, or an
/// aggregate type that is not a valid subject token, is refused with
/// [`diesel::result::Error::SerializationError`].
///
/// ```
/// use outbox_diesel::OutboxEvent;
/// use serde::Serialize;
///
/// #[derive(Serialize)]
/// struct Shipped { parcel: String }
///
/// impl OutboxEvent for Shipped {
///     fn aggregate_type(&self) -> &str { "parcel" }
///     fn event_type(&self) -> &str { "parcel.shipped" }
///     fn aggregate_id(&self) -> String { self.parcel.clone() }
/// }
/// # assert_eq!(Shipped { parcel: "p-1".into() }.aggregate_id(), "p-1");
/// ```
pub trait OutboxEvent: Serialize {
    /// The kind of aggregate this event belongs to (`order`): the subject token after the
    /// prefix. A single NATS subject token: no `.`, `*`, `>`, white space or control
    /// characters, not empty.
    fn aggregate_type(&self) -> &str;

    /// The name of this event (`order.placed`): the `Outbox-Event-Type` header. Made of one
    /// or more `.`-separated subject tokens, so that a subject template that includes it
    /// (`{prefix}.{event_type}.{aggregate_id}`) stays well formed.
    fn event_type(&self) -> &str;

    /// The id of the aggregate instance (`"42"`); events of one aggregate keep their commit
    /// order. Any string but the empty one: the relay encodes it into the subject.
    fn aggregate_id(&self) -> String;

    /// Every event type this Rust type can produce (one per enum variant), for consumers that
    /// route messages by their `Outbox-Event-Type` header. Empty when unknown.
    fn event_types() -> &'static [&'static str]
    where
        Self: Sized,
    {
        &[]
    }
}

impl<T: OutboxEvent + ?Sized> OutboxEvent for &T {
    fn aggregate_type(&self) -> &str {
        (**self).aggregate_type()
    }
    fn event_type(&self) -> &str {
        (**self).event_type()
    }
    fn aggregate_id(&self) -> String {
        (**self).aggregate_id()
    }
}

/// Why a name cannot be a NATS subject token.
///
/// Returned by [`check_subject_token`]; the derive applies the same rules at compile time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenError {
    /// The name is empty (or, in a `.`-separated name, one of its parts is).
    Empty,
    /// The name contains this character, which would change the subject's shape.
    Forbidden(char),
}

impl core::fmt::Display for TokenError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            TokenError::Empty => f.write_str("is empty"),
            TokenError::Forbidden(c) => write!(
                f,
                "contains {c:?}, which cannot appear in a NATS subject token"
            ),
        }
    }
}

/// Checks that `name` is a single NATS subject token: not empty, and free of `.`, `*`, `>`,
/// white space and control characters.
///
/// ```
/// use outbox_diesel::{check_subject_token, TokenError};
/// assert!(check_subject_token("order").is_ok());
/// assert_eq!(check_subject_token("or der"), Err(TokenError::Forbidden(' ')));
/// ```
pub fn check_subject_token(name: &str) -> Result<(), TokenError> {
    if name.is_empty() {
        return Err(TokenError::Empty);
    }
    match name
        .chars()
        .find(|&c| c == '.' || c == '*' || c == '>' || c.is_whitespace() || c.is_control())
    {
        Some(c) => Err(TokenError::Forbidden(c)),
        None => Ok(()),
    }
}

/// Checks that `name` is one or more `.`-separated subject tokens (`order.placed`), as an
/// event type must be.
///
/// ```
/// use outbox_diesel::{check_event_type, TokenError};
/// assert!(check_event_type("order.placed").is_ok());
/// assert_eq!(check_event_type("order..placed"), Err(TokenError::Empty));
/// ```
pub fn check_event_type(name: &str) -> Result<(), TokenError> {
    name.split('.').try_for_each(check_subject_token)
}

/// The most bytes an event's aggregate type, aggregate id and event type may take in its
/// subject together, percent-encoded as the relay encodes subject tokens (see
/// [`subject_names_len`]); [`Outbox::record`](crate::Outbox::record) refuses an event over it.
///
/// A NATS server closes the connection of a client that sends a protocol line longer than its
/// `max_control_line` (4 KiB by default), and a publish's line holds its subject. The relay
/// refuses subjects over 3,072 bytes and keeps its prefix and template literals within
/// 1,024, so an event accepted at record time always fits.
pub const MAX_SUBJECT_NAMES_LEN: usize = 2048;

/// How many bytes `token` takes in a subject once percent-encoded: one for each ASCII letter,
/// digit, `-`, `_` and `~`, three (`%XX`) for every other byte.
///
/// ```
/// use outbox_diesel::encoded_token_len;
/// assert_eq!(encoded_token_len("order-42"), 8);
/// assert_eq!(encoded_token_len("a.b"), 5); // a%2Eb
/// assert_eq!(encoded_token_len("é"), 6); // %C3%A9
/// ```
pub fn encoded_token_len(token: &str) -> usize {
    token
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'~') {
                1
            } else {
                3
            }
        })
        .sum()
}

/// How many bytes an event's names take in its subject: its aggregate type and aggregate id
/// as one token each, its event type as its `.`-separated tokens, each percent-encoded.
///
/// ```
/// use outbox_diesel::subject_names_len;
/// // order + 42 + order.placed
/// assert_eq!(subject_names_len("order", "42", "order.placed"), 5 + 2 + 12);
/// ```
pub fn subject_names_len(aggregate_type: &str, aggregate_id: &str, event_type: &str) -> usize {
    let event: usize = event_type.split('.').map(encoded_token_len).sum();
    let dots = event_type.split('.').count() - 1;
    encoded_token_len(aggregate_type) + encoded_token_len(aggregate_id) + event + dots
}
