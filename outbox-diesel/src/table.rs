//! [`OutboxTable`]: which table (and schema) an outbox lives in.

use std::borrow::Cow;
use std::fmt;

use diesel::QueryResult;
use diesel::pg::Pg;
use diesel::query_builder::AstPass;

/// The name of an outbox table, optionally schema-qualified.
///
/// The default is `outbox`, found through the connection's `search_path`. Every part of the
/// library that touches the table (recording, the relay, `status`, cleanup) takes one, so a
/// service can keep several outboxes or put one in its own schema.
///
/// ```
/// use outbox_diesel::OutboxTable;
///
/// let t: OutboxTable = "billing.outbox".parse()?;
/// assert_eq!(t.schema(), Some("billing"));
/// assert_eq!(t.name(), "outbox");
/// assert_eq!(t.to_string(), "billing.outbox");
/// assert_eq!(t.quoted(), r#""billing"."outbox""#);
/// assert_eq!(OutboxTable::default().name(), "outbox");
/// # Ok::<(), outbox_diesel::InvalidTableName>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OutboxTable {
    schema: Option<Cow<'static, str>>,
    name: Cow<'static, str>,
}

/// A table name that [`OutboxTable`] cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid outbox table name {input:?}: {reason}; write `table` or `schema.table`")]
pub struct InvalidTableName {
    input: String,
    reason: &'static str,
}

impl OutboxTable {
    /// The table `outbox` on the connection's `search_path`.
    pub const DEFAULT: OutboxTable = OutboxTable {
        schema: None,
        name: Cow::Borrowed("outbox"),
    };

    /// A table named `name` on the connection's `search_path`.
    ///
    /// The name is taken as it is (no case folding, no quoting rules): `OutboxTable::new("Events")`
    /// is the table `"Events"`.
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidTableName> {
        let name = name.into();
        check_identifier(&name, &name)?;
        Ok(OutboxTable {
            schema: None,
            name: Cow::Owned(name),
        })
    }

    /// The table `name` in `schema`.
    pub fn with_schema(
        schema: impl Into<String>,
        name: impl Into<String>,
    ) -> Result<Self, InvalidTableName> {
        let (schema, name) = (schema.into(), name.into());
        check_identifier(&schema, &schema)?;
        check_identifier(&name, &name)?;
        Ok(OutboxTable {
            schema: Some(Cow::Owned(schema)),
            name: Cow::Owned(name),
        })
    }

    /// The schema, when the name is qualified.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The table's own name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the ordered relay records its progress: `<name>_progress` in the same schema,
    /// quoted (`"outbox_progress"`).
    ///
    /// ```
    /// let t: outbox_diesel::OutboxTable = "billing.events".parse()?;
    /// assert_eq!(t.progress_table(), r#""billing"."events_progress""#);
    /// # Ok::<(), outbox_diesel::InvalidTableName>(())
    /// ```
    pub fn progress_table(&self) -> String {
        self.sibling("progress")
    }

    /// The view of every row with when it was published, the rows the ordered relay published
    /// included: `<name>_audit` in the same schema, quoted (`"outbox_audit"`).
    pub fn audit_view(&self) -> String {
        self.sibling("audit")
    }

    pub(crate) fn sibling(&self, suffix: &str) -> String {
        let name = quote_ident(&format!("{}_{suffix}", self.name));
        match &self.schema {
            Some(s) => format!("{}.{name}", quote_ident(s)),
            None => name,
        }
    }

    /// The name quoted for SQL: `"outbox"` or `"billing"."outbox"`.
    pub fn quoted(&self) -> String {
        match &self.schema {
            Some(s) => format!("{}.{}", quote_ident(s), quote_ident(&self.name)),
            None => quote_ident(&self.name),
        }
    }

