//! Checking events before they are written: each event becomes a row to insert, or the whole
//! batch is refused with an [`InvalidEvent`] saying why (a name that cannot be a subject
//! token, a payload or subject over its limit, a bad header).

use diesel::QueryResult;
use diesel::result::Error as DieselError;
use uuid::Uuid;

use super::{InsertEvents, Outbox};
use crate::event::{MAX_SUBJECT_NAMES_LEN, subject_names_len};
use crate::wire::{jsonb_text, message_size};
use crate::{EventHeaders, OutboxEvent, check_event_type, check_subject_token};

impl Outbox {
    /// Turns events into the rows to insert, checking each one; every row gets the hook's
    /// headers with `extra` over them.
    pub(crate) fn prepare<'e, E, I>(
        &self,
        events: I,
        extra: &EventHeaders,
    ) -> QueryResult<InsertEvents>
    where
        E: OutboxEvent + ?Sized + 'e,
        I: Iterator<Item = &'e E>,
    {
        let headers = match &self.headers_hook {
            Some(hook) => {
                let mut h = (hook.0)();
                h.merge(extra);
                std::borrow::Cow::Owned(h)
            }
            None => std::borrow::Cow::Borrowed(extra),
        };
        let headers_checked = headers.check();
        let headers_json = headers.to_json();
        let (lower, _) = events.size_hint();
        let mut batch = InsertEvents::with_capacity(self.table.clone(), lower);
        for event in events {
            let invalid = |reason| {
                DieselError::SerializationError(Box::new(InvalidEvent {
                    event_type: event.event_type().to_owned(),
                    reason,
                }))
            };
            if let Err((name, why)) = &headers_checked {
                return Err(invalid(Reason::Header(name.clone(), why)));
            }
            let aggregate_type = event.aggregate_type();
            if let Err(e) = check_subject_token(aggregate_type) {
                return Err(invalid(Reason::AggregateType(aggregate_type.to_owned(), e)));
            }
            if let Err(e) = check_event_type(event.event_type()) {
                return Err(invalid(Reason::EventType(e)));
            }
            let aggregate_id = event.aggregate_id();
            if aggregate_id.is_empty() {
                return Err(invalid(Reason::EmptyAggregateId));
            }
            if aggregate_id.contains(['\r', '\n']) {
                return Err(invalid(Reason::LineBreakInAggregateId));
            }
            let names = subject_names_len(aggregate_type, &aggregate_id, event.event_type());
            if names > MAX_SUBJECT_NAMES_LEN {
                return Err(invalid(Reason::SubjectTooLong {
                    size: names,
                    limit: MAX_SUBJECT_NAMES_LEN,
                }));
            }
            let payload = jsonb_text(event).map_err(|e| invalid(Reason::Json(e)))?;
            let size = message_size(
                payload.len(),
                aggregate_type,
                &aggregate_id,
                event.event_type(),
                headers.as_ref(),
            );
            if size > self.max_payload {
                return Err(invalid(Reason::TooLarge {
                    size,
                    limit: self.max_payload,
                }));
            }
            batch.ids.push(Uuid::now_v7());
            batch.aggregate_types.push(aggregate_type.to_owned());
            batch.aggregate_ids.push(aggregate_id);
            batch.event_types.push(event.event_type().to_owned());
            batch.payloads.push(payload);
            batch.headers.push(headers_json.clone());
        }
        Ok(batch)
    }
}

/// Why an event was refused at record time. Found inside
/// [`diesel::result::Error::SerializationError`]; downcast to read it.
///
/// ```
/// # use outbox_diesel::InvalidEvent;
/// fn explain(e: &diesel::result::Error) -> Option<&InvalidEvent> {
///     match e {
///         diesel::result::Error::SerializationError(inner) => inner.downcast_ref(),
///         _ => None,
///     }
/// }
/// ```
#[derive(Debug, thiserror::Error)]
#[error("outbox event `{event_type}` refused: {reason}")]
pub struct InvalidEvent {
    event_type: String,
    #[source]
    reason: Reason,
}

impl InvalidEvent {
    /// The event type of the refused event.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// Whether it was refused for its size.
    pub fn is_too_large(&self) -> bool {
        matches!(self.reason, Reason::TooLarge { .. })
    }
}

#[derive(Debug, thiserror::Error)]
enum Reason {
    #[error(
        "its message is {size} bytes (the JSON as PostgreSQL renders it from jsonb, plus the NATS headers the relay sends), over the outbox's limit of {limit}; store large data elsewhere and record a reference, or raise `Outbox::max_payload` (and the NATS server's max_payload)"
    )]
    TooLarge { size: usize, limit: usize },
    #[error(
        "its aggregate type, aggregate id and event type take {size} bytes in the subject once percent-encoded (every byte other than an ASCII letter, digit, `-`, `_` or `~` takes three), over the limit of {limit} (outbox_diesel::MAX_SUBJECT_NAMES_LEN), past which a subject can exceed the NATS server's control-line limit; use a shorter aggregate id, such as a surrogate key or a hash of the natural one"
    )]
    SubjectTooLong { size: usize, limit: usize },
    #[error("its aggregate id is empty; every event needs the id of the aggregate it belongs to")]
    EmptyAggregateId,
    #[error(
        "its aggregate id contains a line break, which cannot travel in the `Outbox-Aggregate-Id` header"
    )]
    LineBreakInAggregateId,
    #[error("its aggregate type {0:?} cannot be a NATS subject token: it {1}")]
    AggregateType(String, crate::TokenError),
    #[error("its event type must be `.`-separated NATS subject tokens, but a part {0}")]
    EventType(crate::TokenError),
    #[error("its payload could not be serialised to JSON")]
    Json(#[source] serde_json::Error),
    #[error("its header {0:?} cannot be recorded: {1}")]
    Header(String, &'static str),
}
