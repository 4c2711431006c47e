-- The dead-letter queue lives in Redis; PostgreSQL keeps enough to rebuild it after Redis lost it
-- (FLUSHALL, a restart without persistence): a run whose latest attempt is `dead` belongs in the
-- dead-letter queue, with that attempt's error as its reason, unless an operator purged it.
-- A purge is recorded here, so the rebuild does not bring the item back; a requeue needs no mark
-- (it adds a new attempt, so the latest attempt is no longer `dead`).
ALTER TABLE job_executions ADD COLUMN dlq_purged_at timestamptz;

-- What the rebuild pages through (by run id), without reading the whole history.
CREATE INDEX job_executions_dead_letters_idx ON job_executions (run_id)
    WHERE status = 'dead' AND dlq_purged_at IS NULL;
