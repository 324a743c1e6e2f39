//! [`ConsumerConfig`]: the durable consumer, its stream, and the retry policy.

use std::fmt;
use std::time::Duration;

use async_nats::jetstream;
use outbox_diesel::Inbox;

/// Everything a [`Consumer`](super::Consumer) needs besides its NATS client.
///
/// ```
/// use std::time::Duration;
/// use outbox_nats::consumer::ConsumerConfig;
///
/// let config = ConsumerConfig::new("billing", "postgres://billing@db/billing")
///     .filter_subject("outbox.order.>")
///     .ack_wait(Duration::from_secs(10))
///     .max_ack_pending(100);
/// assert_eq!(config.stream, "OUTBOX");
/// assert_eq!(config.durable_name, "billing");
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct ConsumerConfig {
    /// The durable consumer's name; also the consumer's name in the inbox.
    pub durable_name: String,
    /// PostgreSQL connection URL of the consumer's own database (which holds the inbox).
    pub database_url: String,
    /// The stream (default `OUTBOX`).
    pub stream: String,
    /// Only messages whose subject matches (default: every message of the stream).
    pub filter_subject: Option<String>,
    /// Messages delivered and not yet acked, across every instance (default 1000).
    pub max_ack_pending: i64,
    /// How long JetStream waits for an ack before delivering again (default 30 s).
    pub ack_wait: Duration,
    /// Deliveries after which JetStream gives up on a message; `-1` for no limit (the default).
    pub max_deliver: i64,
    /// Messages asked for per pull request (default 10).
    pub batch_size: usize,
    /// How long a pull request waits for messages before a new one is sent (default 5 s).
    pub fetch_wait: Duration,
    /// The first nak delay after a failure (default 1 s); doubled per delivery.
    pub retry_delay: Duration,
    /// The longest nak delay, and the longest wait between reconnections (default 1 min).
    pub max_retry_delay: Duration,
    /// The delivery at which an undecodable message is terminated (default 5).
    pub undecodable_after: u32,
    /// Ack messages whose event type `E` does not list instead of treating them as
    /// undecodable (default off).
    pub skip_unknown_event_types: bool,
    /// The inbox table (default `processed_messages`).
    pub inbox: Inbox,
    /// How long the first connections are retried before [`Consumer::run`](super::Consumer::run) gives up
    /// (default 30 s).
    pub startup_timeout: Duration,
}

/// The database URL is shown without its password.
impl fmt::Debug for ConsumerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerConfig")
            .field("durable_name", &self.durable_name)
            .field("database_url", &crate::redact_url(&self.database_url))
            .field("stream", &self.stream)
            .field("filter_subject", &self.filter_subject)
            .field("max_ack_pending", &self.max_ack_pending)
            .field("ack_wait", &self.ack_wait)
            .field("max_deliver", &self.max_deliver)
            .field("batch_size", &self.batch_size)
            .field("fetch_wait", &self.fetch_wait)
            .field("retry_delay", &self.retry_delay)
            .field("max_retry_delay", &self.max_retry_delay)
            .field("undecodable_after", &self.undecodable_after)
            .field("skip_unknown_event_types", &self.skip_unknown_event_types)
            .field("inbox", &self.inbox)
            .field("startup_timeout", &self.startup_timeout)
            .finish_non_exhaustive()
    }
}

impl ConsumerConfig {
    /// The defaults for the durable consumer `durable_name`, with its database at
    /// `database_url`.
    pub fn new(durable_name: impl Into<String>, database_url: impl Into<String>) -> Self {
        ConsumerConfig {
            durable_name: durable_name.into(),
            database_url: database_url.into(),
            stream: "OUTBOX".into(),
            filter_subject: None,
            max_ack_pending: 1000,
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            batch_size: 10,
            fetch_wait: Duration::from_secs(5),
            retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(60),
            undecodable_after: 5,
            skip_unknown_event_types: false,
            inbox: Inbox::default(),
            startup_timeout: Duration::from_secs(30),
        }
    }

    /// Sets [`ConsumerConfig::stream`].
    pub fn stream(mut self, stream: impl Into<String>) -> Self {
        self.stream = stream.into();
        self
    }

