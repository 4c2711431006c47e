-- The web console's filters (issue 12): each page answers in milliseconds with a million history
-- rows only if an index serves its query (checked with EXPLAIN in bench/console_bench.py's data).

-- The overview: attempts finished in the last hour (the per-minute chart and the start lateness).
CREATE INDEX job_executions_finished_idx ON job_executions (finished_at) WHERE finished_at IS NOT NULL;
-- The executions list filtered by state (and the overview's latest failures), newest first with the
-- list's keyset (created_at, id).
CREATE INDEX job_executions_status_created_idx ON job_executions (status, created_at DESC, id DESC);
-- The executions list filtered by handler (the run's snapshot), newest first.
CREATE INDEX job_executions_handler_created_idx ON job_executions (handler, created_at DESC, id DESC);
