-- A run of misfired slots (a leader outage longer than the misfire grace) is recorded as ONE
-- `missed` row instead of one row per slot, so recovery after an outage of any length costs a row
-- per job, not per slot: `scheduled_for` is the first slot not run, `missed_through` the last one,
-- `missed_count` how many slots the range holds (NULL when the scheduler could not count them
-- cheaply; see scheduler.plan_job). Every `missed` row has a range: rows recorded before this
-- migration (one per slot) become ranges of one slot.
ALTER TABLE job_executions ADD COLUMN missed_through timestamptz, ADD COLUMN missed_count integer;

UPDATE job_executions SET missed_through = scheduled_for, missed_count = 1 WHERE status = 'missed';

ALTER TABLE job_executions
    ADD CONSTRAINT job_executions_missed_range_only_on_missed
        CHECK ((status = 'missed') = (missed_through IS NOT NULL)),
    ADD CONSTRAINT job_executions_missed_count_only_on_missed
        CHECK (missed_count IS NULL OR (status = 'missed' AND missed_count >= 1)),
    ADD CONSTRAINT job_executions_missed_range_ordered
        CHECK (missed_through IS NULL OR missed_through >= scheduled_for);

-- A backfill looks up the range that may cover a slot (the latest one starting by it).
CREATE INDEX job_executions_missed_ranges_idx ON job_executions (job_id, scheduled_for) WHERE status = 'missed';
