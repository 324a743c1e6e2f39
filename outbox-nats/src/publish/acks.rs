//! The acks' inbox of a pipeline: each message is a core NATS publish whose reply subject is
//! the inbox and a number, and one subscription to the inbox (`<inbox>.*`) takes every ack. No
//! future, channel or timer is made per message, as JetStream's publish API makes each of them
//! (a fifth to a third of a bare publisher's CPU per message, BENCHMARKS.md section 17).

use std::time::Duration;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::response::Response;
use async_nats::{Client, Message, StatusCode, Subscriber};
use futures_util::{FutureExt, StreamExt};

use crate::publish::OutboxMessage;

/// How long a publish waits for its ack (JetStream's context default).
pub(crate) const ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// What waiting for an answer gave.
pub(crate) enum Answer {
    /// An answer to one of the publishes.
    Message(Message),
    /// None before the deadline.
    TimedOut,
    /// The subscription ended (the client closed): no answer will come on it; the next
    /// publish subscribes anew.
    Ended,
}

/// A pipeline's inbox: it numbers the publishes (and the rows settled without one) in order.
pub(crate) struct AckInbox {
    client: Client,
    /// The inbox and its subscription, made at the first publish.
    subscription: Option<(String, Subscriber)>,
    /// The number of the next publish (or settled row).
    next: u64,
}

impl AckInbox {
    pub(crate) fn new(client: Client) -> Self {
        AckInbox {
            client,
            subscription: None,
            next: 0,
        }
    }

    /// Takes the next number for a row settled without a publish.
    pub(crate) fn skip(&mut self) -> u64 {
        self.next += 1;
        self.next - 1
    }

    /// Publishes `msg` with the inbox and its number as the reply subject; the number.
    pub(crate) async fn publish(&mut self, msg: OutboxMessage) -> Result<u64, PublishError> {
        let (inbox, _) = match &self.subscription {
            Some(subscription) => subscription,
            None => {
                let inbox = self.client.new_inbox();
                let sub = self
                    .client
                    .subscribe(format!("{inbox}.*"))
                    .await
                    .map_err(|e| PublishError::with_source(PublishErrorKind::Other, e))?;
                self.subscription.insert((inbox, sub))
            }
        };
        let send = self.client.publish_with_reply_and_headers(
            msg.subject,
            format!("{inbox}.{}", self.next),
            msg.headers,
            msg.payload,
        );
        // the send waits only while the connection's queue is full (NATS unreachable)
        match tokio::time::timeout(ACK_TIMEOUT, send).await {
            Ok(Ok(())) => Ok(self.skip()),
            Ok(Err(e)) => Err(match e.kind() {
                async_nats::client::PublishErrorKind::MaxPayloadExceeded => {
                    PublishError::with_source(PublishErrorKind::MaxPayloadExceeded, e)
                }
                _ => PublishError::with_source(PublishErrorKind::Other, e),
            }),
            Err(_) => Err(PublishError::new(PublishErrorKind::TimedOut)),
        }
    }

    /// Waits for the next answer until `deadline`.
    pub(crate) async fn next(&mut self, deadline: tokio::time::Instant) -> Answer {
        let Some((_, sub)) = &mut self.subscription else {
            return Answer::Ended;
        };
        match tokio::time::timeout_at(deadline, sub.next()).await {
            Ok(Some(msg)) => Answer::Message(msg),
            Ok(None) => {
                self.subscription = None;
                Answer::Ended
            }
            Err(_) => Answer::TimedOut,
        }
    }

    /// An answer that arrived already, if any.
    pub(crate) fn try_next(&mut self) -> Option<Message> {
        let (_, sub) = self.subscription.as_mut()?;
        sub.next().now_or_never().flatten()
    }
}

/// The number an answer's subject ends with: its publish's.
pub(crate) fn reply_number(msg: &Message) -> Option<u64> {
    msg.subject.rsplit('.').next()?.parse().ok()
}

/// A publish's outcome from JetStream's answer, as async-nats's `PublishAckFuture` reads it.
pub(crate) fn read_ack(msg: &Message) -> Result<PublishAck, PublishError> {
    use async_nats::jetstream::ErrorCode;
    if msg.status == Some(StatusCode::NO_RESPONDERS) {
        return Err(PublishError::new(PublishErrorKind::StreamNotFound));
    }
    let response: Response<PublishAck> = serde_json::from_slice(&msg.payload)
        .map_err(|e| PublishError::with_source(PublishErrorKind::Other, e))?;
    match response {
        Response::Ok(ack) => Ok(ack),
        Response::Err { error } => Err(match error.error_code() {
            ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID => {
                PublishError::with_source(PublishErrorKind::WrongLastMessageId, error)
            }
            ErrorCode::STREAM_WRONG_LAST_SEQUENCE => {
                PublishError::with_source(PublishErrorKind::WrongLastSequence, error)
            }
            _ => PublishError::with_source(PublishErrorKind::Other, error),
        }),
    }
}

/// An answer on `subject`, for tests.
#[cfg(test)]
pub(crate) fn answer(subject: &str, payload: &str, status: Option<StatusCode>) -> Message {
    Message {
        subject: subject.into(),
        reply: None,
        payload: payload.to_owned().into(),
        headers: None,
        status,
        description: None,
        length: payload.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"{"stream":"S","seq":42,"duplicate":true}"#;

    #[test]
    fn answers_are_read_as_jetstream_publish_outcomes() {
        let kind = |msg| read_ack(&msg).map(|a| a.sequence).map_err(|e| e.kind());
        assert_eq!(kind(answer("i.1", OK, None)), Ok(42));
        assert_eq!(
            kind(answer("i.1", "", Some(StatusCode::NO_RESPONDERS))),
            Err(PublishErrorKind::StreamNotFound)
        );
        let refused = |code: u64| {
            format!(
                r#"{{"error":{{"code":400,"err_code":{code},"description":"wrong last sequence: 3"}}}}"#
            )
        };
        assert_eq!(
            kind(answer("i.1", &refused(10071), None)),
            Err(PublishErrorKind::WrongLastSequence)
        );
        assert_eq!(
            kind(answer("i.1", &refused(10070), None)),
            Err(PublishErrorKind::WrongLastMessageId)
        );
        // a stream's refusal keeps JetStream's error as its source, for `classify`
        let full = read_ack(&answer("i.1", &refused(10077), None)).expect_err("a refusal");
        assert_eq!(full.kind(), PublishErrorKind::Other);
        let api = std::error::Error::source(&full)
            .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
            .map(|e| e.error_code().0);
        assert_eq!(api, Some(10077));
        assert_eq!(reply_number(&answer("_INBOX.abc.17", OK, None)), Some(17));
        assert_eq!(reply_number(&answer("_INBOX.abc.x", OK, None)), None);
    }
}
