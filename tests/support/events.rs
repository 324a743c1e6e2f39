//! The event the tests record: an account changed, numbered per account, with an optional
//! blob for large payloads.

use outbox_diesel::OutboxEvent;
use serde::Serialize;

#[derive(Debug, Clone, Serialize, OutboxEvent)]
#[outbox(aggregate_type = "account", event_type = "account.changed")]
pub struct Changed {
    #[outbox(aggregate_id)]
    pub account: String,
    pub n: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blob: Option<String>,
}

/// Account `account`'s change number `n`, without a blob.
pub fn changed(account: &str, n: i64) -> Changed {
    Changed {
        account: account.into(),
        n,
        blob: None,
    }
}
