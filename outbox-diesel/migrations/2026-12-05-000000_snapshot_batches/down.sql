DROP VIEW outbox_audit;
DROP TABLE outbox_progress;
DROP INDEX outbox_released;
DROP INDEX outbox_txid;
ALTER TABLE outbox DROP COLUMN txid;
