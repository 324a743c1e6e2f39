//! What the relay sends for an event, measured at record time: the payload as PostgreSQL
//! renders it from `jsonb`, and the NATS headers. NATS's `max_payload` counts both.

use std::io::{self, Write};

use serde::Serialize;
use serde_json::ser::Formatter;

use crate::EventHeaders;

/// Serialises `value` to JSON the way PostgreSQL renders it from a `jsonb` column: `", "`
/// between elements, `": "` after keys, and numbers in plain decimal (`1e21` is written out in
/// its 22 digits, as `numeric` prints it). Stored in `jsonb`, the text comes back with the same
/// length (keys may come back in another order); the relay publishes that rendering, so this
/// is the payload whose size counts.
///
/// ```
/// let text = outbox_diesel::jsonb_text(&serde_json::json!({"a": [1, 2.5, 1e21]}))?;
/// assert_eq!(text, r#"{"a": [1, 2.5, 1000000000000000000000]}"#);
/// # Ok::<(), serde_json::Error>(())
/// ```
pub fn jsonb_text<T: Serialize + ?Sized>(value: &T) -> serde_json::Result<String> {
    let mut out = Vec::with_capacity(128);
    let mut ser = serde_json::Serializer::with_formatter(&mut out, JsonbFormatter);
    value.serialize(&mut ser)?;
    // serde_json writes valid UTF-8
    String::from_utf8(out).map_err(|e| serde_json::Error::io(io::Error::other(e)))
}

/// The NATS headers the relay adds to every event (see the README's publishing contract).
const FIXED_HEADERS: [&str; 6] = [
    "Nats-Msg-Id",
    "Outbox-Aggregate-Type",
    "Outbox-Aggregate-Id",
    "Outbox-Event-Type",
    "Outbox-Created-At",
    "Content-Type",
];

/// The bytes NATS counts against its `max_payload` for the message the relay makes of an
/// event: `payload_len` (the payload as [`jsonb_text`] renders it) plus the header block
/// (`NATS/1.0` and each `Name: value` line with their line ends): `Nats-Msg-Id` (a UUID),
/// `Outbox-Aggregate-Type`, `Outbox-Aggregate-Id`, `Outbox-Event-Type`, `Outbox-Created-At`
/// (27 bytes of RFC 3339), `Content-Type: application/json`, and the event's own `headers`.
/// [`Outbox::max_payload`](crate::Outbox::max_payload) limits this figure.
///
/// ```
/// use outbox_diesel::{EventHeaders, message_size};
/// let bare = message_size(10, "order", "42", "order.placed", &EventHeaders::new());
/// let traced = message_size(10, "order", "42", "order.placed", &EventHeaders::traceparent("00-x"));
/// assert_eq!(traced - bare, "traceparent: 00-x\r\n".len());
/// ```
pub fn message_size(
    payload_len: usize,
    aggregate_type: &str,
    aggregate_id: &str,
    event_type: &str,
    headers: &EventHeaders,
) -> usize {
    let line = |name: &str, value_len: usize| name.len() + ": ".len() + value_len + "\r\n".len();
    let framing = "NATS/1.0\r\n".len() + "\r\n".len();
    let fixed = line(FIXED_HEADERS[0], 36)
        + line(FIXED_HEADERS[1], aggregate_type.len())
        + line(FIXED_HEADERS[2], aggregate_id.len())
        + line(FIXED_HEADERS[3], event_type.len())
        + line(FIXED_HEADERS[4], "2026-01-01T00:00:00.000000Z".len())
        + line(FIXED_HEADERS[5], "application/json".len());
    // the relay's own headers replace an event header of the same name
    let own: usize = headers
        .iter()
        .filter(|(name, _)| !FIXED_HEADERS.contains(name))
        .map(|(name, value)| line(name, value.len()))
        .sum();
    payload_len + framing + fixed + own
}

/// serde_json's compact output with `jsonb`'s separators and plain-decimal numbers.
struct JsonbFormatter;

impl Formatter for JsonbFormatter {
    fn begin_array_value<W: ?Sized + Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(b": ")
    }

    fn write_f64<W: ?Sized + Write>(&mut self, writer: &mut W, value: f64) -> io::Result<()> {
        // Rust prints floats in plain decimal with the shortest digits that round-trip; an
        // integral value below 1e16 keeps serde_json's `.0`
        let text = value.to_string();
        writer.write_all(text.as_bytes())?;
        if !text.contains('.') && value.abs() < 1e16 {
            writer.write_all(b".0")?;
        }
        Ok(())
    }

    fn write_f32<W: ?Sized + Write>(&mut self, writer: &mut W, value: f32) -> io::Result<()> {
        let text = value.to_string();
        writer.write_all(text.as_bytes())?;
        if !text.contains('.') && value.abs() < 1e16 {
            writer.write_all(b".0")?;
        }
        Ok(())
    }

    fn write_number_str<W: ?Sized + Write>(
        &mut self,
        writer: &mut W,
        value: &str,
    ) -> io::Result<()> {
        writer.write_all(plain_decimal(value).as_bytes())
    }
}

/// A JSON number in plain decimal, as PostgreSQL's `numeric` prints it: `1.5e3` → `1500`,
/// `1.5e-7` → `0.00000015`.
fn plain_decimal(number: &str) -> std::borrow::Cow<'_, str> {
    let Some((mantissa, exp)) = number.split_once(['e', 'E']) else {
        return number.into();
    };
    let Ok(exp) = exp.parse::<i64>() else {
        return number.into();
    };
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{int}{frac}");
    let point = int.len() as i64 + exp;
    let body = if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}", "0".repeat(point as usize - digits.len()))
    } else {
        let (i, f) = digits.split_at(point as usize);
        format!("{i}.{f}")
    };
    let trimmed = body.trim_start_matches('0');
    let body = if trimmed.is_empty() || trimmed.starts_with('.') {
        format!("0{trimmed}")
    } else {
        trimmed.to_owned()
    };
    format!("{sign}{body}").into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_as_numeric_prints_them() {
        assert_eq!(plain_decimal("1.5e3"), "1500");
        assert_eq!(plain_decimal("1.25e1"), "12.5");
        assert_eq!(plain_decimal("1.5e-7"), "0.00000015");
        assert_eq!(plain_decimal("-2E2"), "-200");
        assert_eq!(plain_decimal("42"), "42");
        let text = jsonb_text(&serde_json::json!([1.0, 0.1, 1e16, 1.5e-7, -3, {"k": null}]))
            .expect("render");
        assert_eq!(
            text,
            r#"[1.0, 0.1, 10000000000000000, 0.00000015, -3, {"k": null}]"#
        );
    }
}
