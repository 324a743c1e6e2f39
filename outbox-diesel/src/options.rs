//! Connection settings: [`PgConnectOptions`] reads a database URL in libpq's vocabulary, TLS
//! settings included, for [`connect`](crate::connect) and the replication connection; the
//! TLS itself is rustls (no OpenSSL).

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use diesel_async::AsyncPgConnection;

use crate::ConnectError;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ClientConfig, WebPkiServerVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::Socket;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

/// Makes ring the process's rustls crypto provider unless one is installed already (an
/// application's own choice stays). The dependency tree enables both of rustls's providers
/// (ring and aws-lc-rs), so rustls cannot pick one by itself, and clients that use the
/// process's provider (the NATS client's TLS, the replication connection's) would panic.
/// The relay calls it before opening TLS connections; an application that opens its own
/// before using the outbox calls it first, or installs a provider itself.
pub fn ensure_crypto_provider() {
    if CryptoProvider::get_default().is_none() {
        // another thread may win the race: its provider is as good
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

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

/// The TLS settings libpq knows and `tokio-postgres` does not.
const TLS_KEYS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

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

    /// The rustls configuration for these settings.
    fn client_config(&self) -> Result<ClientConfig, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let algorithms = provider.signature_verification_algorithms;
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS set-up: {e}"))?;
        let verifier: Arc<dyn ServerCertVerifier> = match self.verification() {
            SslMode::VerifyFull => self.webpki_verifier(provider)?,
            SslMode::VerifyCa => Arc::new(AnyHostName(self.webpki_verifier(provider)?)),
            _ => Arc::new(AnyCertificate(algorithms)),
        };
        let builder = builder
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => {
                let chain = read_certs(cert, "sslcert")?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("cannot read sslkey {}: {e}", key.display()))?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    format!("sslcert and sslkey do not make a client certificate: {e}")
                })
            }
            _ => Ok(builder.with_no_client_auth()),
        }
    }

    fn webpki_verifier(
        &self,
        provider: Arc<CryptoProvider>,
    ) -> Result<Arc<WebPkiServerVerifier>, String> {
        let mut roots = RootCertStore::empty();
        match &self.root_cert {
            Some(path) if path.as_os_str() != "system" => {
                for cert in read_certs(path, "sslrootcert")? {
                    roots.add(cert).map_err(|e| {
                        format!("sslrootcert {}: not a CA certificate: {e}", path.display())
                    })?;
                }
            }
            _ => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        }
        WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| format!("TLS set-up: {e}"))
    }

    /// The same settings for a replication connection (`pgwire-replication`).
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

fn read_certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("cannot read {what} {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{what} {} holds no PEM certificate",
            path.display()
        ));
    }
    Ok(certs)
}

/// Splits a `postgres://` URL into the URL without the TLS settings and those settings.
#[allow(clippy::type_complexity)]
fn split_url(url: &str) -> Result<(String, Vec<(String, String)>), String> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), Vec::new()));
    };
    let mut kept = Vec::new();
    let mut tls = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let decode = |s: &str| {
            percent_decode(s).ok_or_else(|| format!("the parameter {key:?} is not valid UTF-8"))
        };
        let key_text = decode(key)?;
        if TLS_KEYS.contains(&key_text.as_str()) {
            tls.push((key_text, decode(value)?));
        } else {
            kept.push(pair);
        }
    }
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((rest, tls))
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// Splits a `key=value` string into the string without the TLS settings and those settings.
#[allow(clippy::type_complexity)]
fn split_key_values(s: &str) -> Result<(String, Vec<(String, String)>), String> {
    let mut kept = Vec::new();
    let mut tls = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(format!("expected `=` after {key:?}"));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    Some('\\') => value.extend(chars.next()),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => return Err(format!("the value of {key:?} has no closing quote")),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        if TLS_KEYS.contains(&key.as_str()) {
            tls.push((key, value));
        } else {
            let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
            kept.push(format!("{key}='{quoted}'"));
        }
    }
    Ok((kept.join(" "), tls))
}

/// A server certificate checker that accepts any certificate (`sslmode=prefer`/`require`
/// without a root certificate, as libpq), still checking the handshake's signatures.
#[derive(Debug)]
struct AnyCertificate(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}

/// `sslmode=verify-ca`: the chain is checked, the name in the certificate is not.
#[derive(Debug)]
struct AnyHostName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyHostName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        use rustls::CertificateError::{NotValidForName, NotValidForNameContext};
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                NotValidForName | NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `tokio-postgres`'s TLS hook over tokio-rustls.
#[derive(Clone)]
struct RustlsConnector(Arc<ClientConfig>);

impl MakeTlsConnect<Socket> for RustlsConnector {
    type Stream = RustlsStream;
    type TlsConnect = RustlsConnect;
    type Error = rustls::pki_types::InvalidDnsNameError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, Self::Error> {
        Ok(RustlsConnect {
            config: self.0.clone(),
            name: ServerName::try_from(domain.to_owned())?,
        })
    }
}

struct RustlsConnect {
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
}

impl TlsConnect<Socket> for RustlsConnect {
    type Stream = RustlsStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            tokio_rustls::TlsConnector::from(self.config)
                .connect(self.name, stream)
                .await
                .map(|s| RustlsStream(Box::new(s)))
        })
    }
}

/// A TLS stream to the server.
struct RustlsStream(Box<tokio_rustls::client::TlsStream<Socket>>);

impl TlsStream for RustlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl AsyncRead for RustlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for RustlsStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
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
