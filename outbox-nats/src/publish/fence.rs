//! Fencing at the broker ([`Ordered::fence`](field@crate::Ordered::fence), `--fence`): in the
//! ordered modes (`ordered`, `log-tailing`) every publish carries `Nats-Expected-Last-Subject-Sequence`, the stream sequence of the last message on
//! its subject as the relay knows it, so that JetStream itself refuses a message that would
//! land after a newer one of its subject.
//!
//! # What it closes
//!
//! A relay checks its lease before each publish, but a message sent just before the relay was
//! paused (SIGSTOP, a VM frozen, a long GC-like stall of the host) waits in the process's or
//! the network's buffers and reaches the server when the relay resumes: after the new owner of
//! its partition (or slot) published it, and newer events of its aggregate. Within the
//! stream's duplicate window JetStream drops it by message id; past the window it would be a
//! second copy, stored after newer events. With the fence, its expected sequence is older
//! than the subject's last one, and JetStream refuses it (error 10071, "wrong last
//! sequence").
//!
//! # Where the expected sequence comes from
//!
//! A subject is the aggregate's own (the template holds `{aggregate_id}`), and with the fence
//! the pipeline never has two unacked messages of one subject in flight (nor of one
//! aggregate, fenced or not), so the ack of the last publish on a subject gives its sequence ([`PublishAck::sequence`](async_nats::jetstream::publish::PublishAck)).
//! A subject this relay has not published since it took the work over (or since a failure)
//! is looked up: the last message of the subject (`STREAM.MSG.GET`, answered by the stream's
//! leader; none: 0, see [`last_sequence`]). The relay keeps what it knows, at most
//! [`MAX_KEPT_SUBJECTS`] subjects, and forgets everything when the relay takes work over or a publish fails.
//!
//! # A refusal
//!
//! A refusal means that a newer message exists on the subject: another relay published
//! after this one was paused, or the row itself was stored earlier and its re-publish came
//! past the duplicate window. It is no fault of the row: it is never counted against it nor
//! parked. The relay stops the batch, forgets what it knew, and checks again: its session
//! (a relay that lost its lease stops there) and the rows, which it reads again; a row in the
//! stream already is found by its message id (see [`reconcile`](crate::reconcile)) and marked
//! instead of sent.

use std::collections::HashMap;

use async_nats::jetstream::{self, stream::LastRawMessageErrorKind};
use futures_util::StreamExt;

/// The header that carries the expected last sequence of the message's subject.
pub const FENCE_HEADER: &str = "Nats-Expected-Last-Subject-Sequence";

/// The most subjects whose last sequence a relay task keeps; past it, it forgets them all.
pub const MAX_KEPT_SUBJECTS: usize = 100_000;

/// Subjects looked up at once.
const CONCURRENT_LOOKUPS: usize = 32;

/// The stream sequence of the last message on `subject` in `stream`, 0 when it holds none.
pub async fn last_sequence(
    js: &jetstream::Context,
    stream: &str,
    subject: &str,
) -> Result<u64, async_nats::Error> {
    let stream = js.get_stream_no_info(stream).await?;
    match stream.get_last_raw_message_by_subject(subject).await {
        Ok(m) => Ok(m.sequence),
        Err(e) if matches!(e.kind(), LastRawMessageErrorKind::NoMessageFound) => Ok(0),
        Err(e) => Err(e.into()),
    }
}

/// What a relay task knows of the last sequence of the subjects it publishes (see the
/// [module documentation](self)).
#[derive(Debug)]
pub(crate) struct Fence {
    js: jetstream::Context,
    stream: String,
    last: HashMap<String, u64>,
}

impl Fence {
    pub(crate) fn new(js: jetstream::Context, stream: &str) -> Self {
        Fence {
            js,
            stream: stream.to_owned(),
            last: HashMap::new(),
        }
    }

    /// The last sequence of `subject`, if known.
    pub(crate) fn expected(&self, subject: &str) -> Option<u64> {
        self.last.get(subject).copied()
    }

    /// Records that `seq` is the last sequence of `subject` (an ack, or a look-up).
    pub(crate) fn set(&mut self, subject: String, seq: u64) {
        if self.last.len() >= MAX_KEPT_SUBJECTS && !self.last.contains_key(&subject) {
            self.last.clear();
        }
        self.last.insert(subject, seq);
    }

    /// Forgets `subject`: its next publish looks it up.
    pub(crate) fn forget_subject(&mut self, subject: &str) {
        self.last.remove(subject);
    }

    /// Forgets every subject: after a takeover, or a failed publish.
    pub(crate) fn forget(&mut self) {
        self.last.clear();
    }

    /// Looks the subjects of `subjects` up, a few at once, and keeps what it finds.
    pub(crate) async fn look_up(&mut self, subjects: Vec<String>) -> Result<(), async_nats::Error> {
        if subjects.is_empty() {
            return Ok(());
        }
        let (js, stream) = (&self.js, self.stream.as_str());
        let found: Vec<_> = futures_util::stream::iter(subjects)
            .map(|subject| async move {
                let seq = last_sequence(js, stream, &subject).await;
                (subject, seq)
            })
            .buffer_unordered(CONCURRENT_LOOKUPS)
            .collect()
            .await;
        for (subject, seq) in found {
            self.set(subject, seq?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_fence_keeps_a_bounded_number_of_subjects_and_forgets_on_demand() {
        // a client that never connects: the fence makes no request here
        let client = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect("127.0.0.1:1")
            .await
            .expect("a client");
        let mut fence = Fence::new(jetstream::new(client), "S");
        fence.set("a".into(), 7);
        assert_eq!(fence.expected("a"), Some(7));
        fence.forget_subject("a");
        assert_eq!(fence.expected("a"), None);
        for i in 0..MAX_KEPT_SUBJECTS {
            fence.set(i.to_string(), i as u64);
        }
        assert_eq!(fence.last.len(), MAX_KEPT_SUBJECTS);
        fence.set("one more".into(), 1);
        assert_eq!(fence.last.len(), 1, "past the bound it starts again");
        fence.forget();
        assert_eq!(fence.expected("one more"), None);
        // nothing to look up: no request
        fence.look_up(Vec::new()).await.expect("no look-up");
    }
}
