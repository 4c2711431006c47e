-- User management over the API (issue 21): an etag per user and idempotent creation.

-- Raised by every change an administrator makes (role, enabled, password); sessions remember the
-- version they were opened or re-scoped at, so an older re-scope never overwrites a newer one.
ALTER TABLE users ADD COLUMN version bigint NOT NULL DEFAULT 1;
-- CreateUser's request_id: a retry with the same id returns the user that request created.
ALTER TABLE users ADD COLUMN request_id text UNIQUE CHECK (char_length(request_id) BETWEEN 1 AND 128);
