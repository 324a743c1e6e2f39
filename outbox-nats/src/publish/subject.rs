//! Subjects: the template `{prefix}.{aggregate_type}.{aggregate_id}` and the encoding of each
//! token.
//!
//! # The encoding
//!
//! Every value put into a subject is one token (or, for `{event_type}`, `.`-separated tokens),
//! percent-encoded over its UTF-8 bytes: ASCII letters, digits, `-`, `_` and `~` stay as they
//! are; every other byte, `.`, `*`, `>`, `%`, white space, control characters and all non-ASCII
//! bytes included, becomes `%XX` (upper-case hex). An aggregate id therefore can never add a
//! level to the subject or turn into a wildcard, and [`decode_token`] gives back the original:
//!
//! | aggregate id | token |
//! |---|---|
//! | `42` | `42` |
//! | `a.b` | `a%2Eb` |
//! | `*` / `>` | `%2A` / `%3E` |
//! | `two words` | `two%20words` |
//! | `Zürich` | `Z%C3%BCrich` |
//!
//! The raw id travels unencoded in the `Outbox-Aggregate-Id` header.
//!
//! # The length bound
//!
//! A NATS server closes the connection of a client whose protocol line is longer than its
//! `max_control_line` (4 KiB by default), and a publish's line holds the subject. So a subject
//! is at most [`MAX_SUBJECT_LEN`] (3,072) bytes: the recording side refuses an event whose
//! aggregate type, aggregate id and event type take more than
//! [`outbox_diesel::MAX_SUBJECT_NAMES_LEN`] (2,048) bytes encoded, the relay refuses a prefix
//! and template literals of more than 1,024, and a row written around the library with a
//! longer subject is parked (with the error in `last_error`) instead of being retried.

use std::fmt;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};

const TOKEN: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'~');

/// The longest subject the relay publishes, in bytes (see [the length bound](self#the-length-bound)).
pub const MAX_SUBJECT_LEN: usize = 3072;

/// The most bytes the prefix, the template's literal tokens and the dots between tokens may
/// take: what [`MAX_SUBJECT_LEN`] leaves beside the event's names.
pub const MAX_SUBJECT_FIXED_LEN: usize = MAX_SUBJECT_LEN - outbox_diesel::MAX_SUBJECT_NAMES_LEN;

/// Encodes `value` as one subject token (see the [module documentation](self)).
///
/// ```
/// use outbox_nats::subject::{decode_token, encode_token};
/// assert_eq!(encode_token("order.42 *>"), "order%2E42%20%2A%3E");
/// assert_eq!(decode_token("order%2E42%20%2A%3E").as_deref(), Some("order.42 *>"));
/// ```
pub fn encode_token(value: &str) -> String {
    utf8_percent_encode(value, TOKEN).to_string()
}

/// Decodes a token made by [`encode_token`]; `None` when it is not valid UTF-8 once decoded.
pub fn decode_token(token: &str) -> Option<String> {
    percent_decode_str(token)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

/// One piece of a [`SubjectTemplate`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Prefix,
    AggregateType,
    AggregateId,
    EventType,
}

/// Where an event is published: a `.`-separated template whose tokens are literals or the
/// placeholders `{prefix}`, `{aggregate_type}`, `{aggregate_id}` and `{event_type}`.
///
/// The default is `{prefix}.{aggregate_type}.{aggregate_id}`. It must start with `{prefix}`
/// (the stream captures `{prefix}.>`) and contain `{aggregate_id}`, so that each aggregate has
/// subjects of its own. `{event_type}` expands to the event type's own `.`-separated tokens.
///
/// ```
/// use outbox_nats::subject::SubjectTemplate;
///
/// let t = SubjectTemplate::default();
/// assert_eq!(t.render("outbox", "order", "a.b", "order.placed"), "outbox.order.a%2Eb");
/// let t: SubjectTemplate = "{prefix}.{event_type}.{aggregate_id}".parse()?;
/// assert_eq!(t.render("shop", "order", "7", "order.placed"), "shop.order.placed.7");
/// # Ok::<(), outbox_nats::subject::InvalidTemplate>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubjectTemplate {
    parts: Vec<Part>,
    source: String,
}

