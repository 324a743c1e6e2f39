//! What the ordered relay has read and not yet recorded, per partition: the cursor it reads
//! from, the last one recorded, and the batches in between with their unacked rows. The
//! cursors a batch's acks allow are recorded once per step, those that moved only with the
//! walk once a second at most (see `outbox_diesel::relay::progress`).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use diesel_async::AsyncPgConnection;
use outbox_diesel::relay::{self as db, OutboxRow, Partition};

use crate::RelayConfig;

/// A batch read and not recorded yet.
#[derive(Debug)]
struct Pending {
    /// The cursor's `seq` before the batch.
    before: i64,
    /// The cursor once every row of the batch is acked.
    after: db::Cursor,
    /// The rows of the batch (read after the cursor, or late), in `seq` order.
    seqs: Vec<i64>,
    /// Those not acked yet.
    unacked: BTreeSet<i64>,
}

impl Pending {
    /// The cursor the acks so far allow: the whole batch's when all are acked; when the rows
    /// before the first unacked one include every late row (all at or below `before`), the
    /// snapshot of the batch with the highest `seq` acked; otherwise none.
    fn reached(&self) -> Option<db::Cursor> {
        let Some(&first_unacked) = self.unacked.first() else {
            return Some(self.after.clone());
        };
        if first_unacked <= self.before {
            return None;
        }
        let acked = self
            .seqs
            .iter()
            .copied()
            .take_while(|&s| s < first_unacked)
            .max()
            .unwrap_or(self.before)
            .max(self.before);
        Some(db::Cursor::at(acked, self.after.snap.clone()))
    }
}

/// How often a cursor that moved only with the walk (no row of its own partition read) is
/// recorded at most: every step moves every owned partition's cursor to the walk's end, and a
/// row per partition and step would grow the progress table with the partitions a relay owns.
/// Not recording such a move loses nothing: the partition has no row in between, and its next
/// owner walks past them again.
pub(super) const WALK_RECORD_INTERVAL: Duration = Duration::from_secs(1);

/// One owned partition's progress.
#[derive(Debug)]
struct PartitionProgress {
    /// Where the next fetch reads from.
    read: db::Cursor,
    /// The last cursor recorded in the progress table.
    recorded: db::Cursor,
    /// When it was recorded (or taken over).
    recorded_at: Instant,
    /// Whether rows of this partition were acked since the last record.
    own_rows: bool,
    /// A cursor the acks allow that moved only with the walk, not recorded yet.
    unrecorded: Option<db::Cursor>,
    /// Batches read and not recorded, oldest first.
    pending: std::collections::VecDeque<Pending>,
}

impl PartitionProgress {
    fn new(cursor: db::Cursor) -> Self {
        PartitionProgress {
            read: cursor.clone(),
            recorded: cursor,
            recorded_at: Instant::now(),
            own_rows: false,
            unrecorded: None,
            pending: Default::default(),
        }
    }
}

/// The progress of the partitions a relay owns: their cursors, the batches in flight, and the
/// released rows in flight (see `outbox_diesel::relay::progress`).
#[derive(Debug, Default)]
pub(super) struct Progress {
    parts: std::collections::BTreeMap<u32, PartitionProgress>,
    /// Rows in flight: `seq` → (partition, released)
    rows: std::collections::HashMap<i64, (u32, bool)>,
    /// Released rows acked, to mark
    released_acked: Vec<i64>,
    /// Rows acked, to delete (with `--delete-published`)
    acked_rows: Vec<i64>,
    count: u32,
}

impl Progress {
    /// Takes over `partition`: reads on from its recorded cursor.
    pub(super) async fn acquire(
        &mut self,
        conn: &mut AsyncPgConnection,
        cfg: &RelayConfig,
        partition: Partition,
    ) -> diesel::QueryResult<()> {
        let cursor = db::start_cursor(conn, &cfg.table, partition).await?;
        self.count = partition.count;
        self.parts
            .insert(partition.index, PartitionProgress::new(cursor));
        Ok(())
    }

    /// Forgets a released partition (after a flush: nothing of it is in flight).
    pub(super) fn forget(&mut self, index: u32) {
        self.parts.remove(&index);
    }

