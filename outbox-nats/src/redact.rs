//! Hiding secrets in connection settings before they reach a log line, an error or `Debug`.

/// `url` with every secret in it replaced by `***`, for logs: the password of a URL's user
/// information (the user name stays, so an operator sees who connects), a NATS token given as
/// the user information (`nats://TOKEN@host`), secret query parameters (`?password=`,
/// `?sslpassword=`, `?token=`, ...), and the same keys in libpq's `key=value` form. A
/// comma-separated list of URLs is redacted URL by URL.
///
/// ```
/// use outbox_nats::redact_url;
///
/// assert_eq!(redact_url("postgres://app:s3cret@db/app"), "postgres://app:***@db/app");
/// assert_eq!(redact_url("postgres://app@db/app"), "postgres://app@db/app");
/// assert_eq!(redact_url("postgres://db/app?user=app&password=s3cret"), "postgres://db/app?user=app&password=***");
/// assert_eq!(redact_url("host=db user=app password='s3 cret' dbname=app"), "host=db user=app password=*** dbname=app");
/// assert_eq!(redact_url("nats://s3cret@n1:4222,nats://relay:s3cret@n2:4222"), "nats://***@n1:4222,nats://relay:***@n2:4222");
/// assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
/// ```
pub fn redact_url(url: &str) -> String {
    if url.contains("://") {
        redact_urls(url)
    } else if url.contains('=') {
        redact_key_values(url)
    } else {
        match url.rfind('@') {
            Some(at) => format!("{}{}", hide_userinfo(&url[..at], false), &url[at..]),
            None => url.to_owned(),
        }
    }
}

/// Whether a setting's key names a secret.
fn is_secret_key(key: &str) -> bool {
    let key = key.trim().to_ascii_lowercase();
    [
        "pass",
        "token",
        "secret",
        "nkey",
        "seed",
        "jwt",
        "credential",
    ]
    .iter()
    .any(|s| key.contains(s))
}

/// `user:***` for `user:password`; the user name alone stays when it is one (PostgreSQL),
/// and is hidden when it may be a token (NATS).
fn hide_userinfo(userinfo: &str, bare_user_is_a_name: bool) -> String {
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None if bare_user_is_a_name || userinfo.is_empty() => userinfo.to_owned(),
        None => "***".to_owned(),
    }
}

fn redact_urls(urls: &str) -> String {
    // where each URL's scheme starts: the letters before each `://`
    let mut starts = Vec::new();
    let mut from = 0;
    while let Some(i) = urls[from..].find("://").map(|i| from + i) {
        let scheme_len = urls[..i]
            .bytes()
            .rev()
            .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
            .count();
        starts.push(i - scheme_len);
        from = i + 3;
    }
    let mut out = urls[..starts[0]].to_owned();
    for (n, &start) in starts.iter().enumerate() {
        let end = starts.get(n + 1).copied().unwrap_or(urls.len());
        out.push_str(&redact_one_url(&urls[start..end]));
    }
    out
}

fn redact_one_url(url: &str) -> String {
    let Some(sep) = url.find("://") else {
        return url.to_owned();
    };
    let scheme = url[..sep].to_ascii_lowercase();
    let rest = &url[sep + 3..];
    let (userinfo, host_on) = match rest.rfind('@') {
        Some(at) => (
            hide_userinfo(&rest[..at], scheme.starts_with("postgres")),
            &rest[at..],
        ),
        None => (String::new(), rest),
    };
    let host_on = match host_on.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if is_secret_key(k) => format!("{k}=***"),
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => host_on.to_owned(),
    };
    format!("{}://{userinfo}{host_on}", &url[..sep])
}

/// libpq's `key = value` pairs, values quoted with `'` (and `\` escapes) or bare.
fn redact_key_values(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        // the key, and what follows it up to the value
        let key_start = i;
        while i < b.len() && b[i] != b'=' {
            i += 1;
        }
        if i == b.len() {
            out.push_str(&s[key_start..]);
            break;
        }
        let key = s[key_start..i].trim();
        i += 1;
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        out.push_str(&s[key_start..i]);
        // the value
        let value_start = i;
        if i < b.len() && b[i] == b'\'' {
            i += 1;
            while i < b.len() && b[i] != b'\'' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(b.len());
        } else {
            while i < b.len() && !b[i].is_ascii_whitespace() {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i = i.min(b.len());
        }
        if is_secret_key(key.rsplit(char::is_whitespace).next().unwrap_or(key)) {
            out.push_str("***");
        } else {
            out.push_str(&s[value_start..i]);
        }
        // the white space before the next key
        let space_start = i;
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        out.push_str(&s[space_start..i]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn a_password_is_hidden_in_every_form_and_the_user_name_stays() {
        let cases = [
            (
                "postgres://app:X@db:5432/app",
                "postgres://app:***@db:5432/app",
            ),
            ("postgresql://app:X@db/app", "postgresql://app:***@db/app"),
            ("postgres://app:X@Y@db/app", "postgres://app:***@db/app"),
            ("postgres://app@db/app", "postgres://app@db/app"),
            ("postgres://db/app", "postgres://db/app"),
            (
                "postgres://app@db/app?sslmode=require&password=X&application_name=a",
                "postgres://app@db/app?sslmode=require&password=***&application_name=a",
            ),
            (
                "postgres://app:X@h1:5432,h2:5432/app",
                "postgres://app:***@h1:5432,h2:5432/app",
            ),
            (
                "host=db port=5432 user=app password=X dbname=app",
                "host=db port=5432 user=app password=*** dbname=app",
            ),
            (
                "host=db password = 'X Y\\' Z' dbname=app",
                "host=db password = *** dbname=app",
            ),
            ("host=db sslpassword=X", "host=db sslpassword=***"),
            ("nats://X@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),
            ("tls://relay:X@n1:4222", "tls://relay:***@n1:4222"),
            (
                "nats://X@n1:4222, nats://relay:X@n2:4222,nats://n3:4222",
                "nats://***@n1:4222, nats://relay:***@n2:4222,nats://n3:4222",
            ),
            ("nats://n1:4222?token=X", "nats://n1:4222?token=***"),
            ("X@127.0.0.1:4222", "***@127.0.0.1:4222"),
            ("127.0.0.1:4222", "127.0.0.1:4222"),
        ];
        for (url, redacted) in cases {
            assert_eq!(redact_url(url), redacted, "{url}");
            assert!(!redact_url(url).contains('X'), "{url}");
        }
    }
}
