//! A decoder of the `pgoutput` plugin's binary messages, protocol version 1: the messages
//! that `pg_logical_slot_peek_binary_changes(slot, .., 'proto_version', '1',
//! 'publication_names', ..)` returns, one per row.
//!
//! Only what log tailing needs is decoded in full: `Begin`, `Commit`, `Relation`, `Insert`
//! and the new tuple of `Update`. `Delete`, `Truncate`, `Origin`, `Type` and logical
//! `Message`s are recognised and passed over. The format is PostgreSQL's "Logical Streaming
//! Replication Protocol" message formats: big-endian integers, NUL-terminated strings, and
//! tuples whose columns are `n` (null), `u` (an unchanged TOASTed value, updates only) or
//! `t` (text, length-prefixed).

use std::fmt;

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01 00:00:00 UTC).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// One `pgoutput` message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Message {
    /// A transaction starts.
    Begin {
        /// The LSN of its commit record.
        final_lsn: u64,
        /// Its commit time, microseconds since the Unix epoch.
        commit_time_micros: i64,
        /// Its transaction id.
        xid: u32,
    },
    /// A transaction ends.
    Commit {
        /// The LSN of its commit record.
        commit_lsn: u64,
        /// The end of its commit record: the position a reader confirms after it.
        end_lsn: u64,
        /// Its commit time, microseconds since the Unix epoch.
        commit_time_micros: i64,
    },
    /// Describes a table before its first change in a decoding session.
    Relation(Relation),
    /// A row was inserted.
    Insert {
        /// The table's OID.
        relation: u32,
        /// The new row.
        tuple: Tuple,
    },
    /// A row was updated.
    Update {
        /// The table's OID.
        relation: u32,
        /// The new row; TOASTed columns it did not change are [`Value::UnchangedToast`].
        tuple: Tuple,
    },
    /// A row was deleted (log tailing ignores it).
    Delete {
        /// The table's OID.
        relation: u32,
    },
    /// Any other message (`Origin`, `Type`, `Truncate`, `Message`), by its tag byte.
    Other(u8),
}

/// A table as a `Relation` message describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// Its OID.
    pub oid: u32,
    /// Its schema (`public`).
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its columns' names, in the order tuples carry them.
    pub columns: Vec<String>,
}

/// The columns of one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tuple(pub Vec<Value>);

/// One column of a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// SQL `NULL`.
    Null,
    /// A TOASTed value the update did not change (not sent).
    UnchangedToast,
    /// The value in PostgreSQL's text output format.
    Text(String),
}

impl Tuple {
    /// The column of `relation` named `name`.
    pub fn get<'a>(&'a self, relation: &Relation, name: &str) -> Option<&'a Value> {
        let i = relation.columns.iter().position(|c| c == name)?;
        self.0.get(i)
    }
}

/// A message that is not valid `pgoutput` version 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    tag: u8,
    what: &'static str,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid pgoutput message {:?}: {}",
            char::from(self.tag),
            self.what
        )
    }
}

impl std::error::Error for DecodeError {}

/// Converts a commit time in microseconds since the Unix epoch to a timestamp.
pub fn commit_time(micros: i64) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp_micros(micros).unwrap_or_default()
}

/// Converts a time in microseconds since PostgreSQL's epoch (2000-01-01 00:00:00 UTC), as the
/// replication protocol sends them outside the pgoutput messages (the commit time of a
/// streamed `Begin`), to a timestamp.
///
/// ```
/// use outbox_diesel::wal::pgoutput::pg_time;
/// assert_eq!(pg_time(1_000_000).to_rfc3339(), "2000-01-01T00:00:01+00:00");
/// ```
pub fn pg_time(micros: i64) -> chrono::DateTime<chrono::Utc> {
    commit_time(micros.saturating_add(PG_EPOCH_OFFSET_MICROS))
}

struct Cursor<'a> {
    tag: u8,
    bytes: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn err(&self, what: &'static str) -> DecodeError {
        DecodeError {
            tag: self.tag,
            what,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.bytes.len() < n {
            return Err(self.err("truncated"));
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        let end = self
            .bytes
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| self.err("unterminated string"))?;
        let s = std::str::from_utf8(&self.bytes[..end])
            .map_err(|_| self.err("string is not UTF-8"))?
            .to_owned();
        self.bytes = &self.bytes[end + 1..];
        Ok(s)
    }

    fn tuple(&mut self) -> Result<Tuple, DecodeError> {
        let n = self.u16()?;
        let mut values = Vec::with_capacity(n as usize);
        for _ in 0..n {
            values.push(match self.u8()? {
                b'n' => Value::Null,
                b'u' => Value::UnchangedToast,
                b't' => {
                    let len = self.u32()? as usize;
                    let raw = self.take(len)?;
                    let s = std::str::from_utf8(raw)
                        .map_err(|_| self.err("text value is not UTF-8"))?;
                    Value::Text(s.to_owned())
                }
                b'b' => return Err(self.err("binary tuple values are not requested")),
                _ => return Err(self.err("unknown tuple value kind")),
            });
        }
        Ok(Tuple(values))
    }
}

