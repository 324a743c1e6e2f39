-- The ordered relay's poll index: unpublished rows that are neither parked nor held back behind
-- a parked row of their aggregate (parked_at = '-infinity'), so that a poll reads no held-back row.
CREATE INDEX outbox_ready ON outbox (seq) WHERE published_at IS NULL AND parked_at IS NULL;
