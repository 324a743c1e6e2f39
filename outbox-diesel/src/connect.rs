//! Opening an async connection: [`connect`] is the one place the outbox opens one (the
//! relay in every mode, the consumer helper, the operating commands). It reads libpq's
//! settings, TLS included ([`PgConnectOptions`]), keeps the server's reason for a failure and
//! says whether retrying can help. [`establish`] is the same for an application's own pools.

use std::error::Error as _;
use std::future::Future;

use diesel_async::AsyncPgConnection;
use tokio_postgres::Socket;
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};

use crate::options::{InvalidUrl, PgConnectOptions};

/// What to check when the TLS handshake fails on the server's certificate.
const TLS_FIX: &str = "check sslrootcert (the CA that signed the server's certificate) and that the host in the URL is a name the certificate holds (sslmode=verify-full); sslcert and sslkey for a client certificate";

/// Why a connection to PostgreSQL could not be opened.
///
/// [`ConnectError::can_heal`] tells a failure that may pass (the server is down, starting up,
/// shutting down or full; the network timed out) from one that cannot (a URL that does not
/// parse, a database or role that does not exist, refused credentials). Its message is the
/// reason as the server or the network gave it, with the server's address, never with a
/// password.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
pub struct ConnectError {
    reason: String,
    sqlstate: Option<String>,
    heals: bool,
    fix: Option<&'static str>,
}

impl ConnectError {
    /// Whether retrying may succeed: a refused or timed-out connection, a server starting up,
    /// shutting down or out of connection slots. `false` for a bad URL, a missing database or
    /// role, refused credentials: retrying those cannot help.
    pub fn can_heal(&self) -> bool {
        self.heals
    }

    /// The server's SQLSTATE, when the server refused the connection (`3D000`: no such
    /// database, `28P01`: wrong password, `57P03`: starting up, ...).
    pub fn sqlstate(&self) -> Option<&str> {
        self.sqlstate.as_deref()
    }

    /// What to change, for a failure that cannot heal.
    pub fn fix(&self) -> Option<&'static str> {
        self.fix
    }

    fn from_postgres(e: &tokio_postgres::Error, at: &str, plaintext: bool) -> Self {
        if let Some(db) = e.as_db_error() {
            let code = db.code();
            let heals = sqlstate_can_heal(code);
            let fix = match code {
                c if *c == SqlState::INVALID_CATALOG_NAME => Some(
                    "the database does not exist: create it, or name an existing one in the URL",
                ),
                // decided on what was asked, not on the message, which the server words in
                // its own language (lc_messages)
                c if *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION && plaintext => Some(
                    "the server refused this connection without TLS: if it accepts TLS connections only (managed PostgreSQL does), add sslmode=verify-full and sslrootcert=<the server's CA> to the URL; otherwise check the role and pg_hba.conf",
                ),
                c if *c == SqlState::INVALID_PASSWORD
                    || *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION =>
                {
                    Some(
                        "the server refused the role: check the user name and password in the URL, the role's LOGIN right and pg_hba.conf",
                    )
                }
                c if *c == SqlState::INSUFFICIENT_PRIVILEGE => {
                    Some("the role may not connect: GRANT CONNECT ON DATABASE to it")
                }
                _ if heals => None,
                _ => Some("check the URL"),
            };
            return ConnectError {
                reason: format!("{at}{}: {}", db.severity(), db.message()),
                sqlstate: Some(code.code().to_owned()),
                heals,
                fix,
            };
        }
        // the kinds tokio-postgres does not expose are told apart by their cause: the network
        // (an I/O error) and a connection closed during start-up can heal; a URL that does
        // not parse, a missing password, a failed authentication or TLS set-up cannot
        let mut chain = e.to_string();
        let mut io = None;
        let mut certificate = false;
        let mut source = e.source();
        while let Some(s) = source {
            chain.push_str(": ");
            chain.push_str(&s.to_string());
            if let Some(e) = s.downcast_ref::<std::io::Error>() {
                io = Some(e.to_string());
                // the TLS handshake refused the peer: retrying cannot change the certificate
                certificate |= e.get_ref().is_some_and(|inner| inner.is::<rustls::Error>());
            }
            source = s.source();
        }
        if certificate {
            return ConnectError {
                reason: format!("{at}{chain}"),
                sqlstate: None,
                heals: false,
                fix: Some(TLS_FIX),
            };
        }
        let heals = io.is_some() || e.is_closed();
        ConnectError {
            reason: match io {
                // "connection to server at "db", port 5432 failed: Connection refused", as libpq
                Some(io) => format!("{at}{io}"),
                None if heals => format!("{at}{chain}"),
                None => chain,
            },
            sqlstate: None,
            heals,
            fix: (!heals).then_some(URL_FIX),
        }
    }
}

impl ConnectError {
    pub(crate) fn invalid_url(e: InvalidUrl) -> Self {
        ConnectError {
            reason: e.to_string(),
            sqlstate: None,
            heals: false,
            fix: Some(URL_FIX),
        }
    }

    pub(crate) fn tls_setup(reason: String) -> Self {
        ConnectError {
            reason,
            sqlstate: None,
            heals: false,
            fix: Some(TLS_FIX),
        }
    }
}

