-- The claim (queued -> running) becomes a HOT update (issue 11): PostgreSQL writes the new row
-- version on the same page and adds NO index entry, instead of one entry in each of ~8 indexes.
-- An update is HOT only if no column any index reads (key, expression or partial predicate) changes
-- value and the new version fits on the page. The claim changes status, claim_token, worker_id and
-- started_at, so after this migration no index reads any of them:
--
-- * "open" (queued or running) is `finished_at IS NULL`: a new CHECK makes the two equivalent (the
--   old one only said finished rows have finished_at), and the partial indexes of open rows test
--   finished_at, which only the completion changes;
-- * the finished statuses the dead-letter rebuild, the backfill's missed ranges and the console's
--   state filter look up are read through `final_status`, a stored generated column: NULL while the
--   attempt is open, `status` once it is final. The claim leaves it NULL, so its value does not change.
--
-- The completion (running -> final) still changes indexed values (finished_at, final_status) and
-- stays a non-HOT update: one entry in each index that holds finished rows (time-ordered ids, at
-- the end, make those entries cheaper). finished_at keeps its btree: a BRIN index would save its
-- entry, but it serves the console's "last hour" only while rows are stored in the order they
-- finish, which reused free space breaks (bench/console_bench.py's overview: 27 -> 358 ms p50).
--
-- Every query that used a replaced index now states the replacement's predicate (db/executions.py,
-- db/console.py): `finished_at IS NULL` next to `status IN ('queued', 'running')`, `final_status =
-- 'dead'` for `status = 'dead'`, and so on; the planner does not derive them from the CHECK.
--
-- On an existing database: the indexes are dropped first, then ADD COLUMN ... STORED rewrites the
-- table once (ACCESS EXCLUSIVE for its duration, which grows with the history; the index builds
-- after it too: 23 s in all for 1,000,000 rows on the 2-core development machine), and the
-- rewrite already honours the new fillfactor, so existing queued rows get room for their claim too.
-- VALIDATE fails (and the migration with it, changing nothing) only if a row is open with a
-- finished_at, which no statement of this code base writes.

DROP INDEX job_executions_open_idx;
DROP INDEX job_executions_cancel_idx;
DROP INDEX job_executions_dead_letters_idx;
DROP INDEX job_executions_missed_ranges_idx;
DROP INDEX job_executions_status_created_idx;

-- Free space on every page for the new versions of a claim batch: a worker claims runs in the
-- order they were fired, so a batch claims every row of consecutive pages in one statement, and
-- versions a statement replaces cannot be pruned before it commits. A queued row of a small
-- payload is ~260 bytes and its claim adds ~60 (token, worker, start): at fillfactor 50, 1-2 rows of
-- every page did not fit (85 % of claims HOT in bench/pg_hotpath_bench.py); at 40, every claim is
-- HOT. The price is disk: pages of finished rows stay ~40-50 % full (the queries read by index).
-- (The completion's version goes where pruning the claim's dead version made room.)
ALTER TABLE job_executions SET (fillfactor = 40);

ALTER TABLE job_executions ADD CONSTRAINT job_executions_open_iff_unfinished
    CHECK ((status IN ('queued', 'running')) = (finished_at IS NULL)) NOT VALID;
ALTER TABLE job_executions VALIDATE CONSTRAINT job_executions_open_iff_unfinished;

ALTER TABLE job_executions ADD COLUMN final_status text
    GENERATED ALWAYS AS (CASE WHEN status IN ('queued', 'running') THEN NULL ELSE status END) STORED;

-- Reconcile, the concurrency policy and the `replace` policy: unfinished rows of a job.
CREATE INDEX job_executions_open_idx ON job_executions (job_id, due_at) WHERE finished_at IS NULL;
-- The console's queued/running filter and open-row counts, newest first (only open rows: tiny).
CREATE INDEX job_executions_open_created_idx ON job_executions (created_at DESC, id DESC) WHERE finished_at IS NULL;
-- The worker's cancel poll: its running attempts with a pending request.
CREATE INDEX job_executions_cancel_idx ON job_executions (id)
    WHERE cancel_requested_at IS NOT NULL AND finished_at IS NULL;
-- The dead-letter rebuild pages through dead, unpurged runs by run id.
CREATE INDEX job_executions_dead_letters_idx ON job_executions (run_id)
    WHERE final_status = 'dead' AND dlq_purged_at IS NULL;
-- A backfill looks up the missed range that may cover a slot.
CREATE INDEX job_executions_missed_ranges_idx ON job_executions (job_id, scheduled_for)
    WHERE final_status = 'missed';
-- The console's filter by a finished state (and the overview's latest failures), newest first.
CREATE INDEX job_executions_final_status_created_idx ON job_executions (final_status, created_at DESC, id DESC)
    WHERE final_status IS NOT NULL;

-- PostgreSQL evaluates every CHECK of a table on every UPDATE, whatever columns it changes, and a
-- bounded repetition (`{0,99}`) makes its regex engine slow: the handler and queue patterns cost
-- ~20 µs per claim and per completion here, more than the HOT update itself. The same rules,
-- written as an unbounded class plus a length bound, cost next to nothing. The jobs table gets the
-- same (every fire updates its jobs' next_run_time).
ALTER TABLE job_executions
    DROP CONSTRAINT job_executions_handler_check,
    DROP CONSTRAINT job_executions_queue_check,
    ADD CONSTRAINT job_executions_handler_check CHECK (handler ~ '^[a-z][a-z0-9_.-]*$' AND char_length(handler) <= 100),
    ADD CONSTRAINT job_executions_queue_check CHECK (queue ~ '^[A-Za-z0-9_.-]+$' AND char_length(queue) <= 64);
ALTER TABLE jobs
    DROP CONSTRAINT jobs_name_check,
    DROP CONSTRAINT jobs_handler_check,
    DROP CONSTRAINT jobs_queue_check,
    ADD CONSTRAINT jobs_name_check CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]*$' AND char_length(name) <= 200),
    ADD CONSTRAINT jobs_handler_check CHECK (handler ~ '^[a-z][a-z0-9_.-]*$' AND char_length(handler) <= 100),
    ADD CONSTRAINT jobs_queue_check CHECK (queue ~ '^[A-Za-z0-9_.-]+$' AND char_length(queue) <= 64);

-- Execution ids are time-ordered (UUID version 7: 48 bits of Unix milliseconds, then random bits),
-- no longer random (version 4). Every insert, and every non-HOT update (the completion), adds an
-- entry for the id to the primary key and, through run_id (a run's id is its first attempt's), to
-- the run index: with random ids each lands on a random leaf of indexes as large as the history,
-- with time-ordered ones on the few rightmost leaves (hot in cache, one full-page image per
-- checkpoint instead of one per leaf). Measured on 1M history rows: 200 inserts + their
-- completion, 70 -> 56 µs and 54 -> 45 µs per row (median). Ids stay unique and opaque; old rows
-- keep their random ids. db/executions.py `new_execution_id` makes the same ones in Python.
CREATE FUNCTION uuid_v7() RETURNS uuid LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    -- The first 6 bytes of a random UUID become the time in ms; bits 52 and 53 turn version 4 into 7
    -- (the variant bits stay those of the random UUID).
    SELECT encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid())
        PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
        FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid
$$;
ALTER TABLE job_executions ALTER COLUMN id SET DEFAULT uuid_v7();
