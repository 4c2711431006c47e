-- `job_executions` partitioned by time (issue 24): PostgreSQL declarative partitioning by RANGE of
-- `scheduled_for` (the slot), one partition per UTC day (`job_executions_pYYYYMMDD`, covering
-- [day 00:00 UTC, next day 00:00 UTC)) and a DEFAULT partition for any slot no day partition covers
-- (a backfill years back, a slot beyond the days created ahead): an insert never fails for want of
-- a partition. The leader creates the days ahead (`job_executions_add_partition`, idempotent) and
-- retention detaches and drops whole days (db/partitions.py), never a DELETE of executions.
--
-- Why `scheduled_for`: every attempt of a run shares its run's slot, so a run lives in ONE
-- partition, and the uniqueness the guarantees rest on, (job_id, scheduled_for, attempt), contains
-- the partition key: PostgreSQL still enforces "a slot has one first attempt" by itself.
-- The primary key becomes (id, scheduled_for) (a unique index must contain the partition key); a
-- lookup by id alone probes the primary key of every partition (one index probe each).
-- The (job_id, request_id) uniqueness cannot be a unique index any more (a manual run's slot is its
-- trigger time, so a retried TriggerJob may land in another day): it moves to `execution_requests`,
-- an unpartitioned table with that primary key, claimed by a BEFORE INSERT trigger for every new row
-- that carries a request id (whichever statement inserts it).
--
-- The conversion copies every row into the new table in this migration's transaction (ACCESS
-- EXCLUSIVE on the old table for its duration: 28-45 s for 1,000,000 rows over 30 days on the
-- 2-core development machine, bench/partition_migration_bench.py), then
-- builds the indexes on each partition and drops the old table. A partition is made for every UTC day
-- that holds rows (retention then drops the old ones) and for today and the next two days.

-- The old table steps aside; its indexes go first so the new ones can take their names.
ALTER TABLE job_executions RENAME TO job_executions_unpartitioned;
ALTER TABLE job_executions_unpartitioned
    DROP CONSTRAINT job_executions_pkey,
    DROP CONSTRAINT job_executions_job_id_scheduled_for_attempt_key;
DROP INDEX job_executions_cancel_idx, job_executions_created_idx, job_executions_dead_letters_idx,
    job_executions_final_status_created_idx, job_executions_finished_idx, job_executions_handler_created_idx,
    job_executions_missed_ranges_idx, job_executions_open_created_idx, job_executions_open_idx,
    job_executions_request_idx, job_executions_run_idx;

-- The same columns, defaults, CHECKs and generated column, partitioned by the slot.
CREATE TABLE job_executions (
    LIKE job_executions_unpartitioned INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED
        INCLUDING STORAGE
) PARTITION BY RANGE (scheduled_for);

-- A partition's indexes are named after the partitioned index they belong to, with the partition's
-- suffix (`job_executions_open_idx_p20261202`), so a plan says which index each partition used.
CREATE FUNCTION job_executions_name_indexes(part regclass) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    suffix text := substring(part::text FROM '^job_executions_(.*)$');
    pair record;
BEGIN
    FOR pair IN
        SELECT child.relname AS child, parent.relname AS parent
        FROM pg_index x
        JOIN pg_inherits i ON i.inhrelid = x.indexrelid
        JOIN pg_class child ON child.oid = x.indexrelid
        JOIN pg_class parent ON parent.oid = i.inhparent
        WHERE x.indrelid = part AND child.relname <> parent.relname || '_' || suffix
    LOOP
        EXECUTE format('ALTER INDEX %I RENAME TO %I', pair.child, pair.parent || '_' || suffix);
    END LOOP;
END
$$;

-- A day's partition: made as a table of its own (the parent's columns and CHECKs, fillfactor 40 as
-- migration 0009 chose, a CHECK of its range so ATTACH need not scan it), given the rows the DEFAULT
-- partition holds for that day (they landed there while no partition covered it), then attached: the
-- parent's indexes, foreign key and row triggers are added to it. ATTACH takes SHARE UPDATE EXCLUSIVE
-- on the parent (reads and writes go on) and scans the DEFAULT partition (kept small) under its lock.
-- Returns false when the day already has its partition (idempotent).
CREATE FUNCTION job_executions_add_partition(day date) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    name text := 'job_executions_p' || to_char(day, 'YYYYMMDD');
    low timestamptz := day::timestamp AT TIME ZONE 'UTC';
    high timestamptz := (day + 1)::timestamp AT TIME ZONE 'UTC';
    columns text;
