//! [`RawJson`]: a `jsonb` value as PostgreSQL renders it, kept as text.

use std::fmt;
use std::io::Write;

use diesel::deserialize::{self, FromSql, FromSqlRow};
use diesel::expression::AsExpression;
use diesel::pg::{Pg, PgValue};
use diesel::serialize::{self, IsNull, Output, ToSql};
use diesel::sql_types::Jsonb;
use serde::de::DeserializeOwned;

/// A JSON document kept as its text: the relay reads an event's payload from the `jsonb`
/// column and publishes those bytes as they are, without parsing them into a
/// [`serde_json::Value`] and writing them out again.
///
/// The text is PostgreSQL's rendering of the `jsonb` value (keys sorted by length then
/// bytes, `": "` and `", "` as separators), so the same stored value always gives the same
/// bytes. [`parse`](RawJson::parse) reads it into any type; [`RawJson::new`] checks a
/// string; a [`serde_json::Value`] converts with `From`.
///
/// ```
/// use outbox_diesel::RawJson;
///
/// let raw = RawJson::new(r#"{"total": 5}"#)?;
/// assert_eq!(raw.as_str(), r#"{"total": 5}"#);
/// assert_eq!(raw.parse::<serde_json::Value>()?, serde_json::json!({"total": 5}));
/// assert_eq!(raw, serde_json::json!({"total": 5}));
/// assert!(RawJson::new("{not json").is_err());
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, AsExpression, FromSqlRow)]
#[diesel(sql_type = Jsonb)]
pub struct RawJson(String);

impl RawJson {
    /// The JSON text `json`, once checked to be one well-formed JSON value.
    pub fn new(json: impl Into<String>) -> Result<RawJson, serde_json::Error> {
        let json = json.into();
        serde_json::from_str::<serde::de::IgnoredAny>(&json)?;
        Ok(RawJson(json))
    }

    /// Text PostgreSQL rendered from a `jsonb` value, which is JSON.
    #[cfg(feature = "relay")]
    pub(crate) fn from_postgres(json: String) -> RawJson {
        RawJson(json)
    }

    /// The JSON text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The JSON text's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// The JSON text, owned.
    pub fn into_string(self) -> String {
        self.0
    }

    /// Reads the document into `T`.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(&self.0)
    }

    /// The document as a [`serde_json::Value`] (`Null` if it is not JSON, which a value read
    /// from a `jsonb` column always is).
    pub fn to_value(&self) -> serde_json::Value {
        self.parse().unwrap_or(serde_json::Value::Null)
    }
}

impl From<serde_json::Value> for RawJson {
    fn from(value: serde_json::Value) -> RawJson {
        RawJson(value.to_string())
    }
}

impl From<&serde_json::Value> for RawJson {
    fn from(value: &serde_json::Value) -> RawJson {
        RawJson(value.to_string())
    }
}

impl From<RawJson> for String {
    fn from(raw: RawJson) -> String {
        raw.0
    }
}

/// Compares the documents, not the texts: `{"a":1}` equals `json!({"a": 1})`.
impl PartialEq<serde_json::Value> for RawJson {
    fn eq(&self, other: &serde_json::Value) -> bool {
        self.parse::<serde_json::Value>()
            .is_ok_and(|value| &value == other)
    }
}

impl fmt::Display for RawJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RawJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// `jsonb`'s binary form is a version byte, 1, then the text.
impl FromSql<Jsonb, Pg> for RawJson {
    fn from_sql(value: PgValue<'_>) -> deserialize::Result<RawJson> {
        match value.as_bytes().split_first() {
            Some((1, text)) => Ok(RawJson(String::from_utf8(text.to_vec())?)),
            Some((version, _)) => Err(format!("unsupported jsonb version {version}").into()),
            None => Err("an empty jsonb value".into()),
        }
    }
}

impl ToSql<Jsonb, Pg> for RawJson {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Pg>) -> serialize::Result {
        out.write_all(&[1])?;
        out.write_all(self.0.as_bytes())?;
        Ok(IsNull::No)
    }
}