    pub(super) fn read_cursor(&self, partition: Partition) -> db::Cursor {
        self.parts
            .get(&partition.index)
            .map(|p| p.read.clone())
            .unwrap_or_else(db::Cursor::start)
    }

    /// The released rows in flight, which the next fetch must not return again.
    pub(super) fn released_in_flight(&self) -> Vec<i64> {
        self.rows
            .iter()
            .filter(|(_, (_, released))| *released)
            .map(|(&s, _)| s)
            .collect()
    }

    /// Takes a fetched batch of `partition`, read at `cursor`: returns its rows to send.
    pub(super) fn read(
        &mut self,
        partition: Partition,
        cursor: db::Cursor,
        batch: db::Batch,
    ) -> Vec<OutboxRow> {
        let Some(part) = self.parts.get_mut(&partition.index) else {
            return Vec::new();
        };
        let mut seqs = Vec::new();
        let mut rows = Vec::with_capacity(batch.rows.len());
        for (row, source) in batch.rows {
            let released = source == db::Source::Released;
            if !released {
                seqs.push(row.seq);
            }
            self.rows.insert(row.seq, (partition.index, released));
            rows.push(row);
        }
        if batch.next != cursor || !seqs.is_empty() {
            part.pending.push_back(Pending {
                before: cursor.upto_seq,
                after: batch.next.clone(),
                unacked: seqs.iter().copied().collect(),
                seqs,
            });
        }
        part.read = batch.next;
        rows
    }

    /// Takes the acks (by `seq`).
    pub(super) fn acked(&mut self, seqs: &[i64]) {
        for seq in seqs {
            let Some((index, released)) = self.rows.remove(seq) else {
                continue;
            };
            self.acked_rows.push(*seq);
            if released {
                self.released_acked.push(*seq);
                continue;
            }
            if let Some(part) = self.parts.get_mut(&index) {
                for pending in part.pending.iter_mut() {
                    if pending.unacked.remove(seq) {
                        break;
                    }
                }
            }
        }
    }

    /// Whether nothing read is waiting for acks or for its record.
    pub(super) fn is_settled(&self) -> bool {
        self.rows.is_empty() && self.parts.values().all(|p| p.pending.is_empty())
    }

    /// Records the cursors the acks allow (with `partial`, also within a batch), marks the
    /// released rows acked (and deletes the acked rows with `--delete-published`); returns
    /// how many partitions' cursors it recorded. A cursor that moved only with the walk is
    /// recorded once per [`WALK_RECORD_INTERVAL`] at most, unless `partial` (a flush, before
    /// the partitions may change hands).
    pub(super) async fn record(
        &mut self,
        conn: &mut AsyncPgConnection,
        cfg: &RelayConfig,
        partial: bool,
    ) -> diesel::QueryResult<usize> {
        let mut cursors = Vec::new();
        for (&index, part) in self.parts.iter_mut() {
            let mut reached = part.unrecorded.take();
            while let Some(front) = part.pending.front() {
                if front.unacked.is_empty() {
                    reached = Some(front.after.clone());
                    part.own_rows |= !front.seqs.is_empty();
                    part.pending.pop_front();
                } else {
                    if partial {
                        reached = front.reached().or(reached);
                        part.own_rows |= front.unacked.len() < front.seqs.len();
                    }
                    break;
                }
            }
            let due =
                partial || part.own_rows || part.recorded_at.elapsed() >= WALK_RECORD_INTERVAL;
            match reached.filter(|c| *c != part.recorded) {
                Some(c) if due => cursors.push((
                    Partition {
                        index,
                        count: self.count,
                    },
                    c,
                )),
                c => part.unrecorded = c,
            }
        }
        // the acked rows are deleted (or the released ones marked) before the cursor passes
        // them: a relay that dies in between publishes them again, never leaves them behind
        let released = std::mem::take(&mut self.released_acked);
        let acked = std::mem::take(&mut self.acked_rows);
        if cfg.mode.deletes_published() {
            db::delete_acked(conn, &cfg.table, &acked).await?;
        } else {
            db::mark_released(conn, &cfg.table, &released).await?;
        }
        db::record_progress(conn, &cfg.table, &cursors).await?;
        let now = Instant::now();
        for (p, c) in &cursors {
            if let Some(part) = self.parts.get_mut(&p.index) {
                part.recorded = c.clone();
                part.recorded_at = now;
                part.own_rows = false;
            }
        }
        Ok(cursors.len())
    }

