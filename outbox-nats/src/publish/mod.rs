//! The publishing contract: what message an outbox row becomes, and the stream it goes to.
//! [`subject`] renders subjects; the pipeline sends rows in order, never two unacked
//! messages of one aggregate at once; [`reconcile`] looks a row in doubt up before sending it
//! again.

mod acks;
pub mod fence;
mod outcome;
pub(crate) mod pipeline;
pub mod reconcile;
pub mod subject;

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;
use outbox_diesel::relay::OutboxRow;

use subject::{MAX_SUBJECT_LEN, SubjectTemplate, filter_matches};

/// Header carrying the row's aggregate type.
pub const AGGREGATE_TYPE_HEADER: &str = "Outbox-Aggregate-Type";
/// Header carrying the row's raw (unencoded) aggregate id.
pub const AGGREGATE_ID_HEADER: &str = "Outbox-Aggregate-Id";
/// Header carrying the row's event type.
pub const EVENT_TYPE_HEADER: &str = "Outbox-Event-Type";
/// Header carrying when the row was recorded (RFC 3339).
pub const CREATED_AT_HEADER: &str = "Outbox-Created-At";

/// A message ready to publish.
#[derive(Debug, Clone)]
pub struct OutboxMessage {
    /// The subject.
    pub subject: String,
    /// Every header, `Nats-Msg-Id` included.
    pub headers: HeaderMap,
    /// The payload's JSON bytes.
    pub payload: Bytes,
}

/// Why a row cannot become a message. Such a row is parked: publishing it again cannot help.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidRow {
    /// A header of the row's `headers` column (or its aggregate id) is not a valid NATS header.
    #[error("header {name:?} cannot be sent as a NATS header: {reason}")]
    Header {
        /// The header's name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The `headers` column is not a JSON object.
    #[error("the row's headers are not a JSON object of strings")]
    HeadersNotAnObject,
    /// The subject is longer than [`MAX_SUBJECT_LEN`]: a NATS server would close the
    /// connection rather than take it.
    #[error(
        "its subject is {len} bytes, over the relay's limit of {limit} (a NATS server closes the connection of a client whose protocol line exceeds its max_control_line, 4 KiB by default); record the event with a shorter aggregate id"
    )]
    SubjectTooLong {
        /// The subject's length in bytes.
        len: usize,
        /// [`MAX_SUBJECT_LEN`].
        limit: usize,
    },
}

/// Builds the message of `row` (see the README's publishing contract).
///
/// ```
/// # use outbox_diesel::relay::OutboxRow;
/// use outbox_nats::publish::to_message;
/// use outbox_nats::subject::SubjectTemplate;
///
/// # let row = OutboxRow {
/// #     seq: 1, id: uuid::Uuid::now_v7(), aggregate_type: "order".into(),
/// #     aggregate_id: "a.1".into(), event_type: "order.placed".into(),
/// #     payload: serde_json::json!({"total": 5}).into(), headers: serde_json::json!({"traceparent": "00-x"}),
/// #     created_at: chrono::Utc::now(), attempts: 0,
/// # };
/// let msg = to_message(&row, &SubjectTemplate::default(), "outbox")?;
/// assert_eq!(msg.subject, "outbox.order.a%2E1");
/// assert_eq!(msg.headers.get("Nats-Msg-Id").map(|v| v.as_str()), Some(row.id.to_string().as_str()));
/// assert_eq!(msg.headers.get("Outbox-Aggregate-Id").map(|v| v.as_str()), Some("a.1"));
/// assert_eq!(msg.headers.get("traceparent").map(|v| v.as_str()), Some("00-x"));
/// assert_eq!(&msg.payload[..], br#"{"total":5}"#);
/// # Ok::<(), outbox_nats::publish::InvalidRow>(())
/// ```
pub fn to_message(
    row: &OutboxRow,
    template: &SubjectTemplate,
    prefix: &str,
) -> Result<OutboxMessage, InvalidRow> {
    let subject = template.render(
        prefix,
        &row.aggregate_type,
        &row.aggregate_id,
        &row.event_type,
    );
    if subject.len() > MAX_SUBJECT_LEN {
        return Err(InvalidRow::SubjectTooLong {
            len: subject.len(),
            limit: MAX_SUBJECT_LEN,
        });
    }
    let mut headers = HeaderMap::new();
    if let Some(extra) = row.headers.as_object() {
        for (name, value) in extra {
            let value = match value {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            insert(&mut headers, name, &value)?;
        }
    } else {
        return Err(InvalidRow::HeadersNotAnObject);
    }
    // the fixed names need no checking; a uuid and a timestamp are valid header values
    let fixed = |name: &'static str| HeaderName::from_static(name);
    headers.insert(fixed("Nats-Msg-Id"), HeaderValue::from(row.id.to_string()));
    headers.insert(
        fixed(AGGREGATE_TYPE_HEADER),
        value(AGGREGATE_TYPE_HEADER, &row.aggregate_type)?,
    );
    headers.insert(
        fixed(AGGREGATE_ID_HEADER),
        value(AGGREGATE_ID_HEADER, &row.aggregate_id)?,
    );
    headers.insert(
        fixed(EVENT_TYPE_HEADER),
        value(EVENT_TYPE_HEADER, &row.event_type)?,
    );
    headers.insert(
        fixed(CREATED_AT_HEADER),
        HeaderValue::from(
            row.created_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        ),
    );
    headers.insert(fixed("Content-Type"), HeaderValue::from("application/json"));
    Ok(OutboxMessage {
        subject,
        headers,
        payload: Bytes::copy_from_slice(row.payload.as_bytes()),
    })
}

fn insert(headers: &mut HeaderMap, name: &str, value_text: &str) -> Result<(), InvalidRow> {
    if name.is_empty() || name.chars().any(|c| !c.is_ascii_graphic() || c == ':') {
        return Err(InvalidRow::Header {
            name: name.to_owned(),
            reason: "a header name is printable ASCII without `:`".into(),
        });
    }
    headers.insert(name, value(name, value_text)?);
    Ok(())
}

/// `text` as a header value: no CR or LF.
fn value(name: &str, text: &str) -> Result<HeaderValue, InvalidRow> {
    text.parse().map_err(|e| InvalidRow::Header {
        name: name.to_owned(),
        reason: format!("{e}"),
    })
}

/// What [`ensure_stream`] found or made.
#[derive(Debug, Clone)]
pub struct StreamInfo {
    /// The stream's name.
    pub name: String,
    /// Its duplicate window: a message id seen within it is dropped.
    pub duplicate_window: Duration,
    /// Its replicas.
    pub replicas: usize,
    /// Whether this call created it.
    pub created: bool,
}

/// The stream cannot take the relay's messages.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// The stream exists but none of its subjects matches the relay's subjects.
    #[error(
        "stream {stream} exists with subjects {subjects:?}, which do not capture `{wanted}`; add `{wanted}` to its subjects, or pass --stream/--subject-prefix for a stream that does"
    )]
    SubjectsNotCaptured {
        /// The stream.
        stream: String,
        /// Its subjects.
        subjects: Vec<String>,
        /// The relay's subjects.
        wanted: String,
    },
    /// JetStream refused or did not answer.
    #[error(
        "JetStream stream {stream}: {source}; is JetStream enabled on the server (nats-server -js)?"
    )]
    JetStream {
        /// The stream.
        stream: String,
        /// The error.
        #[source]
        source: async_nats::Error,
    },
}