BEGIN
    IF to_regclass(name) IS NOT NULL THEN
        RETURN false;
    END IF;
    EXECUTE format('CREATE TABLE %I (LIKE job_executions INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                   'INCLUDING GENERATED INCLUDING STORAGE) WITH (fillfactor = 40)', name);
    EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I CHECK (scheduled_for >= %L AND scheduled_for < %L)',
                   name, name || '_range', low, high);
    IF to_regclass('job_executions_default') IS NOT NULL THEN
        SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) INTO columns
        FROM pg_attribute
        WHERE attrelid = 'job_executions'::regclass AND attnum > 0 AND NOT attisdropped AND attgenerated = '';
        EXECUTE format('WITH moved AS (DELETE FROM job_executions_default WHERE scheduled_for >= $1 '
                       'AND scheduled_for < $2 RETURNING %s) INSERT INTO %I (%s) SELECT * FROM moved',
                       columns, name, columns) USING low, high;
    END IF;
    EXECUTE format('ALTER TABLE job_executions ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', name, low, high);
    -- Implied by the partition bound now; a redundant CHECK would only cost every write.
    EXECUTE format('ALTER TABLE %I DROP CONSTRAINT %I', name, name || '_range');
    PERFORM job_executions_name_indexes(name::regclass);
    RETURN true;
END
$$;

SELECT job_executions_add_partition(day)
FROM (
    SELECT DISTINCT (scheduled_for AT TIME ZONE 'UTC')::date AS day FROM job_executions_unpartitioned
    UNION
    SELECT (now() AT TIME ZONE 'UTC')::date + ahead FROM generate_series(0, 2) AS ahead
) AS days ORDER BY day;
CREATE TABLE job_executions_default PARTITION OF job_executions DEFAULT WITH (fillfactor = 40);

-- Every row, in one statement (routed to its day; every column but the generated final_status). The indexes, the foreign key and the triggers
-- come after: one build per index and partition instead of an entry per row.
INSERT INTO job_executions (
    id, job_id, run_id, scheduled_for, attempt, status, trigger, due_at, priority, term, request_id, worker_id,
    claim_token, created_at, started_at, finished_at, error, result, handler, payload, queue, timeout, max_retries,
    initial_backoff, max_backoff, retry_jitter, cancel_requested_at, dlq_purged_at, missed_through, missed_count,
    limit_keys, trace_context)
SELECT id, job_id, run_id, scheduled_for, attempt, status, trigger, due_at, priority, term, request_id, worker_id,
       claim_token, created_at, started_at, finished_at, error, result, handler, payload, queue, timeout, max_retries,
       initial_backoff, max_backoff, retry_jitter, cancel_requested_at, dlq_purged_at, missed_through, missed_count,
       limit_keys, trace_context
FROM job_executions_unpartitioned;

ALTER TABLE job_executions ADD PRIMARY KEY (id, scheduled_for);
ALTER TABLE job_executions ADD CONSTRAINT job_executions_job_id_scheduled_for_attempt_key
    UNIQUE (job_id, scheduled_for, attempt);
ALTER TABLE job_executions ADD CONSTRAINT job_executions_job_id_fkey
    FOREIGN KEY (job_id) REFERENCES jobs (id) ON DELETE CASCADE;
