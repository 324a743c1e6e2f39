//! Command-line arguments shared by the `outbox-relay` binary and services built on this crate
//! (feature `cli`): the NATS connection flags and the database flags, defined once, with the
//! environment variables every NATS tool and libpq user knows.
//!
//! ```
//! use clap::Parser;
//! use outbox_nats::cli::NatsArgs;
//!
//! #[derive(Parser)]
//! struct Args {
//!     #[command(flatten)]
//!     nats: NatsArgs,
//! }
//!
//! let args = Args::parse_from(["svc", "--nats-url", "nats://a:4222,nats://b:4222"]);
//! let options = args.nats.options();
//! assert_eq!(options.url, "nats://a:4222,nats://b:4222");
//! ```

use std::path::PathBuf;

use clap::Args;
use outbox_diesel::OutboxTable;

use crate::{NatsOptions, redact_url};

/// The NATS connection: `--nats-url` (a seed list too) and the credentials and TLS flags,
/// each with its `NATS_*` environment variable. Its `Debug` shows no secret.
#[derive(Clone, Args)]
#[non_exhaustive]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated.
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    pub nats_url: String,
    /// NATS credentials file (.creds).
    #[arg(long, env = "NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// NATS nkey seed.
    #[arg(long, env = "NATS_NKEY", hide_env_values = true)]
    pub nats_nkey: Option<String>,
    /// NATS user (with --nats-password).
    #[arg(long, env = "NATS_USER")]
    pub nats_user: Option<String>,
    /// NATS password.
    #[arg(long, env = "NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,
    /// NATS token.
    #[arg(long, env = "NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,
    /// Require TLS to NATS.
    #[arg(long, env = "NATS_TLS_REQUIRED")]
    pub nats_tls_required: bool,
    /// CA certificate (PEM) for NATS TLS.
    #[arg(long, env = "NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for NATS TLS.
    #[arg(long, env = "NATS_TLS_CERT", requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,
    /// Client key (PEM) for NATS TLS.
    #[arg(long, env = "NATS_TLS_KEY", requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,
}

impl NatsArgs {
    /// The connection options these flags describe.
    pub fn options(&self) -> NatsOptions {
        let mut nats = NatsOptions::new(self.nats_url.clone());
        nats.credentials_file = self.nats_creds.clone();
        nats.nkey_seed = self.nats_nkey.clone();
        nats.user = self.nats_user.clone();
        nats.password = self.nats_password.clone();
        nats.token = self.nats_token.clone();
        nats.tls_required = self.nats_tls_required;
        nats.tls_ca = self.nats_tls_ca.clone();
        nats.tls_cert = self.nats_tls_cert.clone();
        nats.tls_key = self.nats_tls_key.clone();
        nats
    }
}

/// The database holding the outbox: `--database-url` (`DATABASE_URL`, libpq's URL or
/// `key=value` form) and `--table` (`OUTBOX_TABLE`). Its `Debug` shows no password.
#[derive(Clone, Args)]
#[non_exhaustive]
pub struct DbArgs {
    /// PostgreSQL URL of the database holding the outbox.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// The outbox table, `table` or `schema.table`.
    #[arg(long, env = "OUTBOX_TABLE", default_value = "outbox")]
    pub table: OutboxTable,
}

impl std::fmt::Debug for NatsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // the options' own form, which hides the password, the token and the nkey seed
        self.options().fmt(f)
    }
}

impl std::fmt::Debug for DbArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DbArgs")
            .field("database_url", &redact_url(&self.database_url))
            .field("table", &self.table)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        db: DbArgs,
    }

    #[test]
    fn debug_shows_no_secret() {
        let args = Args::parse_from([
            "svc",
            "--nats-url",
            "nats://u:natssecret@a:4222",
            "--nats-token",
            "tokensecret",
            "--nats-password",
            "pwsecret",
            "--database-url",
            "postgres://relay:dbsecret@db/app",
        ]);
        let shown = format!("{:?} {:?}", args.nats, args.db);
        for secret in ["natssecret", "tokensecret", "pwsecret", "dbsecret"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("relay"), "{shown}");
    }
}
