//! Log tailing's window: the transactions read and not confirmed, their events not acked, and
//! how far the slot may be confirmed.

use std::collections::{HashSet, VecDeque};

use chrono::{DateTime, Utc};
use outbox_diesel::relay::OutboxRow;
use outbox_diesel::wal::{Lsn, WalBatch};
use uuid::Uuid;

/// The transactions read and not confirmed yet, in commit order, and their events not acked
/// yet, in send order.
///
/// An acked event leaves the window at once; its transaction keeps a count of the events
/// still unacked. A transaction is confirmable once its end was read and the count is zero,
/// and the slot is confirmed past the longest run of confirmable transactions from the front.
/// The pipeline returns acks in send order while nothing failed; after a failure, later acks
/// may still arrive out of that order, and each takes its own event out.
#[derive(Debug, Default)]
pub(super) struct Window {
    /// In commit order: `commit_lsn` increases.
    pub(super) transactions: VecDeque<Pending>,
    /// Each with its transaction's `commit_lsn`.
    pub(super) rows: VecDeque<(OutboxRow, Lsn)>,
    /// The payload bytes of `rows`.
    pub(super) bytes: usize,
    /// Where the slot may be confirmed once every transaction of the window is acked.
    pub(super) caught_up_to: Option<Lsn>,
}

/// A transaction of the window.
#[derive(Debug)]
pub(super) struct Pending {
    pub(super) commit_lsn: Lsn,
    /// `None` until its last part is read.
    pub(super) end_lsn: Option<Lsn>,
    pub(super) commit_time: DateTime<Utc>,
    /// Its events in the window.
    pub(super) unacked: usize,
    /// Its highest `seq`, parked events included.
    pub(super) max_seq: i64,
}

/// How far the window lets the slot be confirmed.
#[derive(Debug, PartialEq)]
pub(super) struct Confirmable {
    /// The end of the last transaction acked whole, or the caught-up position when all are.
    pub(super) to: Option<Lsn>,
    /// The highest `seq` up to there.
    pub(super) max_seq: i64,
    /// How many transactions from the front are acked whole.
    pub(super) done: usize,
}

impl Window {
    /// Adds the transactions (and parts) of `batch`; their events not parked (by id and
    /// transaction) join the rows, to be sent. Returns the index of the first new row.
    pub(super) fn add(&mut self, batch: WalBatch, parked: &HashSet<(Uuid, Lsn)>) -> usize {
        let first = self.rows.len();
        self.caught_up_to = self.caught_up_to.max(batch.caught_up_to);
        for tx in batch.transactions {
            let continued = self
                .transactions
                .back()
                .is_some_and(|t| t.commit_lsn == tx.commit_lsn && t.end_lsn.is_none());
            if !continued {
                self.transactions.push_back(Pending {
                    commit_lsn: tx.commit_lsn,
                    end_lsn: None,
                    commit_time: tx.commit_time,
                    unacked: 0,
                    max_seq: 0,
                });
            }
            let Some(pending) = self.transactions.back_mut() else {
                continue;
            };
            pending.end_lsn = tx.end_lsn;
            for row in tx.rows {
                pending.max_seq = pending.max_seq.max(row.seq);
                if !parked.contains(&(row.id, tx.commit_lsn)) {
                    pending.unacked += 1;
                    self.bytes += row.payload.as_str().len();
                    self.rows.push_back((row, tx.commit_lsn));
                }
            }
        }
        first
    }

    /// Takes the acked events out: each the first row with its `seq` (the front one while
    /// acks come in send order).
    pub(super) fn ack(&mut self, seqs: &[i64]) {
        for seq in seqs {
            let Some(i) = self.rows.iter().position(|(r, _)| r.seq == *seq) else {
                continue;
            };
            let Some((row, commit_lsn)) = self.rows.remove(i) else {
                continue;
            };
            self.bytes = self.bytes.saturating_sub(row.payload.as_str().len());
            let t = self
                .transactions
                .partition_point(|t| t.commit_lsn < commit_lsn);
            if let Some(t) = self.transactions.get_mut(t) {
                t.unacked = t.unacked.saturating_sub(1);
            }
        }
    }