    /// Sets [`ConsumerConfig::filter_subject`].
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = Some(subject.into());
        self
    }

    /// Sets [`ConsumerConfig::max_ack_pending`].
    pub fn max_ack_pending(mut self, n: i64) -> Self {
        self.max_ack_pending = n;
        self
    }

    /// Sets [`ConsumerConfig::ack_wait`].
    pub fn ack_wait(mut self, d: Duration) -> Self {
        self.ack_wait = d;
        self
    }

    /// Sets [`ConsumerConfig::max_deliver`].
    pub fn max_deliver(mut self, n: i64) -> Self {
        self.max_deliver = n;
        self
    }

    /// Sets [`ConsumerConfig::batch_size`].
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Sets [`ConsumerConfig::fetch_wait`].
    pub fn fetch_wait(mut self, d: Duration) -> Self {
        self.fetch_wait = d;
        self
    }

    /// Sets [`ConsumerConfig::retry_delay`] and [`ConsumerConfig::max_retry_delay`].
    pub fn retry_delay(mut self, first: Duration, max: Duration) -> Self {
        self.retry_delay = first;
        self.max_retry_delay = max;
        self
    }

    /// Sets [`ConsumerConfig::undecodable_after`].
    pub fn undecodable_after(mut self, deliveries: u32) -> Self {
        self.undecodable_after = deliveries;
        self
    }

    /// Sets [`ConsumerConfig::skip_unknown_event_types`].
    pub fn skip_unknown_event_types(mut self, on: bool) -> Self {
        self.skip_unknown_event_types = on;
        self
    }

    /// Sets [`ConsumerConfig::inbox`].
    pub fn inbox(mut self, inbox: Inbox) -> Self {
        self.inbox = inbox;
        self
    }

    /// Sets [`ConsumerConfig::startup_timeout`].
    pub fn startup_timeout(mut self, d: Duration) -> Self {
        self.startup_timeout = d;
        self
    }

    /// Checks the values against each other and JetStream's rules.
    pub fn validate(&self) -> Result<(), String> {
        let name = &self.durable_name;
        if name.is_empty()
            || name
                .chars()
                .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
        {
            return Err(format!(
                "durable name {name:?} must be non-empty, without white space, `.`, `*`, `>`, `/` or `\\`"
            ));
        }
        if self.stream.is_empty() {
            return Err("the stream name is empty".into());
        }
        if self.max_ack_pending == 0 || self.max_ack_pending < -1 {
            return Err("max_ack_pending must be at least 1 (or -1 for no limit)".into());
        }
        if self.max_deliver == 0 || self.max_deliver < -1 {
            return Err("max_deliver must be at least 1 (or -1 for no limit)".into());
        }
        if self.ack_wait < Duration::from_millis(100) {
            return Err("ack_wait must be at least 100ms".into());
        }
        if self.batch_size == 0 {
            return Err("batch_size must be at least 1".into());
        }
        if self.fetch_wait < Duration::from_millis(10) {
            return Err("fetch_wait must be at least 10ms".into());
        }
        if self.undecodable_after == 0 {
            return Err("undecodable_after must be at least 1".into());
        }
        if self.retry_delay > self.max_retry_delay {
            return Err("retry_delay must not exceed max_retry_delay".into());
        }
        Ok(())
    }

    /// The JetStream configuration of the durable consumer.
    pub(super) fn pull_config(&self) -> jetstream::consumer::pull::Config {
        jetstream::consumer::pull::Config {
            durable_name: Some(self.durable_name.clone()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            max_ack_pending: self.max_ack_pending,
            max_deliver: self.max_deliver,
            filter_subject: self.filter_subject.clone().unwrap_or_default(),
            ..Default::default()
        }
    }

    /// The nak delay of a message's `delivered`-th delivery.
    pub(super) fn retry_delay_for(&self, delivered: u64) -> Duration {
        let doublings = delivered.saturating_sub(1).min(20) as u32;
        self.retry_delay
            .saturating_mul(1 << doublings)
            .min(self.max_retry_delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_double_up_to_the_cap() {
        let cfg = ConsumerConfig::new("c", "postgres://x/y")
            .retry_delay(Duration::from_millis(100), Duration::from_millis(500));
        let delays: Vec<_> = (1..=5)
            .map(|d| cfg.retry_delay_for(d).as_millis())
            .collect();
        assert_eq!(delays, [100, 200, 400, 500, 500]);
    }
}
