//! Decoding: a message into a [`Delivery`] of the event type, or why it cannot be read.

use async_nats::HeaderMap;
use async_nats::jetstream::{self};
use outbox_diesel::OutboxEvent;
use serde::de::DeserializeOwned;

use crate::publish::{AGGREGATE_ID_HEADER, AGGREGATE_TYPE_HEADER, EVENT_TYPE_HEADER};

/// One decoded message, as the handler receives it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Delivery<E> {
    /// The event, deserialised from the message body.
    pub event: E,
    /// The message id (`Nats-Msg-Id`: the outbox row's UUID).
    pub message_id: String,
    /// The `Outbox-Event-Type` header (empty when absent).
    pub event_type: String,
    /// The `Outbox-Aggregate-Type` header (empty when absent).
    pub aggregate_type: String,
    /// The `Outbox-Aggregate-Id` header, unencoded (empty when absent).
    pub aggregate_id: String,
    /// The subject it was published on.
    pub subject: String,
    /// Its sequence number in the stream.
    pub stream_sequence: u64,
    /// Which delivery this is: 1 the first time, more after a nak or a missed ack.
    pub delivered: u64,
    /// Every header of the message.
    pub headers: HeaderMap,
}

impl<E> Delivery<E> {
    /// A first delivery of `event` with the message id `message_id` and no headers, for
    /// testing a handler without a server.
    pub fn new(message_id: impl Into<String>, event: E) -> Self {
        Delivery {
            event,
            message_id: message_id.into(),
            event_type: String::new(),
            aggregate_type: String::new(),
            aggregate_id: String::new(),
            subject: String::new(),
            stream_sequence: 0,
            delivered: 1,
            headers: HeaderMap::new(),
        }
    }
}

impl<E: DeserializeOwned + OutboxEvent> Delivery<E> {
    /// Decodes a JetStream message (see the [module documentation](super#decoding)).
    pub fn decode(message: &jetstream::Message) -> Result<Self, DecodeError> {
        let info = message.info().map_err(|_| DecodeError::NotJetStream)?;
        let headers = message.headers.clone().unwrap_or_default();
        Self::decode_parts(
            message.subject.as_str(),
            headers,
            &message.payload,
            info.stream_sequence,
            info.delivered.max(1) as u64,
        )
    }

    fn decode_parts(
        subject: &str,
        headers: HeaderMap,
        payload: &[u8],
        stream_sequence: u64,
        delivered: u64,
    ) -> Result<Self, DecodeError> {
        let get = |name: &str| {
            headers
                .get(name)
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default()
        };
        let message_id = get("Nats-Msg-Id");
        if message_id.is_empty() {
            return Err(DecodeError::NoMessageId);
        }
        let event_type = get(EVENT_TYPE_HEADER);
        let known = E::event_types();
        if !known.is_empty() && !known.contains(&event_type.as_str()) {
            return Err(DecodeError::UnknownEventType { event_type, known });
        }
        let event = serde_json::from_slice(payload).map_err(|source| DecodeError::Json {
            type_name: std::any::type_name::<E>(),
            event_type: event_type.clone(),
            source,
        })?;
        Ok(Delivery {
            event,
            message_id,
            aggregate_type: get(AGGREGATE_TYPE_HEADER),
            aggregate_id: get(AGGREGATE_ID_HEADER),
            event_type,
            subject: subject.to_owned(),
            stream_sequence,
            delivered,
            headers,
        })
    }
}

