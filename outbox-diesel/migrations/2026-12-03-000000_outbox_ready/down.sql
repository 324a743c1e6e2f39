DROP INDEX outbox_ready;
