-- Limits (issue 22): named flow-control definitions, the limit refs of jobs, and the limit keys a
-- run took. The rules repeat scheduler_grpc/limits.py (SQL cannot import it).

-- Whether `overrides` is a limit's per-key overrides: an object of at most 1,000 keys (each
-- 1-200 characters), each mapped to {"limit": 1..1000000, "burst": 0..1000000}, the burst 0 (or
-- absent) for a concurrency limit. A function because a CHECK cannot hold a subquery.
CREATE FUNCTION limit_overrides_valid(overrides jsonb, kind text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_typeof(overrides) = 'object'
       AND (SELECT count(*) FROM jsonb_object_keys(overrides)) <= 1000
       AND NOT EXISTS (
           SELECT 1 FROM jsonb_each(overrides) AS o (key, value)
           -- CASE: SQL does not promise to evaluate OR left to right, and a cast of a non-number
           -- would raise instead of failing the check.
           WHERE CASE
               WHEN char_length(o.key) NOT BETWEEN 1 AND 200 THEN true
               WHEN jsonb_typeof(o.value) IS DISTINCT FROM 'object' THEN true
               WHEN jsonb_typeof(o.value -> 'limit') IS DISTINCT FROM 'number' THEN true
               WHEN jsonb_typeof(coalesce(o.value -> 'burst', '0')) IS DISTINCT FROM 'number' THEN true
               ELSE (o.value ->> 'limit')::numeric NOT BETWEEN 1 AND 1000000
                   OR (o.value ->> 'limit')::numeric <> trunc((o.value ->> 'limit')::numeric)
                   OR coalesce((o.value ->> 'burst')::numeric, 0) NOT BETWEEN 0 AND 1000000
                   OR coalesce((o.value ->> 'burst')::numeric, 0) <> trunc(coalesce((o.value ->> 'burst')::numeric, 0))
                   OR (kind = 'concurrency' AND coalesce((o.value ->> 'burst')::numeric, 0) <> 0)
           END
       )
$$;

CREATE TABLE limits (
    id          uuid PRIMARY KEY DEFAULT uuid_v7(),  -- time-ordered (migration 0009)
    -- Jobs refer to a limit by name (in jobs.limits), so the name never changes.
    name        text NOT NULL UNIQUE CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}$'),
    kind        text NOT NULL CHECK (kind IN ('concurrency', 'rate')),
    "limit"     integer NOT NULL CHECK ("limit" BETWEEN 1 AND 1000000),
    period      interval CHECK (period >= interval '1 millisecond' AND period <= interval '24 hours'),
    burst       integer NOT NULL DEFAULT 0 CHECK (burst BETWEEN 0 AND 1000000),
    overrides   jsonb NOT NULL DEFAULT '{}'::jsonb CHECK (limit_overrides_valid(overrides, kind)),
    version     bigint NOT NULL DEFAULT 1 CHECK (version >= 1),
    request_id  text UNIQUE CHECK (char_length(request_id) BETWEEN 1 AND 128),
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    -- A rate limit has a period; a concurrency limit has neither a period nor a burst.
    CHECK ((kind = 'rate') = (period IS NOT NULL)),
    CHECK (kind = 'rate' OR burst = 0)
);

-- A job's limit refs, in order: [{"limit": <name>, "key": <template>, "units": >= 1}], at most 4.
ALTER TABLE jobs ADD COLUMN limits jsonb NOT NULL DEFAULT '[]'::jsonb
    CHECK (jsonb_typeof(limits) = 'array' AND jsonb_array_length(limits) <= 4);
-- Which jobs use a limit (DeleteLimit refuses while any does): containment on the refs.
CREATE INDEX jobs_limits_idx ON jobs USING gin (limits jsonb_path_ops) WHERE limits <> '[]'::jsonb;

-- The limit keys a run took, resolved once when it was fired or triggered: [[limit, key, units]],
-- NULL when its job has no limits. NOT VALID: every existing row is NULL, so PostgreSQL need not
-- scan the table to check them; new and changed rows are checked.
ALTER TABLE job_executions ADD COLUMN limit_keys jsonb;
ALTER TABLE job_executions ADD CONSTRAINT job_executions_limit_keys_check
    CHECK (limit_keys IS NULL OR (jsonb_typeof(limit_keys) = 'array'
                                  AND jsonb_array_length(limit_keys) BETWEEN 1 AND 4)) NOT VALID;
