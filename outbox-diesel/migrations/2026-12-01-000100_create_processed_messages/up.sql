-- The consumers' inbox: which message ids each consumer has processed. See outbox-diesel's
-- `inbox` module.
CREATE TABLE processed_messages (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX processed_messages_processed_at ON processed_messages (processed_at);
