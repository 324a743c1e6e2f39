//! Connection settings: [`PgConnectOptions`] reads a database URL in libpq's vocabulary, TLS
//! settings included, for [`connect`](crate::connect) and the replication connection. Taking
//! the TLS settings out of the URL is in `url.rs`; the TLS itself, rustls (no OpenSSL), in
//! `tls.rs`.

mod tls;
mod url;

use std::path::PathBuf;
use std::sync::Arc;

use diesel_async::AsyncPgConnection;

use crate::ConnectError;
use tls::RustlsConnector;
pub use tls::ensure_crypto_provider;
use url::{split_key_values, split_url};

/// libpq's `sslmode`: whether TLS is used, and what of the server's certificate is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SslMode {
    /// Plaintext only.
    Disable,
    /// TLS when the server offers it, without checking its certificate (libpq's default).
    #[default]
    Prefer,
    /// TLS or nothing; the certificate is checked against `sslrootcert` when one is given.
    Require,
    /// TLS; the server's certificate chain must lead to a trusted CA.
    VerifyCa,
    /// TLS; as `VerifyCa`, and the certificate must name the host connected to.
    VerifyFull,
}

impl std::str::FromStr for SslMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" | "allow" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(format!(
                    "sslmode={other:?} is not one of disable, prefer, require, verify-ca, verify-full"
                ));
            }
        })
    }
}

/// The database URL cannot be used: what is wrong with it (never the URL itself, which may
/// hold a password).
#[derive(Debug, Clone, thiserror::Error)]
#[error("the database URL is invalid: {reason}")]
pub struct InvalidUrl {
    /// What is wrong.
    pub reason: String,
}

/// A parsed database URL: the connection settings of `tokio-postgres` plus libpq's TLS
/// settings, which it lacks.
///
/// | setting | meaning |
/// |---|---|
/// | `sslmode=disable` | plaintext only |
/// | `sslmode=prefer` (the default, as libpq) | TLS when the server offers it, the certificate not checked; plaintext otherwise |
/// | `sslmode=require` | TLS or nothing; the certificate checked against `sslrootcert` when one is given (libpq's rule), not checked otherwise |
/// | `sslmode=verify-ca` | TLS, the certificate chain checked against `sslrootcert` |
/// | `sslmode=verify-full` | as `verify-ca`, and the certificate must name the host connected to |
/// | `sslrootcert=/path/ca.pem` | the CA (PEM) to trust: a managed database's CA bundle; without it (or with `system`), the Mozilla root set |
/// | `sslcert=/path/client.pem`, `sslkey=/path/client.key` | a client certificate (PEM) and its key, for `cert` authentication |
///
/// Both forms are read: `postgres://relay@db.example.com/app?sslmode=verify-full&sslrootcert=/etc/ca.pem`
/// and `host=db.example.com dbname=app user=relay sslmode=verify-full sslrootcert=/etc/ca.pem`.
/// Several hosts (`host=a,b`, `postgres://a:5432,b:5432/app`) with
/// `target_session_attrs=read-write` connect to whichever is the primary, as libpq does.
///
/// ```
/// use outbox_diesel::{PgConnectOptions, SslMode};
///
/// let opts = PgConnectOptions::parse(
///     "postgres://relay@db.example.com/app?sslmode=verify-full&sslrootcert=/etc/ca.pem",
/// )?;
/// assert_eq!(opts.ssl_mode(), SslMode::VerifyFull);
/// assert_eq!(opts.config().get_dbname(), Some("app"));
/// # Ok::<(), outbox_diesel::InvalidUrl>(())
/// ```
#[derive(Clone)]
pub struct PgConnectOptions {
    config: tokio_postgres::Config,
    ssl_mode: SslMode,
    root_cert: Option<PathBuf>,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
}

impl std::fmt::Debug for PgConnectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgConnectOptions")
            .field("hosts", &self.config.get_hosts())
            .field("ports", &self.config.get_ports())
            .field("user", &self.config.get_user())
            .field("dbname", &self.config.get_dbname())
            .field("ssl_mode", &self.ssl_mode)
            .field("root_cert", &self.root_cert)
            .field("client_cert", &self.client_cert)
            .finish_non_exhaustive()
    }
}

impl PgConnectOptions {
    /// Parses a database URL (`postgres://...` or `key=value ...`).
    pub fn parse(url: &str) -> Result<Self, InvalidUrl> {
        let bad = |reason: String| InvalidUrl { reason };
        let split = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            split_url(url)
        } else {
            split_key_values(url)
        };
        let (rest, tls) = match split {
            Ok(parts) => parts,
            // tokio-postgres says best what is wrong with a string it cannot read either
            Err(reason) => match url.parse::<tokio_postgres::Config>() {
                Err(e) => return Err(bad(e.to_string())),
                Ok(_) => return Err(bad(reason)),
            },
        };
        let mut config: tokio_postgres::Config = rest
            .parse()
            .map_err(|e: tokio_postgres::Error| bad(e.to_string()))?;
        let mut opts = PgConnectOptions {
            config: tokio_postgres::Config::new(),
            ssl_mode: SslMode::Prefer,
            root_cert: None,
            client_cert: None,
            client_key: None,
        };
        for (key, value) in tls {
            match key.as_str() {
                "sslmode" => opts.ssl_mode = value.parse().map_err(bad)?,
                "sslrootcert" => opts.root_cert = Some(PathBuf::from(value)),
                "sslcert" => opts.client_cert = Some(PathBuf::from(value)),
                _ => opts.client_key = Some(PathBuf::from(value)),
            }
        }
        if opts.client_cert.is_some() != opts.client_key.is_some() {
            return Err(bad(
                "sslcert and sslkey go together: give both or neither".into()
            ));
        }
        config.ssl_mode(match opts.ssl_mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        opts.config = config;
        Ok(opts)
    }

