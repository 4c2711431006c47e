-- Initial schema: jobs, one execution row per attempt, leader terms, users and API keys.
-- CHECK constraints make invalid states unstorable; the application validates first to give
-- a friendly error, these are the last line of defence.

CREATE TABLE jobs (
    id                 uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name               text NOT NULL UNIQUE
                       CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}$'),
    handler            text NOT NULL CHECK (handler ~ '^[a-z][a-z0-9_.-]{0,99}$'),
    payload            jsonb NOT NULL DEFAULT '{}'::jsonb
                       CHECK (jsonb_typeof(payload) = 'object' AND octet_length(payload::text) <= 65536),
    queue              text NOT NULL DEFAULT 'default' CHECK (queue ~ '^[A-Za-z0-9_.-]{1,64}$'),
    schedule_kind      text NOT NULL CHECK (schedule_kind IN ('cron', 'once', 'manual')),
    cron               text CHECK (char_length(cron) <= 200),
    time_zone          text NOT NULL DEFAULT 'UTC' CHECK (char_length(time_zone) BETWEEN 1 AND 64),
    run_at             timestamptz,
    dst_gap_policy     text NOT NULL DEFAULT 'shift' CHECK (dst_gap_policy IN ('shift', 'skip')),
    dst_fold_policy    text NOT NULL DEFAULT 'first' CHECK (dst_fold_policy IN ('first', 'both')),
    next_run_time      timestamptz,
    priority           integer NOT NULL DEFAULT 0 CHECK (priority BETWEEN -1000 AND 1000),
    max_retries        integer NOT NULL DEFAULT 3 CHECK (max_retries BETWEEN 0 AND 100),
    initial_backoff    interval NOT NULL DEFAULT '1 second' CHECK (initial_backoff > interval '0'),
    max_backoff        interval NOT NULL DEFAULT '5 minutes',
    retry_jitter       boolean NOT NULL DEFAULT true,
    timeout            interval NOT NULL DEFAULT '5 minutes'
                       CHECK (timeout > interval '0' AND timeout <= interval '24 hours'),
    misfire_policy     text NOT NULL DEFAULT 'run_once' CHECK (misfire_policy IN ('run_once', 'skip', 'run_all')),
    concurrency_policy text NOT NULL DEFAULT 'allow' CHECK (concurrency_policy IN ('allow', 'forbid', 'replace')),
    status             text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'paused')),
    version            bigint NOT NULL DEFAULT 1 CHECK (version >= 1),
    request_id         text UNIQUE CHECK (char_length(request_id) BETWEEN 1 AND 128),
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    CHECK ((schedule_kind = 'cron') = (cron IS NOT NULL)),
    CHECK ((schedule_kind = 'once') = (run_at IS NOT NULL)),
    CHECK (max_backoff >= initial_backoff),
    -- A manual job is never due; the others are due until their schedule is exhausted.
    CHECK (schedule_kind <> 'manual' OR next_run_time IS NULL)
);

-- The due-scan reads only active jobs that have a next run, oldest first: its cost follows the
-- number of due jobs, not the size of the table.
CREATE INDEX jobs_due_idx ON jobs (next_run_time) WHERE status = 'active' AND next_run_time IS NOT NULL;

CREATE TABLE job_executions (
    id            uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    job_id        uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    -- The queue item of this run: the id of its first attempt. Retries and recoveries of a slot
    -- are new rows (history is never rewritten) but travel through Redis as the same item.
    run_id        uuid NOT NULL,
    -- The slot this row belongs to (schedule time; trigger time for manual runs).
    scheduled_for timestamptz NOT NULL,
    attempt       integer NOT NULL DEFAULT 1 CHECK (attempt BETWEEN 1 AND 101),
    status        text NOT NULL CHECK (status IN (
                      'queued', 'running', 'succeeded', 'failed', 'timed_out', 'cancelled',
                      'dead', 'abandoned', 'skipped', 'missed')),
    trigger       text NOT NULL CHECK (trigger IN ('schedule', 'manual', 'retry', 'backfill', 'dlq_requeue')),
    -- Not to be started before this instant (retry backoff, future one-shots).
    due_at        timestamptz NOT NULL DEFAULT now(),
    priority      integer NOT NULL DEFAULT 0 CHECK (priority BETWEEN -1000 AND 1000),
    -- The leader term that created the row (NULL when created through the API).
    term          bigint,
    request_id    text CHECK (char_length(request_id) BETWEEN 1 AND 128),
    worker_id     text CHECK (char_length(worker_id) <= 200),
    -- Set when a worker claims the row; completion must present it (a lost lease cannot overwrite).
    claim_token   text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    started_at    timestamptz,
    finished_at   timestamptz,
    error         text CHECK (char_length(error) <= 8192),
    result        jsonb CHECK (octet_length(result::text) <= 65536),
    UNIQUE (job_id, scheduled_for, attempt),
    UNIQUE (job_id, request_id),
    CHECK (status NOT IN ('running', 'succeeded', 'failed', 'timed_out', 'abandoned')
           OR (started_at IS NOT NULL AND worker_id IS NOT NULL)),
    CHECK (status IN ('queued', 'running') OR finished_at IS NOT NULL),
    CHECK (status <> 'running' OR claim_token IS NOT NULL),
    CHECK (finished_at IS NULL OR started_at IS NULL OR finished_at >= started_at),
    CHECK (trigger <> 'retry' OR attempt > 1),
    CHECK (attempt > 1 OR run_id = id)
);

-- Listing by time (ExecutionService.ListExecutions without a job filter).
CREATE INDEX job_executions_created_idx ON job_executions (created_at DESC, id DESC);
-- Listing by job is served by the UNIQUE (job_id, scheduled_for, attempt) index.
-- Reconcile and the concurrency policy look only at unfinished rows.
CREATE INDEX job_executions_open_idx ON job_executions (job_id, due_at)
    WHERE status IN ('queued', 'running');
-- A claim resolves a queue item to the latest attempt of its run.
CREATE INDEX job_executions_run_idx ON job_executions (run_id, attempt DESC);

-- Leader terms come from a PostgreSQL sequence, so fencing tokens stay monotonic when Redis
-- restarts empty or is flushed. `leader_state.term` is the current term; every leader write
-- checks it inside its own transaction, so a deposed (paused, partitioned) leader's writes fail.
CREATE SEQUENCE leader_term_seq AS bigint;

CREATE TABLE leader_state (
    scope       text PRIMARY KEY,
    term        bigint NOT NULL CHECK (term >= 1),
    holder      text NOT NULL,
    acquired_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE users (
    id            uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    username      text NOT NULL UNIQUE CHECK (username ~ '^[A-Za-z0-9_.@-]{1,64}$'),
    password_hash text NOT NULL CHECK (password_hash LIKE '$argon2id$%'),
    role          text NOT NULL CHECK (role IN ('viewer', 'operator', 'admin')),
    disabled      boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_keys (
    id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name         text NOT NULL CHECK (char_length(name) BETWEEN 1 AND 100),
    -- SHA-256 of the random key; the key itself is shown once and never stored.
    key_hash     bytea NOT NULL UNIQUE CHECK (octet_length(key_hash) = 32),
    key_prefix   text NOT NULL CHECK (char_length(key_prefix) BETWEEN 4 AND 16),
    role         text NOT NULL CHECK (role IN ('viewer', 'operator', 'admin')),
    created_by   uuid REFERENCES users (id) ON DELETE SET NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz,
    revoked_at   timestamptz,
    last_used_at timestamptz
);