/// Decodes one message.
///
/// ```
/// use outbox_diesel::wal::pgoutput::{Message, decode};
/// // Commit: flags 0, commit LSN 0/10, end LSN 0/20, time 0 (2000-01-01)
/// let mut m = vec![b'C', 0];
/// m.extend(16u64.to_be_bytes());
/// m.extend(32u64.to_be_bytes());
/// m.extend(0i64.to_be_bytes());
/// assert!(matches!(decode(&m)?, Message::Commit { end_lsn: 32, .. }));
/// # Ok::<(), outbox_diesel::wal::pgoutput::DecodeError>(())
/// ```
pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
    let Some((&tag, rest)) = bytes.split_first() else {
        return Err(DecodeError {
            tag: b'?',
            what: "empty message",
        });
    };
    let mut c = Cursor { tag, bytes: rest };
    Ok(match tag {
        b'B' => Message::Begin {
            final_lsn: c.u64()?,
            commit_time_micros: (c.u64()? as i64).saturating_add(PG_EPOCH_OFFSET_MICROS),
            xid: c.u32()?,
        },
        b'C' => {
            let _flags = c.u8()?;
            Message::Commit {
                commit_lsn: c.u64()?,
                end_lsn: c.u64()?,
                commit_time_micros: (c.u64()? as i64).saturating_add(PG_EPOCH_OFFSET_MICROS),
            }
        }
        b'R' => {
            let oid = c.u32()?;
            let namespace = c.string()?;
            let name = c.string()?;
            let _replica_identity = c.u8()?;
            let n = c.u16()?;
            let mut columns = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let _flags = c.u8()?;
                columns.push(c.string()?);
                let _type_oid = c.u32()?;
                let _type_modifier = c.u32()?;
            }
            Message::Relation(Relation {
                oid,
                namespace,
                name,
                columns,
            })
        }
        b'I' => {
            let relation = c.u32()?;
            if c.u8()? != b'N' {
                return Err(c.err("insert without a new tuple"));
            }
            Message::Insert {
                relation,
                tuple: c.tuple()?,
            }
        }
        b'U' => {
            let relation = c.u32()?;
            let mut kind = c.u8()?;
            if kind == b'K' || kind == b'O' {
                c.tuple()?;
                kind = c.u8()?;
            }
            if kind != b'N' {
                return Err(c.err("update without a new tuple"));
            }
            Message::Update {
                relation,
                tuple: c.tuple()?,
            }
        }
        b'D' => Message::Delete { relation: c.u32()? },
        b'O' | b'Y' | b'T' | b'M' => Message::Other(tag),
        _ => return Err(c.err("unknown message type")),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn streamed_times_count_from_postgres_epoch() {
        assert_eq!(pg_time(0).to_rfc3339(), "2000-01-01T00:00:00+00:00");
        assert_eq!(
            pg_time(1_000_000).to_rfc3339(),
            commit_time(PG_EPOCH_OFFSET_MICROS + 1_000_000).to_rfc3339()
        );
    }

    use super::*;

    fn tuple(values: &[Option<&str>]) -> Vec<u8> {
        let mut out = (values.len() as u16).to_be_bytes().to_vec();
        for v in values {
            match v {
                None => out.push(b'n'),
                Some(s) => {
                    out.push(b't');
                    out.extend((s.len() as u32).to_be_bytes());
                    out.extend(s.as_bytes());
                }
            }
        }
        out
    }

    #[test]
    fn decodes_begin_relation_insert_update_commit() {
        let mut b = vec![b'B'];
        b.extend(0x10u64.to_be_bytes());
        b.extend(1_000_000u64.to_be_bytes());
        b.extend(7u32.to_be_bytes());
        assert_eq!(
            decode(&b),
            Ok(Message::Begin {
                final_lsn: 0x10,
                commit_time_micros: PG_EPOCH_OFFSET_MICROS + 1_000_000,
                xid: 7
            })
        );
        assert_eq!(
            commit_time(PG_EPOCH_OFFSET_MICROS).to_rfc3339(),
            "2000-01-01T00:00:00+00:00"
        );

        let mut r = vec![b'R'];
        r.extend(16384u32.to_be_bytes());
        r.extend(b"public\0outbox\0d");
        r.extend(2u16.to_be_bytes());
        for name in ["seq", "payload"] {
            r.push(1);
            r.extend(name.as_bytes());
            r.push(0);
            r.extend(20u32.to_be_bytes());
            r.extend(u32::MAX.to_be_bytes());
        }
        let Ok(Message::Relation(rel)) = decode(&r) else {
            panic!("relation")
        };
        assert_eq!(rel.columns, ["seq", "payload"]);
        assert_eq!(
            (rel.namespace.as_str(), rel.name.as_str()),
            ("public", "outbox")
        );

        let mut i = vec![b'I'];
        i.extend(16384u32.to_be_bytes());
        i.push(b'N');
        i.extend(tuple(&[Some("5"), Some("{\"a\": 1}")]));
        let Ok(Message::Insert { relation, tuple: t }) = decode(&i) else {
            panic!("insert")
        };
        assert_eq!(relation, 16384);
        assert_eq!(
            t.get(&rel, "payload"),
            Some(&Value::Text("{\"a\": 1}".into()))
        );

        let mut u = vec![b'U'];
        u.extend(16384u32.to_be_bytes());
        u.push(b'K');
        u.extend(tuple(&[Some("5"), None]));
        u.push(b'N');
        u.extend(tuple(&[Some("5"), None]));
        assert!(matches!(
            decode(&u),
            Ok(Message::Update {
                relation: 16384,
                ..
            })
        ));

        assert!(
            decode(&i[..i.len() - 1]).is_err(),
            "a truncated message is an error"
        );
        assert!(decode(&[]).is_err());
        assert!(decode(b"Z").is_err());
        assert_eq!(decode(b"M\x01\x02"), Ok(Message::Other(b'M')));
    }
}
