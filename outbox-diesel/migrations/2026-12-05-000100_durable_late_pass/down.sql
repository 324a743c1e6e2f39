DROP INDEX outbox_txid;
CREATE INDEX outbox_txid ON outbox (txid);
CREATE OR REPLACE VIEW outbox_audit AS
SELECT o.seq, o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers,
       o.created_at,
       COALESCE(o.published_at, (SELECT p.published_at FROM outbox_progress p
                                  WHERE o.parked_at IS NULL AND p.upto_seq >= o.seq
                                    AND p.partition = o.aggregate_hash % p.partitions
                                    AND pg_visible_in_snapshot(o.txid, p.snap)
                                  ORDER BY p.upto_seq, p.id LIMIT 1)) AS published_at,
       o.aggregate_hash, o.attempts, o.last_error, o.parked_at, o.txid
  FROM outbox o;
ALTER TABLE outbox_progress DROP CONSTRAINT outbox_progress_late_pass,
    DROP COLUMN late_after_seq, DROP COLUMN late_snap;
