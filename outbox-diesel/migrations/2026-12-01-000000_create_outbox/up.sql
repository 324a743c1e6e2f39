-- The transactional outbox. See outbox-diesel's documentation for what each column is for.
CREATE TABLE outbox (
    seq            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id             uuid        NOT NULL UNIQUE,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL DEFAULT '{}',
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz,
    -- a stable hash of the aggregate id (first 28 bits of its MD5), for partitioned relays
    aggregate_hash integer     NOT NULL
        GENERATED ALWAYS AS (('x' || substr(md5(aggregate_id), 1, 7))::bit(28)::integer) STORED,
    attempts       integer     NOT NULL DEFAULT 0,
    last_error     text,
    parked_at      timestamptz,
    CONSTRAINT outbox_aggregate_type_is_a_subject_token
        CHECK (aggregate_type <> '' AND aggregate_type !~ '[.*>[:space:][:cntrl:]]'),
    CONSTRAINT outbox_event_type_is_subject_tokens
        CHECK (event_type ~ '^[^.*>[:space:][:cntrl:]]+(\.[^.*>[:space:][:cntrl:]]+)*$'),
    CONSTRAINT outbox_aggregate_id_is_a_header_value CHECK (aggregate_id <> '' AND aggregate_id !~ '[\r\n]'),
    CONSTRAINT outbox_headers_is_an_object CHECK (jsonb_typeof(headers) = 'object')
);
CREATE INDEX outbox_unpublished ON outbox (seq) WHERE published_at IS NULL;
CREATE INDEX outbox_parked ON outbox (aggregate_type, aggregate_id) WHERE parked_at IS NOT NULL;
CREATE INDEX outbox_published ON outbox (published_at) WHERE published_at IS NOT NULL;
-- a hot queue table: vacuum it after a fixed number of dead rows, not a fraction of its size
ALTER TABLE outbox SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
                        autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 1000);
