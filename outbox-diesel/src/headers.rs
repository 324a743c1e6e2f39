//! Extra headers recorded with events: [`EventHeaders`], e.g. the W3C `traceparent` of the
//! request that recorded them.
//!
//! They are stored in the row's `headers` column (a JSON object of strings), and the relay
//! sends each one as a NATS header of the event's message, so that a consumer's span can join
//! the producer's trace. Pass them per recording ([`Outbox::record_with_headers`]) or let an
//! [`Outbox`] ask a hook for them at every recording ([`Outbox::headers_from`]).
//!
//! [`Outbox`]: crate::Outbox
//! [`Outbox::record_with_headers`]: crate::Outbox::record_with_headers
//! [`Outbox::headers_from`]: crate::Outbox::headers_from

use std::collections::BTreeMap;
use std::sync::Arc;

/// The W3C Trace Context header naming the trace and the span an event was recorded in.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C Trace Context header carrying vendor-specific trace state.
pub const TRACESTATE: &str = "tracestate";

/// Headers recorded with an event and sent as NATS headers of its message.
///
/// A name is printable ASCII without `:`; a value has no line break. Names beginning with
/// `Nats-` or `Outbox-` and `Content-Type` are the relay's own (`Nats-Msg-Id`,
/// `Outbox-Aggregate-Id`, ...) and are refused. A recording with an invalid header is
/// refused with `diesel::result::Error::SerializationError` holding an
/// [`InvalidEvent`](crate::InvalidEvent), and writes nothing.
///
/// ```
/// use outbox_diesel::EventHeaders;
///
/// let headers = EventHeaders::traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
///     .with("tenant", "acme");
/// assert_eq!(headers.get("tenant"), Some("acme"));
/// assert_eq!(headers.len(), 2);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventHeaders {
    entries: BTreeMap<String, String>,
}

impl EventHeaders {
    /// No headers.
    pub fn new() -> Self {
        EventHeaders::default()
    }

    /// Headers holding only `traceparent` (a W3C Trace Context value such as
    /// `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`).
    pub fn traceparent(value: impl Into<String>) -> Self {
        EventHeaders::new().with(TRACEPARENT, value)
    }

    /// Adds (or replaces) header `name`.
    pub fn with(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.insert(name, value);
        self
    }

    /// Adds (or replaces) header `name`; returns the value it replaced.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<String>) -> Option<String> {
        self.entries.insert(name.into(), value.into())
    }

    /// The value of header `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.entries.get(name).map(String::as_str)
    }

    /// Whether there is no header.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// How many headers there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The headers, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// Adds every header of `other`, replacing those of the same name.
    pub(crate) fn merge(&mut self, other: &EventHeaders) {
        for (k, v) in &other.entries {
            self.entries.insert(k.clone(), v.clone());
        }
    }

    /// The first header that cannot be recorded, and why.
    pub(crate) fn check(&self) -> Result<(), (String, &'static str)> {
        for (name, value) in &self.entries {
            let bad = |why| Err((name.clone(), why));
            if name.is_empty() || name.chars().any(|c| !c.is_ascii_graphic() || c == ':') {
                return bad("a header name is printable ASCII without `:` or spaces");
            }
            let lower = name.to_ascii_lowercase();
            if lower.starts_with("nats-") || lower.starts_with("outbox-") || lower == "content-type"
            {
                return bad(
                    "it is one of the relay's own headers (`Nats-*`, `Outbox-*`, `Content-Type`)",
                );
            }
            if value.contains(['\r', '\n']) {
                return bad("a header value cannot contain a line break");
            }
        }
        Ok(())
    }

    /// The JSON object stored in the `headers` column.
    pub(crate) fn to_json(&self) -> String {
        // a map of strings always serialises
        serde_json::to_string(&self.entries).unwrap_or_else(|_| String::from("{}"))
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for EventHeaders {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut h = EventHeaders::new();
        h.extend(iter);
        h
    }
}

impl<K: Into<String>, V: Into<String>> Extend<(K, V)> for EventHeaders {
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, iter: I) {
        for (k, v) in iter {
            self.insert(k, v);
        }
    }
}

/// The hook an [`Outbox`](crate::Outbox) asks for headers at every recording.
#[derive(Clone)]
pub(crate) struct HeadersHook(pub(crate) Arc<dyn Fn() -> EventHeaders + Send + Sync>);

impl std::fmt::Debug for HeadersHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HeadersHook(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_cannot_be_a_nats_header() {
        assert!(EventHeaders::traceparent("00-ab-cd-01").check().is_ok());
        assert!(EventHeaders::new().with("a b", "x").check().is_err());
        assert!(EventHeaders::new().with("a:b", "x").check().is_err());
        assert!(EventHeaders::new().with("", "x").check().is_err());
        assert!(EventHeaders::new().with("x", "a\r\nb").check().is_err());
        assert!(
            EventHeaders::new()
                .with("Nats-Msg-Id", "x")
                .check()
                .is_err()
        );
        assert!(
            EventHeaders::new()
                .with("outbox-event-type", "x")
                .check()
                .is_err()
        );
    }

    #[test]
    fn stores_a_json_object_of_strings() {
        let h: EventHeaders = [("b", "2"), ("a", "\"1\"")].into_iter().collect();
        assert_eq!(h.to_json(), r#"{"a":"\"1\"","b":"2"}"#);
        assert_eq!(EventHeaders::new().to_json(), "{}");
    }
}
