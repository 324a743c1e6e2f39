//! The examples' synchronous set-up: create the database when missing, then the tables, safe
//! to run from several processes started at the same moment.

use anyhow::{anyhow, bail};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};
use outbox_nats::redact_url;

/// The session advisory lock the set-up holds while it creates tables ("OBXSETUP").
const SETUP_LOCK: i64 = 0x4f42_5853_4554_5550;

/// Connects to `url`, creating its database first when it does not exist, then applies the
/// outbox migrations and `ddl` under a lock, so that two processes starting together neither
/// fail nor apply anything twice. `env` names the setting to point elsewhere
/// (`DATABASE_URL`).
pub fn prepare(url: &str, env: &str, ddl: &[&str]) -> anyhow::Result<()> {
    let mut conn = match PgConnection::establish(&with_connect_timeout(url)) {
        Ok(conn) => conn,
        Err(first) => {
            ensure_database(url, env, &first)?;
            PgConnection::establish(&with_connect_timeout(url))
                .map_err(|e| unreachable(url, env, &e))?
        }
    };
    diesel::sql_query("SELECT pg_advisory_lock($1)")
        .bind::<BigInt, _>(SETUP_LOCK)
        .execute(&mut conn)
        .map_err(|e| anyhow!("cannot take the set-up lock: {e}"))?;
    let result = (|| {
        outbox_diesel::run_migrations(&mut conn)
            .map_err(|e| anyhow!("cannot apply the outbox migration: {e}"))?;
        for sql in ddl {
            diesel::sql_query(*sql)
                .execute(&mut conn)
                .map_err(|e| anyhow!("cannot create the example's tables: {e}"))?;
        }
        Ok(())
    })();
    let _ = diesel::sql_query("SELECT pg_advisory_unlock($1)")
        .bind::<BigInt, _>(SETUP_LOCK)
        .execute(&mut conn);
    result
}

/// After a failed connection: creates the database when the server's catalog does not list
/// it. Another process creating it at the same moment is success, whatever error our own
/// `CREATE DATABASE` met (`42P04` or `23505` on `pg_database`): the catalog decides.
fn ensure_database(url: &str, env: &str, first: &ConnectionError) -> anyhow::Result<()> {
    let Some((name, maintenance)) = split_database(url) else {
        bail!(
            "{env} {} names no database; add one: .../outbox_shop",
            redact_url(url)
        );
    };
    // the server is down, or refuses us: report the first error
    let mut admin = PgConnection::establish(&with_connect_timeout(&maintenance))
        .map_err(|_| unreachable(url, env, first))?;
    if exists(&mut admin, &name)? {
        // there now: another process made it since our attempt, or the first error was about
        // something else; the caller's next attempt says which
        return Ok(());
    }
    let quoted = format!("\"{}\"", name.replace('"', "\"\""));
    match diesel::sql_query(format!("CREATE DATABASE {quoted}")).execute(&mut admin) {
        Ok(_) => {
            tracing::info!(database = %name, "created the database");
            Ok(())
        }
        Err(_) if exists(&mut admin, &name)? => Ok(()),
        Err(e) => bail!(
            "the database {name} does not exist and cannot be created: {e}. Create it \
             (createdb {name}) or set {env} to one that exists"
        ),
    }
}

fn exists(conn: &mut PgConnection, name: &str) -> anyhow::Result<bool> {
    #[derive(QueryableByName)]
    struct Found {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let found: Found =
        diesel::sql_query("SELECT count(*) AS n FROM pg_database WHERE datname = $1")
            .bind::<Text, _>(name)
            .get_result(conn)
            .map_err(|e| anyhow!("cannot read pg_database: {e}"))?;
    Ok(found.n > 0)
}

fn unreachable(url: &str, env: &str, e: &ConnectionError) -> anyhow::Error {
    let reason = e.to_string();
    let reason = reason
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .trim_end_matches('.');
    anyhow!(
        "cannot reach PostgreSQL at {}: {reason}.\n  Start PostgreSQL there, or set \
         {env}=postgres://USER[:PASSWORD]@HOST:PORT/DATABASE",
        redact_url(url)
    )
}

/// `(database, url of the `postgres` database on the same server)`.
fn split_database(url: &str) -> Option<(String, String)> {
    let after_scheme = url.find("://")? + 3;
    let path = after_scheme + url[after_scheme..].find('/')?;
    let end = url[path..].find('?').map_or(url.len(), |q| path + q);
    let name = &url[path + 1..end];
    if name.is_empty() {
        return None;
    }
    Some((
        name.to_owned(),
        format!("{}/postgres{}", &url[..path], &url[end..]),
    ))
}

/// libpq waits forever for a host that drops packets; give up after 10 s instead.
fn with_connect_timeout(url: &str) -> String {
    if url.contains("connect_timeout=") {
        url.to_owned()
    } else if url.contains('?') {
        format!("{url}&connect_timeout=10")
    } else {
        format!("{url}?connect_timeout=10")
    }
}
