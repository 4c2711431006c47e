-- Sharded queues (issue 24): each queue's shard count over time. A change applies to the runs made
-- from `effective_at` on (`sharding.py`): made with a lead time, so every role has read it first.
-- A queue without rows has one shard. Rows are never updated; consumers serve up to the highest
-- count a queue ever had.
CREATE TABLE queue_shards (
    queue        text        NOT NULL CHECK (queue ~ '^[A-Za-z0-9_.-]+$' AND char_length(queue) <= 64),
    effective_at timestamptz NOT NULL,
    shards       integer     NOT NULL CHECK (shards BETWEEN 1 AND 64),
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, effective_at)
);