const URL_FIX: &str = "give a PostgreSQL URL (postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE) or key=value pairs (host=... user=... dbname=...)";

/// Whether a server's refusal with `code` may pass: connection exceptions (class 08),
/// insufficient resources (class 53: too many connections, out of memory or disk), a server
/// starting up, shutting down or in recovery (57P01-57P03), a system error (class 58).
fn sqlstate_can_heal(code: &SqlState) -> bool {
    let c = code.code();
    c.starts_with("08")
        || c.starts_with("53")
        || c.starts_with("58")
        || matches!(c, "57P01" | "57P02" | "57P03")
}

/// `connection to server at "host", port P failed: `, as libpq says it.
fn server_at(config: &tokio_postgres::Config) -> String {
    let ports = config.get_ports();
    let servers: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            match host {
                tokio_postgres::config::Host::Tcp(h) => format!("\"{h}\", port {port}"),
                #[cfg(unix)]
                tokio_postgres::config::Host::Unix(p) => {
                    format!("socket \"{}/.s.PGSQL.{port}\"", p.display())
                }
            }
        })
        .collect();
    if servers.is_empty() {
        String::new()
    } else {
        format!("connection to server at {} failed: ", servers.join(", "))
    }
}

/// Opens an async connection to `database_url` (a `postgres://` URL or `key=value` pairs, as
/// libpq takes them). Unlike `AsyncPgConnection::establish`, a failure keeps its reason (the
/// server's message or the network's) and says whether it [can heal](ConnectError::can_heal).
///
/// ```no_run
/// # async fn run() -> Result<(), outbox_diesel::ConnectError> {
/// match outbox_diesel::connect("postgres://relay@127.0.0.1/app").await {
///     Ok(conn) => { /* ... */ }
///     Err(e) if e.can_heal() => { /* retry later */ }
///     Err(e) => return Err(e), // a missing database, a refused role, a bad URL
/// }
/// # Ok(()) }
/// ```
pub async fn connect(database_url: &str) -> Result<AsyncPgConnection, ConnectError> {
    PgConnectOptions::parse(database_url)
        .map_err(ConnectError::invalid_url)?
        .connect()
        .await
}

/// Opens a connection with `config` over `tls`.
pub(crate) async fn open<T>(
    config: &tokio_postgres::Config,
    tls: T,
) -> Result<AsyncPgConnection, ConnectError>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let at = server_at(config);
    let plaintext = config.get_ssl_mode() == tokio_postgres::config::SslMode::Disable;
    let (client, connection) = config
        .connect(tls)
        .await
        .map_err(|e| ConnectError::from_postgres(&e, &at, plaintext))?;
    AsyncPgConnection::try_from_client_and_connection(client, connection)
        .await
        .map_err(|e| ConnectError {
            reason: format!("{at}{e}"),
            sqlstate: None,
            heals: true,
            fix: None,
        })
}

/// [`connect`] for code that wants Diesel's error type: a drop-in for
/// `AsyncPgConnection::establish` with the same settings (TLS included), and the connection
/// builder of an application's own pool, so that its connections read them too:
///
/// ```no_run
/// use diesel_async::AsyncPgConnection;
/// use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
///
/// let mut config = ManagerConfig::default();
/// config.custom_setup = Box::new(outbox_diesel::establish);
/// let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(
///     "postgres://app@db.example.com/app?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem",
///     config,
/// );
/// # let _ = manager;
/// ```
pub fn establish(
    database_url: &str,
) -> std::pin::Pin<Box<dyn Future<Output = diesel::ConnectionResult<AsyncPgConnection>> + Send + '_>>
{
    Box::pin(async move {
        connect(database_url).await.map_err(|e| {
            diesel::ConnectionError::BadConnection(match e.fix() {
                Some(fix) => format!("{e}; {fix}"),
                None => e.to_string(),
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_url_that_does_not_parse_cannot_heal_and_says_what_to_give() {
        let e = connect("http://example.com/app")
            .await
            .err()
            .expect("refused");
        assert!(!e.can_heal(), "{e}");
        assert!(e.to_string().contains("invalid connection string"), "{e}");
        assert!(e.fix().is_some_and(|f| f.contains("postgres://")));
    }

    #[tokio::test]
    async fn a_refused_connection_can_heal_and_keeps_the_reason_and_the_address() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let e = connect(&format!("postgres://u:secret@127.0.0.1:{port}/db"))
            .await
            .err()
            .expect("refused");
        assert!(e.can_heal(), "{e}");
        let text = e.to_string();
        assert!(
            text.contains(&format!(
                "connection to server at \"127.0.0.1\", port {port} failed"
            )) && text.contains("refused"),
            "{text}"
        );
        assert!(!text.contains("secret") && !format!("{e:?}").contains("secret"));
    }

    #[test]
    fn sqlstates_of_a_server_that_is_busy_or_starting_heal_and_others_do_not() {
        for heals in ["57P03", "53300", "08006", "57P01"] {
            assert!(sqlstate_can_heal(&SqlState::from_code(heals)), "{heals}");
        }
        for not in ["3D000", "28P01", "28000", "42501", "55000"] {
            assert!(!sqlstate_can_heal(&SqlState::from_code(not)), "{not}");
        }
    }
}