    /// The `LISTEN`/`NOTIFY` channel the recording side wakes the relay on: the table's name
    /// as written (`outbox`, `billing.outbox`) when it fits PostgreSQL's 63-byte channel
    /// names; a longer name is cut to 46 bytes and followed by `~` and 16 hex digits of its
    /// MD5, so that the channel always fits and two long names do not share one.
    ///
    /// ```
    /// use outbox_diesel::OutboxTable;
    ///
    /// assert_eq!(OutboxTable::DEFAULT.channel(), "outbox");
    /// let long = OutboxTable::with_schema("s".repeat(40), "t".repeat(30))?;
    /// assert_eq!(long.channel().len(), 63);
    /// assert!(long.channel().starts_with(&"s".repeat(40)));
    /// # Ok::<(), outbox_diesel::InvalidTableName>(())
    /// ```
    pub fn channel(&self) -> String {
        const MAX: usize = 63;
        let full = self.to_string();
        if full.len() <= MAX {
            return full;
        }
        use md5::Digest;
        let digest = md5::Md5::digest(full.as_bytes());
        let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        let mut cut = MAX - 1 - hash.len();
        while !full.is_char_boundary(cut) {
            cut -= 1;
        }
        format!("{}~{hash}", &full[..cut])
    }

    pub(crate) fn walk_ast(&self, out: &mut AstPass<'_, '_, Pg>) -> QueryResult<()> {
        if let Some(s) = &self.schema {
            out.push_identifier(s)?;
            out.push_sql(".");
        }
        out.push_identifier(&self.name)
    }
}

impl Default for OutboxTable {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl fmt::Display for OutboxTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(s) => write!(f, "{s}.{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

impl std::str::FromStr for OutboxTable {
    type Err = InvalidTableName;

    /// Parses `table` or `schema.table`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('.') {
            Some((schema, name)) => {
                if name.contains('.') {
                    return Err(InvalidTableName {
                        input: s.to_owned(),
                        reason: "more than one `.`",
                    });
                }
                check_identifier(s, schema)?;
                check_identifier(s, name)?;
                Ok(OutboxTable {
                    schema: Some(Cow::Owned(schema.to_owned())),
                    name: Cow::Owned(name.to_owned()),
                })
            }
            None => OutboxTable::new(s),
        }
    }
}

fn check_identifier(input: &str, part: &str) -> Result<(), InvalidTableName> {
    let reason = if part.is_empty() {
        "empty name"
    } else if part.len() > 63 {
        "longer than PostgreSQL's 63 bytes"
    } else if part.chars().any(|c| c.is_control() || c == '"') {
        "contains a control character or `\"`"
    } else {
        return Ok(());
    };
    Err(InvalidTableName {
        input: input.to_owned(),
        reason,
    })
}

pub(crate) fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Quotes `s` as an SQL string literal that means `s` whatever the session's
/// `standard_conforming_strings`: with a backslash in it, an escape string (`E'...'`, as
/// PostgreSQL's own `quote_literal` writes it), since a plain literal would read `\'` as an
/// escaped quote when that setting is off. Values go as bind parameters where a statement
/// takes them; this is for the few statements that cannot (DDL, replication commands).
pub(crate) fn quote_literal(s: &str) -> String {
    let doubled = s.replace('\'', "''");
    if s.contains('\\') {
        format!("E'{}'", doubled.replace('\\', "\\\\"))
    } else {
        format!("'{doubled}'")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_qualified_names() {
        let t: OutboxTable = "outbox".parse().expect("valid");
        assert_eq!(t, OutboxTable::DEFAULT);
        let t: OutboxTable = "app.events".parse().expect("valid");
        assert_eq!(t.quoted(), "\"app\".\"events\"");
        assert!("a.b.c".parse::<OutboxTable>().is_err());
        assert!("".parse::<OutboxTable>().is_err());
        assert!(".x".parse::<OutboxTable>().is_err());
        assert!("x\"y".parse::<OutboxTable>().is_err());
    }

    #[test]
    fn literals_escape_quotes_and_backslashes() {
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(quote_literal(r"we\'ird"), r"E'we\\''ird'");
    }

    #[test]
    fn long_channels_fit_and_differ() {
        let a = OutboxTable::with_schema("é".repeat(20), "a".repeat(30)).expect("valid");
        let b = OutboxTable::with_schema("é".repeat(20), "b".repeat(30)).expect("valid");
        assert!(a.channel().len() <= 63, "{}", a.channel());
        assert_ne!(a.channel(), b.channel());
        assert_eq!(a.channel(), a.clone().channel());
    }
}