-- The indexes of migrations 0001, 0008 and 0009, on every partition (a partitioned index).
CREATE INDEX job_executions_created_idx ON job_executions (created_at DESC, id DESC);
CREATE INDEX job_executions_run_idx ON job_executions (run_id, attempt DESC);
CREATE INDEX job_executions_finished_idx ON job_executions (finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX job_executions_handler_created_idx ON job_executions (handler, created_at DESC, id DESC);
CREATE INDEX job_executions_open_idx ON job_executions (job_id, due_at) WHERE finished_at IS NULL;
CREATE INDEX job_executions_open_created_idx ON job_executions (created_at DESC, id DESC) WHERE finished_at IS NULL;
CREATE INDEX job_executions_cancel_idx ON job_executions (id)
    WHERE cancel_requested_at IS NOT NULL AND finished_at IS NULL;
CREATE INDEX job_executions_dead_letters_idx ON job_executions (run_id)
    WHERE final_status = 'dead' AND dlq_purged_at IS NULL;
CREATE INDEX job_executions_missed_ranges_idx ON job_executions (job_id, scheduled_for)
    WHERE final_status = 'missed';
CREATE INDEX job_executions_final_status_created_idx ON job_executions (final_status, created_at DESC, id DESC)
    WHERE final_status IS NOT NULL;

SELECT job_executions_name_indexes(inhrelid) FROM pg_inherits WHERE inhparent = 'job_executions'::regclass;

-- Idempotent TriggerJob: which run a (job, request id) made. Unpartitioned, so its primary key is
-- the uniqueness across every day. `run_id`, `scheduled_for` locate the run's first attempt (the
-- primary key of job_executions). Retention deletes the rows of the days it drops.
CREATE TABLE execution_requests (
    job_id        uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    request_id    text NOT NULL,
    run_id        uuid NOT NULL,
    scheduled_for timestamptz NOT NULL,
    PRIMARY KEY (job_id, request_id)
);
CREATE INDEX execution_requests_slot_idx ON execution_requests (scheduled_for);
INSERT INTO execution_requests (job_id, request_id, run_id, scheduled_for)
SELECT job_id, request_id, run_id, scheduled_for FROM job_executions_unpartitioned WHERE request_id IS NOT NULL;

-- A row with a request id is inserted only if it claims the request id first (the primary key
-- above decides between concurrent inserts: the second waits for the first to end). If the request
-- id is held by a run that exists, the row is skipped (NULL: the INSERT goes on with its other rows,
-- as ON CONFLICT DO NOTHING would). A claim whose run does not exist (its INSERT skipped the row on
-- a slot collision, or its day was dropped) is taken over by compare-and-set on its run id. Each
-- query here takes a fresh snapshot (READ COMMITTED, a VOLATILE function), so the run of a claim
-- committed after the statement began is seen; no row lock is taken unless a claim is taken over
-- (statements claiming the same ids in different orders must not deadlock). Only rows with a
-- request id call it (the trigger's WHEN).
CREATE FUNCTION execution_requests_claim() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    prior record;
BEGIN
    LOOP
        INSERT INTO execution_requests (job_id, request_id, run_id, scheduled_for)
        VALUES (NEW.job_id, NEW.request_id, NEW.run_id, NEW.scheduled_for)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN NEW;
        END IF;
        SELECT r.run_id, r.scheduled_for INTO prior FROM execution_requests r
        WHERE r.job_id = NEW.job_id AND r.request_id = NEW.request_id;
        IF FOUND THEN
            IF EXISTS (SELECT 1 FROM job_executions e
                       WHERE e.id = prior.run_id AND e.scheduled_for = prior.scheduled_for) THEN
                RETURN NULL;
            END IF;
            UPDATE execution_requests SET run_id = NEW.run_id, scheduled_for = NEW.scheduled_for
            WHERE job_id = NEW.job_id AND request_id = NEW.request_id AND run_id = prior.run_id;
            IF FOUND THEN
                RETURN NEW;
            END IF;
        END IF;
        -- taken over or deleted meanwhile: look again
    END LOOP;
END
$$;
CREATE TRIGGER execution_requests_claim BEFORE INSERT ON job_executions
    FOR EACH ROW WHEN (NEW.request_id IS NOT NULL) EXECUTE FUNCTION execution_requests_claim();

-- Starting a flow run (migration 0007), on the new table.
CREATE TRIGGER flows_start AFTER INSERT ON job_executions
    REFERENCING NEW TABLE AS inserted_runs FOR EACH STATEMENT EXECUTE FUNCTION flows_start_runs();

DROP TABLE job_executions_unpartitioned;
ANALYZE job_executions;