/// Why a message cannot become a [`Delivery`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The message has no `Nats-Msg-Id` header, so the inbox cannot tell it from another.
    #[error(
        "the message has no `Nats-Msg-Id` header, so the inbox cannot deduplicate it; publish through the outbox relay, or set the header"
    )]
    NoMessageId,
    /// The message's `Outbox-Event-Type` is not one of the consumer's event types.
    #[error("event type {event_type:?} is not one of the consumer's event types {known:?}")]
    UnknownEventType {
        /// The message's event type (empty when the header is absent).
        event_type: String,
        /// The event types the consumer's type lists.
        known: &'static [&'static str],
    },
    /// The body is not the JSON of the consumer's type.
    #[error("the body of a {event_type:?} message is not the JSON of `{type_name}`")]
    Json {
        /// The consumer's event type.
        type_name: &'static str,
        /// The message's event type.
        event_type: String,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
    /// The message did not come from a JetStream consumer (it has no ack subject).
    #[error("not a JetStream message: it has no ack subject")]
    NotJetStream,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consumer::ConsumerConfig;
    use crate::consumer::run::chain;
    use serde::{Deserialize, Serialize};

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum Ev {
        Placed { id: i64 },
        Cancelled(i64),
    }

    impl OutboxEvent for Ev {
        fn aggregate_type(&self) -> &str {
            "order"
        }
        fn event_type(&self) -> &str {
            match self {
                Ev::Placed { .. } => "placed",
                Ev::Cancelled(_) => "cancelled",
            }
        }
        fn aggregate_id(&self) -> String {
            match self {
                Ev::Placed { id } | Ev::Cancelled(id) => id.to_string(),
            }
        }
        fn event_types() -> &'static [&'static str] {
            &["placed", "cancelled"]
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, *v);
        }
        h
    }

    #[test]
    fn decodes_the_recorded_json_and_the_headers() {
        let event = Ev::Placed { id: 7 };
        let body = serde_json::to_vec(&serde_json::to_value(&event).expect("json")).expect("json");
        let h = headers(&[
            ("Nats-Msg-Id", "m-1"),
            (EVENT_TYPE_HEADER, "placed"),
            (AGGREGATE_TYPE_HEADER, "order"),
            (AGGREGATE_ID_HEADER, "7"),
        ]);
        let d = Delivery::<Ev>::decode_parts("outbox.order.7", h, &body, 3, 2).expect("decodes");
        assert_eq!(d.event, event);
        assert_eq!(
            (d.message_id.as_str(), d.event_type.as_str()),
            ("m-1", "placed")
        );
        assert_eq!(
            (d.aggregate_type.as_str(), d.aggregate_id.as_str()),
            ("order", "7")
        );
        assert_eq!((d.stream_sequence, d.delivered), (3, 2));
    }

    #[test]
    fn refuses_what_it_cannot_deduplicate_or_read() {
        let body = br#"{"Cancelled":7}"#;
        let no_id = headers(&[(EVENT_TYPE_HEADER, "cancelled")]);
        assert!(matches!(
            Delivery::<Ev>::decode_parts("s", no_id, body, 1, 1),
            Err(DecodeError::NoMessageId)
        ));
        let unknown = headers(&[("Nats-Msg-Id", "m"), (EVENT_TYPE_HEADER, "shipped")]);
        assert!(matches!(
            Delivery::<Ev>::decode_parts("s", unknown, body, 1, 1),
            Err(DecodeError::UnknownEventType { .. })
        ));
        let ok = headers(&[("Nats-Msg-Id", "m"), (EVENT_TYPE_HEADER, "cancelled")]);
        let err = Delivery::<Ev>::decode_parts("s", ok, b"{not json", 1, 1).expect_err("bad json");
        assert!(matches!(err, DecodeError::Json { .. }));
        assert!(
            chain(&err).contains("key must be a string"),
            "{}",
            chain(&err)
        );
    }

    #[test]
    fn validates_names_and_limits() {
        assert!(ConsumerConfig::new("billing", "u").validate().is_ok());
        assert!(ConsumerConfig::new("bill.ing", "u").validate().is_err());
        assert!(ConsumerConfig::new("", "u").validate().is_err());
        assert!(
            ConsumerConfig::new("b", "u")
                .max_ack_pending(0)
                .validate()
                .is_err()
        );
        assert!(
            ConsumerConfig::new("b", "u")
                .undecodable_after(0)
                .validate()
                .is_err()
        );
    }
}
