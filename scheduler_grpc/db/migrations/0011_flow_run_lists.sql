-- Lists of flow runs (the console's flow runs page, ListFlowRuns): newest first, optionally by the
-- job that started them or by state, each an index range (the open-runs index serves the leader).
CREATE INDEX flow_runs_created_idx ON flow_runs (created_at DESC, id DESC);
CREATE INDEX flow_runs_root_created_idx ON flow_runs (root_job_id, created_at DESC, id DESC);
CREATE INDEX flow_runs_state_created_idx ON flow_runs (state, created_at DESC, id DESC);
