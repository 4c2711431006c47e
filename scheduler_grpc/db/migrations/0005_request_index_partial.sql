-- Every write of an execution row that is not a HOT update (the claim and the completion change
-- `status`, which the partial indexes' predicates read) adds an entry to every index of the
-- table. The (job_id, request_id) uniqueness only concerns the few runs a TriggerJob with a
-- request id created; the other rows (NULL request_id) no longer get an entry on every write.
-- Same rule as before (NULLs never conflicted); `ON CONFLICT DO NOTHING` and the lookup by
-- (job_id, request_id) use the partial index.
ALTER TABLE job_executions DROP CONSTRAINT job_executions_job_id_request_id_key;
CREATE UNIQUE INDEX job_executions_request_idx ON job_executions (job_id, request_id) WHERE request_id IS NOT NULL;
