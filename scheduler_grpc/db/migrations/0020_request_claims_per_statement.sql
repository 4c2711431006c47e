-- Request ids claimed by the statement that inserts the runs, set-based (issue 25). Migration 0016
-- claims each new run's request id in `execution_requests` with a BEFORE INSERT row trigger: a
-- PL/pgSQL call and an INSERT of its own per row, about two thirds of what PostgreSQL spends on
-- a manual run that carries a request id (measured: 93-108 µs per row with it, 31-35 without).
-- The trigger statement (`FiringRepository.trigger_now`, TriggerJob and BatchTriggerJobs) now
-- claims its request ids itself, in one `INSERT ... ON CONFLICT` of its own, and inserts only the
-- runs whose claim it holds; it says so with the transaction-local setting
-- `scheduler.request_claims = 'statement'`, and the trigger steps aside for such a transaction.
--
-- The trigger stays for every other writer: a server of the previous release during a rolling
-- upgrade (migrations run before the roles roll), or a row inserted by hand. A later release,
-- once no server of this one's predecessor can run, may drop it.

-- Whether the run a claim names exists. A fresh snapshot (a PL/pgSQL function, VOLATILE, in READ
-- COMMITTED): called on a claim found in conflict after waiting for the transaction that made it,
-- it must see that transaction's run, which committed after the calling statement began. Never
-- inlined into the caller (it is not SQL), which would take the caller's snapshot instead.
CREATE FUNCTION execution_exists(run uuid, slot timestamptz) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM job_executions e WHERE e.id = run AND e.scheduled_for = slot);
END
$$;

DROP TRIGGER execution_requests_claim ON job_executions;
CREATE TRIGGER execution_requests_claim BEFORE INSERT ON job_executions
    FOR EACH ROW
    WHEN (NEW.request_id IS NOT NULL
          AND current_setting('scheduler.request_claims', true) IS DISTINCT FROM 'statement')
    EXECUTE FUNCTION execution_requests_claim();
