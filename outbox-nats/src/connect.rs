//! Connecting to NATS: [`NatsOptions`] gathers the server URL and the credentials.

use std::path::PathBuf;
use std::time::Duration;

use crate::redact_url;

/// How to reach and authenticate to NATS. Secrets are never logged: its `Debug` hides them.
///
/// ```no_run
/// use outbox_nats::NatsOptions;
/// # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let client = NatsOptions::new("nats://127.0.0.1:4222")
///     .credentials_file("/etc/nats/relay.creds")
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct NatsOptions {
    /// Server URL(s), comma-separated.
    pub url: String,
    /// A `.creds` file (JWT + nkey seed).
    pub credentials_file: Option<PathBuf>,
    /// An nkey seed.
    pub nkey_seed: Option<String>,
    /// User name (with `password`).
    pub user: Option<String>,
    /// Password.
    pub password: Option<String>,
    /// Token.
    pub token: Option<String>,
    /// Require TLS.
    pub tls_required: bool,
    /// A CA certificate (PEM) to trust.
    pub tls_ca: Option<PathBuf>,
    /// A client certificate (PEM), with `tls_key`.
    pub tls_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    pub tls_key: Option<PathBuf>,
    /// The client's name as the server shows it.
    pub name: Option<String>,
}

impl std::fmt::Debug for NatsOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |o: &Option<String>| o.as_ref().map(|_| "<hidden>");
        f.debug_struct("NatsOptions")
            .field("url", &redact_url(&self.url))
            .field("credentials_file", &self.credentials_file)
            .field("nkey_seed", &hidden(&self.nkey_seed))
            .field("user", &self.user)
            .field("password", &hidden(&self.password))
            .field("token", &hidden(&self.token))
            .field("tls_required", &self.tls_required)
            .finish_non_exhaustive()
    }
}

/// The user and password (or the token) in the first URL of `urls`, percent-decoded:
/// `nats://user:password@host` or `nats://token@host`.
fn url_credentials(urls: &str) -> Option<(String, Option<String>)> {
    let first = urls.split(',').next()?.trim();
    let rest = &first[first.find("://")? + 3..];
    let authority = rest.split('/').next()?;
    let (userinfo, _) = authority.rsplit_once('@')?;
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    match userinfo.split_once(':') {
        Some((user, password)) => Some((decode(user), Some(decode(password)))),
        None if !userinfo.is_empty() => Some((decode(userinfo), None)),
        None => None,
    }
}

/// `urls` without the user information of any of them.
fn without_credentials(urls: &str) -> String {
    urls.split(',')
        .map(|one| {
            let one = one.trim();
            let Some(scheme_end) = one.find("://").map(|i| i + 3) else {
                return one.to_owned();
            };
            let rest = &one[scheme_end..];
            let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
            match authority.rfind('@') {
                Some(at) => format!("{}{}", &one[..scheme_end], &rest[at + 1..]),
                None => one.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// NATS could not be reached or refused the credentials.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The credentials file could not be read.
    #[error("cannot read the NATS credentials file {path}: {source}")]
    CredentialsFile {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// `--nats-url` is not a server URL or a comma-separated list of them.
    #[error(
        "NATS server URL {seed:?} in {url:?} is invalid: {reason}; --nats-url (NATS_URL) takes one URL or a comma-separated seed list such as nats://n1:4222,nats://n2:4222"
    )]
    InvalidUrl {
        /// The whole setting, without secrets.
        url: String,
        /// The seed that is not a URL (empty when there was none).
        seed: String,
        /// Why.
        reason: String,
    },
    /// The server refused or could not be reached.
    #[error(
        "cannot connect to NATS at {url}: {source}; is nats-server running (with -js), and are --nats-url (NATS_URL) and the credentials right?"
    )]
    Connect {
        /// The URL, without secrets.
        url: String,
        /// The error.
        #[source]
        source: async_nats::ConnectError,
    },
}

impl ConnectError {
    /// Whether retrying may succeed: `false` for a URL that does not parse, credentials the
    /// server refuses or that cannot be read; `true` for a server that is down, unreachable or
    /// slow to answer.
    pub fn can_heal(&self) -> bool {
        use async_nats::ConnectErrorKind as K;
        match self {
            ConnectError::CredentialsFile { .. } | ConnectError::InvalidUrl { .. } => false,
            ConnectError::Connect { source, .. } => !matches!(
                source.kind(),
                K::ServerParse | K::Authentication | K::AuthorizationViolation
            ),
        }
    }
}

impl NatsOptions {
    /// Options for `url`, without credentials.
    pub fn new(url: impl Into<String>) -> Self {
        NatsOptions {
            url: url.into(),
            ..Default::default()
        }
    }