    /// After a stop: what was read and not recorded is read again from the recorded cursors.
    pub(super) fn rewind(&mut self) {
        self.rows.clear();
        self.released_acked.clear();
        self.acked_rows.clear();
        for part in self.parts.values_mut() {
            part.pending.clear();
            part.read = part.recorded.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cursor(upto_seq: i64, snap: &str) -> db::Cursor {
        db::Cursor::at(upto_seq, snap)
    }

    #[test]
    fn a_batch_acked_whole_reaches_its_cursor() {
        let p = Pending {
            before: 10,
            after: cursor(20, "5:9:"),
            seqs: vec![4, 12, 20],
            unacked: BTreeSet::new(),
        };
        assert_eq!(p.reached(), Some(cursor(20, "5:9:")));
    }

    #[test]
    fn a_part_of_a_late_pass_acked_whole_reaches_its_cursor_with_the_pass() {
        let mut after = cursor(20, "5:9:5");
        after.late = Some(db::LatePass {
            after_seq: 8,
            snap: "9:9:".into(),
        });
        let p = Pending {
            before: 20,
            after: after.clone(),
            seqs: vec![6, 7, 8],
            unacked: BTreeSet::new(),
        };
        assert_eq!(p.reached(), Some(after), "recorded with its pass");
        let part = Pending {
            unacked: [8].into_iter().collect(),
            ..p
        };
        assert_eq!(part.reached(), None, "a part not acked whole: nothing");
    }

    #[test]
    fn a_prefix_past_the_late_rows_reaches_its_highest_seq() {
        let p = Pending {
            before: 10,
            after: cursor(20, "5:9:"),
            seqs: vec![4, 12, 15, 20],
            unacked: [15, 20].into_iter().collect(),
        };
        assert_eq!(p.reached(), Some(cursor(12, "5:9:")));
    }

    #[test]
    fn a_late_row_unacked_reaches_nothing() {
        let p = Pending {
            before: 10,
            after: cursor(20, "5:9:"),
            seqs: vec![4, 12, 20],
            unacked: [4].into_iter().collect(),
        };
        assert_eq!(p.reached(), None);
    }

    #[test]
    fn progress_records_in_batch_order_and_rewinds_to_the_record() {
        let mut progress = Progress {
            count: 1,
            ..Default::default()
        };
        progress
            .parts
            .insert(0, PartitionProgress::new(db::Cursor::start()));
        let row = |seq| OutboxRow {
            seq,
            id: uuid::Uuid::from_u128(seq as u128),
            aggregate_type: "a".into(),
            aggregate_id: "1".into(),
            event_type: "e".into(),
            payload: serde_json::json!({}).into(),
            headers: serde_json::json!({}),
            created_at: chrono::Utc::now(),
            attempts: 0,
        };
        let first = db::Batch {
            rows: vec![(row(1), db::Source::Next), (row(2), db::Source::Next)],
            next: cursor(2, "3:3:"),
            held: 0,
        };
        let second = db::Batch {
            rows: vec![(row(3), db::Source::Next)],
            next: cursor(3, "3:4:"),
            held: 0,
        };
        let all = Partition::ALL;
        assert_eq!(progress.read(all, db::Cursor::start(), first).len(), 2);
        assert_eq!(progress.read(all, cursor(2, "3:3:"), second).len(), 1);
        assert_eq!(progress.read_cursor(all), cursor(3, "3:4:"));
        // the second batch acked before the first is whole: nothing recorded past the first
        progress.acked(&[3, 1]);
        let part = &progress.parts[&0];
        assert!(
            part.pending
                .front()
                .is_some_and(|p| p.reached() == Some(cursor(1, "3:3:")))
        );
        progress.rewind();
        assert_eq!(progress.read_cursor(all), db::Cursor::start());
        assert!(progress.is_settled());
    }
}
