-- Job dependencies (issue 13): a job may depend on upstream jobs; firing or triggering a job with
-- dependents starts a *flow run* over it and every job reachable from it along the edges.

ALTER TABLE jobs ADD COLUMN trigger_rule text NOT NULL DEFAULT 'all_succeeded'
    CHECK (trigger_rule IN ('all_succeeded', 'all_done', 'any_failed'));

-- The dependency graph: `job_id` runs after `upstream_id`. Writers take the graph's advisory lock
-- (db/jobs.py GRAPH_LOCK) in their transaction, so a cycle check and the write it allows are one
-- step even across server processes. Deleting an upstream deletes its edges (a detach); the API
-- refuses that unless asked (FAILED_PRECONDITION).
CREATE TABLE job_dependencies (
    job_id      uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    upstream_id uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    position    integer NOT NULL CHECK (position >= 0),
    PRIMARY KEY (job_id, upstream_id),
    CHECK (job_id <> upstream_id)
);
-- The walks go both ways: upward (cycle check: the primary key) and downward (a flow's reach).
CREATE INDEX job_dependencies_upstream_idx ON job_dependencies (upstream_id, job_id);

-- `upstream_failed`: not run, its upstreams' outcomes can no longer meet its trigger rule.
-- `upstream`: a run a flow run created once its upstreams had finished.
ALTER TABLE job_executions DROP CONSTRAINT job_executions_status_check;
ALTER TABLE job_executions ADD CONSTRAINT job_executions_status_check CHECK (status IN (
    'queued', 'running', 'succeeded', 'failed', 'timed_out', 'cancelled',
    'dead', 'abandoned', 'interrupted', 'skipped', 'missed', 'upstream_failed'));
ALTER TABLE job_executions DROP CONSTRAINT job_executions_trigger_check;
ALTER TABLE job_executions ADD CONSTRAINT job_executions_trigger_check
    CHECK (trigger IN ('schedule', 'manual', 'retry', 'backfill', 'dlq_requeue', 'upstream'));

-- One flow run per root run; its id IS the root run's id (so nothing in the fire or trigger
-- statements has to name it). `state` moves from running to succeeded / failed (every node final)
-- or cancelled (CancelFlowRun).
CREATE TABLE flow_runs (
    id          uuid PRIMARY KEY,
    root_job_id uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    state       text NOT NULL DEFAULT 'running' CHECK (state IN ('running', 'succeeded', 'failed', 'cancelled')),
    created_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    CHECK ((state = 'running') = (finished_at IS NULL))
);
-- The leader's advance loop reads only open flow runs: O(open flow runs), not O(history).
CREATE INDEX flow_runs_open_idx ON flow_runs (created_at, id) WHERE state = 'running';

-- One node per job of a flow run, created with the flow run (the reachable sub-DAG as it was
-- then: `upstream_ids` and `trigger_rule` are snapshots). `run_id` is NULL while the node waits;
-- it is set exactly once, in the transaction that creates the node's run (queued, or a finished
-- upstream_failed / skipped / cancelled row): the compare-and-set on `run_id IS NULL` keyed on
-- (flow_run_id, job_id) is what makes a downstream run exist once per flow run.
CREATE TABLE flow_nodes (
    flow_run_id  uuid NOT NULL REFERENCES flow_runs (id) ON DELETE CASCADE,
    job_id       uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    run_id       uuid UNIQUE,
    upstream_ids uuid[] NOT NULL DEFAULT '{}',
    trigger_rule text NOT NULL DEFAULT 'all_succeeded'
                 CHECK (trigger_rule IN ('all_succeeded', 'all_done', 'any_failed')),
    PRIMARY KEY (flow_run_id, job_id)
);

-- Starting a flow run: in the transaction of the statement that created the root run (the
-- scheduler's fire, TriggerJob, BackfillJob), so a crash can never leave a root run without its
-- flow run. A statement-level trigger over the inserted rows: one cheap test per statement while
-- no dependency exists, and only first attempts of jobs that have dependents start a flow run.
CREATE FUNCTION flows_start_runs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM job_dependencies) THEN
        RETURN NULL;
    END IF;
    INSERT INTO flow_runs (id, root_job_id)
    SELECT n.run_id, n.job_id FROM inserted_runs n
    WHERE n.attempt = 1 AND n.status = 'queued' AND n.trigger IN ('schedule', 'manual', 'backfill')
      AND EXISTS (SELECT 1 FROM job_dependencies d WHERE d.upstream_id = n.job_id)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- The root and its descendants, each with its upstreams inside the flow run; the root's node
    -- holds the root run from the start.
    WITH RECURSIVE reach (flow_run_id, job_id) AS (
        SELECT f.id, f.root_job_id FROM flow_runs f JOIN inserted_runs n ON n.run_id = f.id
        UNION
        SELECT r.flow_run_id, d.job_id FROM reach r JOIN job_dependencies d ON d.upstream_id = r.job_id
    )
    INSERT INTO flow_nodes (flow_run_id, job_id, run_id, upstream_ids, trigger_rule)
    SELECT r.flow_run_id, r.job_id,
           CASE WHEN f.root_job_id = r.job_id THEN f.id END,
           CASE WHEN f.root_job_id = r.job_id THEN '{}'::uuid[] ELSE ARRAY(
               SELECT d.upstream_id FROM job_dependencies d
               WHERE d.job_id = r.job_id
                 AND EXISTS (SELECT 1 FROM reach u WHERE u.flow_run_id = r.flow_run_id AND u.job_id = d.upstream_id)
               ORDER BY d.position) END,
           j.trigger_rule
    FROM reach r JOIN jobs j ON j.id = r.job_id JOIN flow_runs f ON f.id = r.flow_run_id
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER flows_start AFTER INSERT ON job_executions
    REFERENCING NEW TABLE AS inserted_runs FOR EACH STATEMENT EXECUTE FUNCTION flows_start_runs();
