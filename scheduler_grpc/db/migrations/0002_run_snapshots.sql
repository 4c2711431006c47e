-- Worker-side hardening (issue 8): runs carry the definition of their slot, cancel requests are
-- persisted, and a graceful hand-back records the interrupted attempt instead of rewriting it.

-- The job definition as of the slot, copied when the run is fired (scan, trigger, backfill,
-- dead-letter requeue) and from attempt to attempt (retries, recoveries, hand-backs). The claim
-- reads these, not the jobs row, so editing a job never changes a run already fired. NULL only on
-- rows written before this migration: the claim falls back to the job for those.
ALTER TABLE job_executions
    ADD COLUMN handler         text CHECK (handler ~ '^[a-z][a-z0-9_.-]{0,99}$'),
    ADD COLUMN payload         jsonb CHECK (jsonb_typeof(payload) = 'object' AND octet_length(payload::text) <= 65536),
    ADD COLUMN queue           text CHECK (queue ~ '^[A-Za-z0-9_.-]{1,64}$'),
    ADD COLUMN timeout         interval CHECK (timeout > interval '0' AND timeout <= interval '24 hours'),
    ADD COLUMN max_retries     integer CHECK (max_retries BETWEEN 0 AND 100),
    ADD COLUMN initial_backoff interval CHECK (initial_backoff > interval '0'),
    ADD COLUMN max_backoff     interval,
    ADD COLUMN retry_jitter    boolean,
    -- Set on a `running` attempt by CancelExecution or the `replace` policy. Pub/sub only makes
    -- the worker notice sooner: the worker polls this column for its running attempts, and a
    -- claim never starts a new attempt of a run whose cancel was requested.
    ADD COLUMN cancel_requested_at timestamptz;

-- `interrupted`: the worker stopped the attempt on a graceful shutdown (or put it back unstarted
-- because its breaker was open) and the run goes on in a new attempt. Not the handler's failure:
-- it spends no retry budget, so the attempt number may pass max_retries + 1 (hence no upper bound
-- on `attempt` any more; the retry budget is enforced by counting failed attempts).
ALTER TABLE job_executions DROP CONSTRAINT job_executions_status_check;
ALTER TABLE job_executions ADD CONSTRAINT job_executions_status_check CHECK (status IN (
    'queued', 'running', 'succeeded', 'failed', 'timed_out', 'cancelled',
    'dead', 'abandoned', 'interrupted', 'skipped', 'missed'));
ALTER TABLE job_executions DROP CONSTRAINT job_executions_attempt_check;
ALTER TABLE job_executions ADD CONSTRAINT job_executions_attempt_check CHECK (attempt >= 1);
-- An interrupted attempt ran (or was claimed) on a worker, like the other started statuses.
ALTER TABLE job_executions ADD CONSTRAINT job_executions_interrupted_started_check
    CHECK (status <> 'interrupted' OR (started_at IS NOT NULL AND worker_id IS NOT NULL));

-- The worker's cancel poll: its running attempts with a pending request (a tiny partial index).
CREATE INDEX job_executions_cancel_idx ON job_executions (id) WHERE cancel_requested_at IS NOT NULL
    AND status = 'running';