    /// Authenticates with a `.creds` file.
    pub fn credentials_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.credentials_file = Some(path.into());
        self
    }

    /// Connects. The client notices a dead connection within seconds (short ping interval)
    /// and reconnects on its own afterwards.
    pub async fn connect(&self) -> Result<async_nats::Client, ConnectError> {
        // TLS needs a process-wide rustls provider, which the build cannot pick by itself
        outbox_diesel::ensure_crypto_provider();
        let mut opts = async_nats::ConnectOptions::new()
            .ping_interval(Duration::from_secs(5))
            .connection_timeout(Duration::from_secs(5))
            .name(self.name.clone().unwrap_or_else(|| "outbox-relay".into()));
        if let Some(path) = &self.credentials_file {
            opts = opts.credentials_file(path).await.map_err(|source| {
                ConnectError::CredentialsFile {
                    path: path.clone(),
                    source,
                }
            })?;
        }
        if let Some(seed) = &self.nkey_seed {
            opts = opts.nkey(seed.clone());
        }
        if let (Some(user), Some(password)) = (&self.user, &self.password) {
            opts = opts.user_and_password(user.clone(), password.clone());
        }
        if let Some(token) = &self.token {
            opts = opts.token(token.clone());
        }
        // async-nats parses but does not use credentials in the URL: use them unless others
        // were given
        if self.user.is_none() && self.token.is_none() && self.nkey_seed.is_none() {
            match url_credentials(&self.url) {
                Some((user, Some(password))) => opts = opts.user_and_password(user, password),
                Some((token, None)) => opts = opts.token(token),
                None => {}
            }
        }
        if self.tls_required {
            opts = opts.require_tls(true);
        }
        if let Some(ca) = &self.tls_ca {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
        // the client logs its server URLs (at debug level): give it none with a password
        let servers = server_addrs(&without_credentials(&self.url)).map_err(|(seed, reason)| {
            ConnectError::InvalidUrl {
                url: redact_url(&self.url),
                seed,
                reason,
            }
        })?;
        opts.connect(servers)
            .await
            .map_err(|source| ConnectError::Connect {
                url: redact_url(&self.url),
                source,
            })
    }
}

/// The servers of a comma-separated seed list (`nats://a:4222,nats://b:4222`, as every NATS
/// tool takes it; blanks around the commas are allowed), or the seed that is not a server URL
/// and why.
fn server_addrs(urls: &str) -> Result<Vec<async_nats::ServerAddr>, (String, String)> {
    let seeds: Vec<&str> = urls
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if seeds.is_empty() {
        return Err((String::new(), "no server URL given".into()));
    }
    seeds
        .into_iter()
        .map(|seed| {
            seed.parse::<async_nats::ServerAddr>()
                .map_err(|e| (seed.to_owned(), e.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{server_addrs, url_credentials, without_credentials};

    #[test]
    fn reads_a_comma_separated_seed_list() {
        let servers =
            server_addrs("nats://a:4222, nats://b:4223 ,tls://c:4224,").expect("three seeds");
        let hosts: Vec<(String, u16)> = servers
            .iter()
            .map(|s| (s.host().to_owned(), s.port()))
            .collect();
        assert_eq!(
            hosts,
            [("a".into(), 4222), ("b".into(), 4223), ("c".into(), 4224)]
        );
        assert_eq!(server_addrs("127.0.0.1:4222").map(|s| s.len()), Ok(1));
    }

    #[test]
    fn names_the_seed_that_is_not_a_url() {
        let (seed, _) = server_addrs("nats://a:4222,nats://b:notaport").expect_err("bad port");
        assert_eq!(seed, "nats://b:notaport");
        assert!(server_addrs(" , ").is_err());
    }

    #[test]
    fn strips_credentials_from_the_urls() {
        assert_eq!(
            without_credentials("nats://relay:pw@127.0.0.1:4222, tls://tok@nats:4222,nats://n:1"),
            "nats://127.0.0.1:4222,tls://nats:4222,nats://n:1"
        );
        assert_eq!(without_credentials("127.0.0.1:4222"), "127.0.0.1:4222");
    }

    #[test]
    fn reads_credentials_from_the_url() {
        assert_eq!(
            url_credentials("nats://relay:s%40cret@127.0.0.1:4222,nats://other:4222"),
            Some(("relay".into(), Some("s@cret".into())))
        );
        assert_eq!(
            url_credentials("tls://tok@nats:4222"),
            Some(("tok".into(), None))
        );
        assert_eq!(url_credentials("nats://127.0.0.1:4222"), None);
        assert_eq!(url_credentials("127.0.0.1:4222"), None);
    }
}