/// Gets the stream `name`, creating it (file storage, subjects `{prefix}.>`, the given
/// duplicate window and replicas) when missing; an existing stream must capture `{prefix}.>`.
pub async fn ensure_stream(
    js: &jetstream::Context,
    name: &str,
    prefix: &str,
    template: &SubjectTemplate,
    duplicate_window: Duration,
    replicas: usize,
) -> Result<StreamInfo, StreamError> {
    let wanted = format!("{prefix}.>");
    let js_err = |e: async_nats::Error| StreamError::JetStream {
        stream: name.to_owned(),
        source: e,
    };
    match js.get_stream(name).await {
        Ok(mut s) => {
            let info = s.info().await.map_err(|e| js_err(e.into()))?;
            let subjects = info.config.subjects.clone();
            // a sample subject with every kind of token
            let sample = template.render(prefix, "type", "id", "event.type");
            if !subjects.iter().any(|f| filter_matches(f, &sample)) {
                return Err(StreamError::SubjectsNotCaptured {
                    stream: name.to_owned(),
                    subjects,
                    wanted,
                });
            }
            Ok(StreamInfo {
                name: name.to_owned(),
                duplicate_window: info.config.duplicate_window,
                replicas: info.config.num_replicas,
                created: false,
            })
        }
        Err(e)
            if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(j)
                if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
        {
            let config = stream::Config {
                name: name.to_owned(),
                subjects: vec![wanted],
                storage: stream::StorageType::File,
                duplicate_window,
                num_replicas: replicas,
                ..Default::default()
            };
            let mut s = js
                .get_or_create_stream(config)
                .await
                .map_err(|e| js_err(e.into()))?;
            let info = s.info().await.map_err(|e| js_err(e.into()))?;
            Ok(StreamInfo {
                name: name.to_owned(),
                duplicate_window: info.config.duplicate_window,
                replicas: info.config.num_replicas,
                created: true,
            })
        }
        Err(e) => Err(js_err(e.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes NATS counts against `max_payload`: the header block as async-nats writes it
    /// (`NATS/1.0`, each `Name: value`, line ends) plus the payload.
    fn wire_size(msg: &OutboxMessage) -> usize {
        let lines: usize = msg
            .headers
            .iter()
            .map(|(k, vs)| {
                vs.iter()
                    .map(|v| k.to_string().len() + 2 + v.as_str().len() + 2)
                    .sum::<usize>()
            })
            .sum();
        "NATS/1.0\r\n".len() + lines + "\r\n".len() + msg.payload.len()
    }

    #[test]
    fn the_recording_side_measures_the_message_the_relay_sends() {
        let headers = outbox_diesel::EventHeaders::traceparent("00-abc")
            .with("Content-Type", "text/plain")
            .with("tenant", "Zürich");
        let payload = outbox_diesel::jsonb_text(&serde_json::json!({"n": [1, 2.5e-3], "s": "é"}))
            .expect("render");
        let row = OutboxRow {
            seq: 1,
            id: uuid::Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: "a.1 é".into(),
            event_type: "order.placed".into(),
            payload: outbox_diesel::RawJson::new(payload.clone()).expect("json"),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_owned(), serde_json::Value::from(v)))
                .collect::<serde_json::Map<_, _>>()
                .into(),
            created_at: chrono::Utc::now(),
            attempts: 0,
        };
        let msg = to_message(&row, &SubjectTemplate::default(), "outbox").expect("message");
        assert_eq!(
            wire_size(&msg),
            outbox_diesel::message_size(
                payload.len(),
                &row.aggregate_type,
                &row.aggregate_id,
                &row.event_type,
                &headers
            )
        );
    }
}