/// A subject template that cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "invalid subject template {template:?}: {reason}; the default is `{{prefix}}.{{aggregate_type}}.{{aggregate_id}}`"
)]
pub struct InvalidTemplate {
    template: String,
    reason: String,
}

impl Default for SubjectTemplate {
    fn default() -> Self {
        SubjectTemplate {
            parts: vec![Part::Prefix, Part::AggregateType, Part::AggregateId],
            source: "{prefix}.{aggregate_type}.{aggregate_id}".into(),
        }
    }
}

impl std::str::FromStr for SubjectTemplate {
    type Err = InvalidTemplate;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason: String| InvalidTemplate {
            template: s.to_owned(),
            reason,
        };
        let mut parts = Vec::new();
        for token in s.split('.') {
            let part = match token {
                "{prefix}" => Part::Prefix,
                "{aggregate_type}" => Part::AggregateType,
                "{aggregate_id}" => Part::AggregateId,
                "{event_type}" => Part::EventType,
                t if t.contains(['{', '}']) => {
                    return Err(err(format!(
                        "unknown placeholder `{t}`; expected {{prefix}}, {{aggregate_type}}, {{aggregate_id}} or {{event_type}}, each a whole token"
                    )));
                }
                t => {
                    if let Err(e) = outbox_diesel::check_subject_token(t) {
                        return Err(err(format!("the literal token {t:?} {e}")));
                    }
                    Part::Literal(t.to_owned())
                }
            };
            parts.push(part);
        }
        if parts.first() != Some(&Part::Prefix) {
            return Err(err("it must start with `{prefix}`".into()));
        }
        if !parts.contains(&Part::AggregateId) {
            return Err(err("it must contain `{aggregate_id}`".into()));
        }
        Ok(SubjectTemplate {
            parts,
            source: s.to_owned(),
        })
    }
}

impl fmt::Display for SubjectTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

impl SubjectTemplate {
    /// The subject of one event.
    pub fn render(
        &self,
        prefix: &str,
        aggregate_type: &str,
        aggregate_id: &str,
        event_type: &str,
    ) -> String {
        let mut out = String::with_capacity(prefix.len() + aggregate_id.len() + 32);
        for (i, part) in self.parts.iter().enumerate() {
            if i > 0 {
                out.push('.');
            }
            match part {
                Part::Literal(l) => out.push_str(l),
                Part::Prefix => out.push_str(prefix),
                Part::AggregateType => out.extend(utf8_percent_encode(aggregate_type, TOKEN)),
                Part::AggregateId => out.extend(utf8_percent_encode(aggregate_id, TOKEN)),
                Part::EventType => {
                    for (j, t) in event_type.split('.').enumerate() {
                        if j > 0 {
                            out.push('.');
                        }
                        out.extend(utf8_percent_encode(t, TOKEN));
                    }
                }
            }
        }
        out
    }

    /// The bytes a subject takes besides the event's names: `prefix`, the literal tokens and
    /// the dots between tokens (at most [`MAX_SUBJECT_FIXED_LEN`] for a valid configuration).
    ///
    /// ```
    /// use outbox_nats::subject::SubjectTemplate;
    /// assert_eq!(SubjectTemplate::default().fixed_len("outbox"), "outbox..".len());
    /// ```
    pub fn fixed_len(&self, prefix: &str) -> usize {
        let tokens: usize = self
            .parts
            .iter()
            .map(|p| match p {
                Part::Literal(l) => l.len(),
                Part::Prefix => prefix.len(),
                Part::AggregateType | Part::AggregateId | Part::EventType => 0,
            })
            .sum();
        tokens + self.parts.len() - 1
    }

