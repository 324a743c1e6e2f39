-- Snapshot batches: the ordered relay writes nothing per published row. Each row carries the id
-- of the transaction that inserted it; per partition, the relay records after each batch the
-- highest seq it has read and the snapshot it read at, and finds the rows committed since by
-- seq (after that seq) and by transaction id (those in progress at that snapshot or begun after).
-- A table made earlier gets its rows' ids from this statement's transaction: all committed.
ALTER TABLE outbox ADD COLUMN txid xid8 NOT NULL DEFAULT pg_current_xact_id();
CREATE INDEX outbox_txid ON outbox (txid);
-- rows released by `outbox-relay retry` after the ordered relay had read past them
CREATE INDEX outbox_released ON outbox (seq) WHERE parked_at = 'infinity';
-- The ordered relay's progress: one row per batch and partition (the last one is where the
-- partition's relay goes on from), kept for the retention so that outbox_audit can date them.
CREATE TABLE outbox_progress (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    partitions   integer     NOT NULL,
    partition    integer     NOT NULL,
    upto_seq     bigint      NOT NULL,
    snap         pg_snapshot NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_progress_cursor ON outbox_progress (partitions, partition, id);
-- the first batch that covered a row: the first at or past its seq (a partition's seq only grows)
CREATE INDEX outbox_progress_upto ON outbox_progress (upto_seq, id);
-- Every row with when it was published: the column's value, or for a row the ordered relay
-- published, the time of the first batch that covered it. NULL while unpublished.
CREATE VIEW outbox_audit AS
SELECT o.seq, o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers,
       o.created_at,
       COALESCE(o.published_at, (SELECT p.published_at FROM outbox_progress p
                                  WHERE o.parked_at IS NULL AND p.upto_seq >= o.seq
                                    AND p.partition = o.aggregate_hash % p.partitions
                                    AND pg_visible_in_snapshot(o.txid, p.snap)
                                  ORDER BY p.upto_seq, p.id LIMIT 1)) AS published_at,
       o.aggregate_hash, o.attempts, o.last_error, o.parked_at, o.txid
  FROM outbox o;
