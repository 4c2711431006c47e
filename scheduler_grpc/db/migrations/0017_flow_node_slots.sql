-- Each flow node's run slot (issue 24): `job_executions` is partitioned by `scheduled_for`
-- (migration 0016), so a read of a node's run by `run_id` alone probes every partition's index.
-- With the slot beside the run id, the console's flow run page, the flow runs list and the
-- upstream results of a claim read one partition per node. Set with `run_id` (the same statement),
-- NULL while the node has no run.
ALTER TABLE flow_nodes ADD COLUMN run_scheduled_for timestamptz;

-- Existing nodes: their run's first attempt (its id is the run id) has the run's slot.
UPDATE flow_nodes n SET run_scheduled_for = e.scheduled_for
FROM job_executions e WHERE e.id = n.run_id;

-- The root node's run is the inserted root run: its slot comes with it.
CREATE OR REPLACE FUNCTION flows_start_runs() RETURNS trigger LANGUAGE plpgsql AS $$
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
    -- holds the root run (and its slot) from the start.
    WITH RECURSIVE reach (flow_run_id, job_id) AS (
        SELECT f.id, f.root_job_id FROM flow_runs f JOIN inserted_runs n ON n.run_id = f.id
        UNION
        SELECT r.flow_run_id, d.job_id FROM reach r JOIN job_dependencies d ON d.upstream_id = r.job_id
    )
    INSERT INTO flow_nodes (flow_run_id, job_id, run_id, run_scheduled_for, upstream_ids, trigger_rule)
    SELECT r.flow_run_id, r.job_id,
           CASE WHEN f.root_job_id = r.job_id THEN f.id END,
           CASE WHEN f.root_job_id = r.job_id
                THEN (SELECT n.scheduled_for FROM inserted_runs n WHERE n.id = f.id) END,
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
