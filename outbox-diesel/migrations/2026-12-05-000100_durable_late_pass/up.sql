-- Late passes recorded with their cursor: when a large transaction held open across batches
-- commits, the ordered relay reads its rows (late, at or below the cursor's seq) in parts, at the
-- snapshot that found them. Each part's progress row records the pass (the highest seq it has
-- read and its snapshot), so that a relay taking the partition over during the pass goes on
-- where it stood instead of publishing the pass again from its start.
ALTER TABLE outbox_progress ADD COLUMN late_after_seq bigint, ADD COLUMN late_snap pg_snapshot,
    ADD CONSTRAINT outbox_progress_late_pass CHECK ((late_after_seq IS NULL) = (late_snap IS NULL));
-- A row read by a pass is dated by the first progress row whose pass covered it.
CREATE OR REPLACE VIEW outbox_audit AS
SELECT o.seq, o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers,
       o.created_at,
       COALESCE(o.published_at, (SELECT p.published_at FROM outbox_progress p
                                  WHERE o.parked_at IS NULL AND p.upto_seq >= o.seq
                                    AND p.partition = o.aggregate_hash % p.partitions
                                    AND (pg_visible_in_snapshot(o.txid, p.snap)
                                         OR (p.late_after_seq >= o.seq
                                             AND pg_visible_in_snapshot(o.txid, p.late_snap)))
                                  ORDER BY p.upto_seq, p.id LIMIT 1)) AS published_at,
       o.aggregate_hash, o.attempts, o.last_error, o.parked_at, o.txid
  FROM outbox o;
-- A late pass reads each part of a transaction's rows in seq order from where it stands: the
-- index on the transaction id carries seq too, so a part reads its own rows and not every row
-- of the transaction left (each part read them all, and a pass was quadratic in its rows).
DROP INDEX outbox_txid;
CREATE INDEX outbox_txid ON outbox (txid, seq);