    /// The aggregate id of a subject this template made, when it has that shape.
    ///
    /// ```
    /// use outbox_nats::subject::SubjectTemplate;
    /// let t = SubjectTemplate::default();
    /// let s = t.render("outbox", "order", "Zürich 1.2", "order.placed");
    /// assert_eq!(t.aggregate_id_of(&s).as_deref(), Some("Zürich 1.2"));
    /// ```
    pub fn aggregate_id_of(&self, subject: &str) -> Option<String> {
        if self.parts.contains(&Part::EventType) {
            // the event type's width is unknown: count from both ends
            let tokens: Vec<&str> = subject.split('.').collect();
            let idx = self.parts.iter().position(|p| *p == Part::AggregateId)?;
            let ev = self.parts.iter().position(|p| *p == Part::EventType)?;
            let from_end = self.parts.len() - idx;
            let token = if idx > ev {
                tokens.get(tokens.len().checked_sub(from_end)?)?
            } else {
                tokens.get(idx)?
            };
            return decode_token(token);
        }
        let tokens: Vec<&str> = subject.split('.').collect();
        if tokens.len() != self.parts.len() {
            return None;
        }
        let idx = self.parts.iter().position(|p| *p == Part::AggregateId)?;
        decode_token(tokens[idx])
    }
}

/// Whether NATS subject filter `filter` (with `*` and `>` wildcards) matches `subject`.
///
/// ```
/// use outbox_nats::subject::filter_matches;
/// assert!(filter_matches("outbox.>", "outbox.order.1"));
/// assert!(filter_matches("outbox.*.*", "outbox.order.1"));
/// assert!(!filter_matches("orders.>", "outbox.order.1"));
/// ```
pub fn filter_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_aggregate_ids_keep_the_subject_shape_and_round_trip() {
        let t = SubjectTemplate::default();
        for id in [
            "a.b", "*", ">", "a b\tc", "Zürich", "日本", "%41", "x\u{7}y", "-_~", "a..b.",
        ] {
            let s = t.render("outbox", "order", id, "order.placed");
            assert_eq!(s.split('.').count(), 3, "{s}");
            assert!(s.chars().all(|c| c.is_ascii_graphic()), "{s}");
            assert!(
                !s.split('.')
                    .any(|tok| tok == "*" || tok == ">" || tok.is_empty()),
                "{s}"
            );
            assert_eq!(t.aggregate_id_of(&s).as_deref(), Some(id));
        }
    }

    #[test]
    fn the_recording_side_measures_names_as_they_are_encoded() {
        let t = SubjectTemplate::default();
        for (ty, id, ev) in [
            ("order", "42", "order.placed"),
            ("Bestellung", "Zürich 1.2 *>", "bestellung.aufgegeben"),
            ("order", &"é".repeat(1500), "order.placed"),
            ("o-_~", "%41\u{7}", "a.b.c"),
        ] {
            assert_eq!(outbox_diesel::encoded_token_len(id), encode_token(id).len());
            let subject = t.render("outbox", ty, id, ev);
            let names = outbox_diesel::subject_names_len(ty, id, ev);
            // the default template does not hold the event type
            let ev_len = outbox_diesel::subject_names_len("", "", ev);
            assert_eq!(subject.len(), t.fixed_len("outbox") + names - ev_len);
            let with_event: SubjectTemplate =
                "{prefix}.{aggregate_type}.{event_type}.{aggregate_id}"
                    .parse()
                    .expect("valid");
            let subject = with_event.render("outbox", ty, id, ev);
            assert_eq!(subject.len(), with_event.fixed_len("outbox") + names);
        }
    }

    #[test]
    fn templates_are_checked() {
        assert!("{prefix}.{aggregate_id}".parse::<SubjectTemplate>().is_ok());
        assert!(
            "{aggregate_type}.{aggregate_id}"
                .parse::<SubjectTemplate>()
                .is_err()
        );
        assert!(
            "{prefix}.{aggregate_type}"
                .parse::<SubjectTemplate>()
                .is_err()
        );
        assert!(
            "{prefix}.{nope}.{aggregate_id}"
                .parse::<SubjectTemplate>()
                .is_err()
        );
        assert!(
            "{prefix}.a b.{aggregate_id}"
                .parse::<SubjectTemplate>()
                .is_err()
        );
        let t: SubjectTemplate = "{prefix}.{event_type}.{aggregate_id}"
            .parse()
            .expect("valid");
        let s = t.render("p", "order", "x.y", "order.placed");
        assert_eq!(s, "p.order.placed.x%2Ey");
        assert_eq!(t.aggregate_id_of(&s).as_deref(), Some("x.y"));
    }
}
