-- The end of the latest `missed` range ever recorded for each job (NULL: none). A manual run must
-- not be made for a slot inside a missed range (the range's row is that slot's record), so every
-- trigger looked for the job's latest range in `job_executions`. With this column only a job that
-- has ever had a range looks, and only for a slot up to its end: a trigger of any other job never
-- reads `job_executions` for it. Why it matters: the trigger statement is prepared once per pooled
-- connection, and a generic plan made while the day's partition was nearly empty (a new partition,
-- a fresh database) scanned that partition for every request, so each trigger cost more with
-- every run of the day (docs/performance.md, TriggerJob).
-- Only ever raised (by the statement that records ranges, `FiringRepository.fire_clocked`): a
-- dropped partition's ranges leave it too high, which costs that job the look, never a wrong answer.
ALTER TABLE jobs ADD COLUMN missed_through timestamptz;

UPDATE jobs j SET missed_through = m.through
FROM (SELECT job_id, max(missed_through) AS through FROM job_executions
      WHERE final_status = 'missed' GROUP BY job_id) AS m
WHERE m.job_id = j.id;