    pub(super) fn confirmable(&self) -> Confirmable {
        let mut c = Confirmable {
            to: None,
            max_seq: 0,
            done: 0,
        };
        for t in &self.transactions {
            match t.end_lsn {
                Some(end) if t.unacked == 0 => {
                    c.to = Some(end);
                    c.max_seq = c.max_seq.max(t.max_seq);
                    c.done += 1;
                }
                _ => return c,
            }
        }
        c.to = c.to.max(self.caught_up_to);
        c
    }

    /// Drops the first `n` transactions (confirmed, so acked whole).
    pub(super) fn drop_confirmed(&mut self, n: usize) {
        self.transactions.drain(..n.min(self.transactions.len()));
    }

    /// The commit time of the oldest transaction not confirmed.
    pub(super) fn oldest(&self) -> Option<DateTime<Utc>> {
        self.transactions.front().map(|t| t.commit_time)
    }

    /// The unacked row `seq` and its transaction's `commit_lsn`.
    pub(super) fn unacked_row(&self, seq: i64) -> Option<(OutboxRow, Lsn)> {
        self.rows.iter().find(|(r, _)| r.seq == seq).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_diesel::wal::Transaction;

    fn row(seq: i64) -> OutboxRow {
        OutboxRow {
            seq,
            id: Uuid::now_v7(),
            aggregate_type: "a".into(),
            aggregate_id: "1".into(),
            event_type: "e".into(),
            payload: serde_json::json!({}).into(),
            headers: serde_json::json!({}),
            created_at: Utc::now(),
            attempts: 0,
        }
    }

    /// A transaction (or part) whose commit record starts at `commit`, with rows `seqs`.
    fn tx(commit: u64, end: Option<u64>, seqs: &[i64]) -> Transaction {
        Transaction {
            xid: commit as u32,
            commit_lsn: Lsn(commit),
            end_lsn: end.map(Lsn),
            commit_time: Utc::now(),
            rows: seqs.iter().map(|&s| row(s)).collect(),
        }
    }

    fn batch() -> WalBatch {
        WalBatch {
            // commit order differs from seq order
            transactions: vec![
                tx(90, Some(100), &[5, 6]),
                tx(190, Some(200), &[3]),
                tx(290, Some(300), &[7]),
            ],
            caught_up_to: Some(Lsn(400)),
            messages: 10,
        }
    }

    fn seqs(w: &Window) -> Vec<i64> {
        w.rows.iter().map(|(r, _)| r.seq).collect()
    }

    fn confirmable(to: Option<u64>, max_seq: i64, done: usize) -> Confirmable {
        Confirmable {
            to: to.map(Lsn),
            max_seq,
            done,
        }
    }

    #[test]
    fn confirms_only_past_whole_acked_transactions() {
        let mut w = Window::default();
        assert_eq!(w.add(batch(), &HashSet::new()), 0);
        assert_eq!(seqs(&w), [5, 6, 3, 7]);
        assert_eq!(w.confirmable(), confirmable(None, 0, 0));
        // the first transaction, then part of the second read
        w.ack(&[5, 6]);
        assert_eq!(w.confirmable(), confirmable(Some(100), 6, 1));
        // 3 failed while 7 was acked: nothing past the first transaction
        w.ack(&[7]);
        assert_eq!(w.confirmable(), confirmable(Some(100), 6, 1));
        assert_eq!(
            w.unacked_row(3).map(|(r, lsn)| (r.seq, lsn)),
            Some((3, Lsn(190)))
        );
        assert!(w.unacked_row(7).is_none());
        // all acked: past the whole read
        w.ack(&[3]);
        assert_eq!(w.confirmable(), confirmable(Some(400), 7, 3));
        w.drop_confirmed(3);
        assert!(w.transactions.is_empty() && w.rows.is_empty() && w.oldest().is_none());
    }

    #[test]
    fn a_transaction_in_parts_is_confirmed_only_after_its_last_part_is_acked() {
        let mut w = Window::default();
        let part = |txs: Vec<Transaction>, caught_up_to: Option<u64>| WalBatch {
            transactions: txs,
            caught_up_to: caught_up_to.map(Lsn),
            messages: 0,
        };
        // a whole transaction, then the first part of a large one
        let first = w.add(
            part(
                vec![tx(90, Some(100), &[1]), tx(190, None, &[2, 3])],
                Some(100),
            ),
            &HashSet::new(),
        );
        assert_eq!(first, 0);
        w.ack(&[1, 2, 3]);
        assert_eq!(w.confirmable(), confirmable(Some(100), 1, 1));
        w.drop_confirmed(1);
        // acked events leave the window; their transaction stays, open
        assert!(w.rows.is_empty());
        assert_eq!(w.bytes, 0);
        assert_eq!(w.transactions.len(), 1);
        // a middle part
        assert_eq!(
            w.add(part(vec![tx(190, None, &[4])], None), &HashSet::new()),
            0
        );
        w.ack(&[4]);
        assert_eq!(w.confirmable(), confirmable(None, 0, 0));
        // its last part, with its end, and the next transaction
        w.add(
            part(
                vec![tx(190, Some(200), &[5]), tx(290, Some(300), &[6])],
                Some(300),
            ),
            &HashSet::new(),
        );
        assert_eq!(w.transactions.len(), 2, "the parts are one transaction");
        assert_eq!(seqs(&w), [5, 6]);
        w.ack(&[5]);
        assert_eq!(w.confirmable(), confirmable(Some(200), 5, 1));
        w.ack(&[6]);
        assert_eq!(w.confirmable(), confirmable(Some(300), 6, 2));
    }

    #[test]
    fn a_last_part_without_events_ends_its_transaction() {
        let mut w = Window::default();
        let one = |t: Transaction| WalBatch {
            transactions: vec![t],
            caught_up_to: None,
            messages: 0,
        };
        w.add(one(tx(190, None, &[2, 3])), &HashSet::new());
        w.ack(&[2, 3]);
        w.add(one(tx(190, Some(200), &[])), &HashSet::new());
        assert_eq!(w.confirmable(), confirmable(Some(200), 3, 1));
    }

    #[test]
    fn parked_events_are_passed_over_in_their_transaction_only() {
        let b = batch();
        let parked: HashSet<_> = [(b.transactions[0].rows[1].id, Lsn(90))].into();
        let mut w = Window::default();
        w.add(b.clone(), &parked);
        assert_eq!(seqs(&w), [5, 3, 7]);
        w.ack(&[5, 3, 7]);
        assert_eq!(w.confirmable(), confirmable(Some(400), 7, 3));
        let elsewhere: HashSet<_> = [(b.transactions[0].rows[1].id, Lsn(190))].into();
        let mut w = Window::default();
        w.add(b, &elsewhere);
        assert_eq!(w.rows.len(), 4);
    }

    #[test]
    fn a_transaction_whose_events_are_all_parked_is_confirmed_with_its_neighbours() {
        let b = batch();
        let parked: HashSet<_> = [(b.transactions[1].rows[0].id, Lsn(190))].into();
        let mut w = Window::default();
        w.add(b, &parked);
        // 5 and 6 acked: the parked-only transaction at 190 goes with the first
        w.ack(&[5, 6]);
        assert_eq!(w.confirmable(), confirmable(Some(200), 6, 2));
    }

    #[test]
    fn the_window_counts_the_payload_bytes_it_holds() {
        let mut w = Window::default();
        w.add(batch(), &HashSet::new());
        assert_eq!(w.bytes, 4 * "{}".len());
        w.ack(&[5, 6, 3]);
        assert_eq!(w.bytes, "{}".len());
    }
}