    /// The connection settings without the TLS ones.
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// The `sslmode`.
    pub fn ssl_mode(&self) -> SslMode {
        self.ssl_mode
    }

    /// What is checked of the server's certificate: `require` with a root certificate checks
    /// the chain, as libpq does.
    fn verification(&self) -> SslMode {
        match self.ssl_mode {
            SslMode::Require if self.root_cert.is_some() => SslMode::VerifyCa,
            mode => mode,
        }
    }

    /// Opens a connection, with TLS as `sslmode` says; a failure says whether it
    /// [can heal](ConnectError::can_heal).
    pub async fn connect(&self) -> Result<AsyncPgConnection, ConnectError> {
        ensure_crypto_provider();
        if self.ssl_mode == SslMode::Disable {
            return crate::connect::open(&self.config, tokio_postgres::NoTls).await;
        }
        let tls = RustlsConnector(Arc::new(
            self.client_config().map_err(ConnectError::tls_setup)?,
        ));
        crate::connect::open(&self.config, tls).await
    }

    #[cfg(feature = "relay")]
    pub(crate) fn replication_tls(&self) -> pgwire_replication::TlsConfig {
        use pgwire_replication::SslMode as M;
        let mode = match self.verification() {
            SslMode::Disable => M::Disable,
            SslMode::Prefer => M::Prefer,
            SslMode::Require => M::Require,
            SslMode::VerifyCa => M::VerifyCa,
            SslMode::VerifyFull => M::VerifyFull,
        };
        pgwire_replication::TlsConfig {
            mode,
            ca_pem_path: self.root_cert.clone().filter(|p| p.as_os_str() != "system"),
            sni_hostname: None,
            client_cert_pem_path: self.client_cert.clone(),
            client_key_pem_path: self.client_key.clone(),
        }
    }
}

impl std::str::FromStr for PgConnectOptions {
    type Err = InvalidUrl;

    fn from_str(s: &str) -> Result<Self, InvalidUrl> {
        PgConnectOptions::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::{PgConnectOptions, SslMode, split_key_values, split_url};

    #[test]
    fn reads_the_tls_settings_of_a_url() {
        let (rest, tls) = split_url(
            "postgres://u:p@h1:5432,h2:5433/db?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca%20b.pem",
        )
        .expect("url");
        assert_eq!(rest, "postgres://u:p@h1:5432,h2:5433/db?application_name=x");
        assert_eq!(
            tls,
            [
                ("sslmode".into(), "verify-full".into()),
                ("sslrootcert".into(), "/etc/ca b.pem".into())
            ]
        );
    }

    #[test]
    fn reads_the_tls_settings_of_key_values() {
        let (rest, tls) = split_key_values(
            "host=a,b  dbname = app sslmode=verify-ca sslrootcert='/etc/my ca.pem' password='it\\'s'",
        )
        .expect("key values");
        assert_eq!(rest, "host='a,b' dbname='app' password='it\\'s'");
        assert_eq!(
            tls,
            [
                ("sslmode".into(), "verify-ca".into()),
                ("sslrootcert".into(), "/etc/my ca.pem".into())
            ]
        );
        let opts = PgConnectOptions::parse(&format!("{rest} sslmode=require")).expect("parse");
        assert_eq!(opts.config().get_password(), Some(&b"it's"[..]));
        assert_eq!(opts.config().get_hosts().len(), 2);
    }

    #[test]
    fn refuses_an_unknown_sslmode_and_half_a_client_certificate() {
        let e = PgConnectOptions::parse("postgres://h/db?sslmode=verify").expect_err("mode");
        assert!(e.to_string().contains("verify-full"), "{e}");
        let e = PgConnectOptions::parse("host=h sslcert=/c.pem").expect_err("half");
        assert!(e.to_string().contains("sslkey"), "{e}");
    }

    #[test]
    fn require_with_a_root_certificate_checks_the_chain() {
        let opts =
            PgConnectOptions::parse("host=h sslmode=require sslrootcert=/ca.pem").expect("parse");
        assert_eq!(opts.verification(), SslMode::VerifyCa);
        let opts = PgConnectOptions::parse("host=h").expect("parse");
        assert_eq!(opts.ssl_mode(), SslMode::Prefer);
    }
}
