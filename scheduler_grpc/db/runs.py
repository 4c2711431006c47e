"""The worker's store of runs in PostgreSQL: claim, complete, hand back, give up, cancel checks.

The hot path: the claim and the completion of a batch are each one statement over arrays
(`unnest`), a short one for the usual batch (a claim whose batch holds other cases takes two).
What the worker relies on (`scheduler_grpc.ports.RunStore`): each write applies only under the
attempt's claim token while it is still `running`, so a repeated claim or completion (a resend
after a lost reply) changes nothing twice.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import orjson

from scheduler_grpc import outputs
from scheduler_grpc.db import faults
from scheduler_grpc.db.attempts import latest_attempt
from scheduler_grpc.db.executions import (
    CANCELLED_ERROR,
    INTERRUPTED_ERROR,
    LOST_WORKER_ERROR,
    REFUSED_ERROR,
    SNAPSHOT_COLUMNS,
    STATUSES,
    TRIGGERS,
    Claim,
    Completed,
    Outcome,
    Queryable,
    ids,
    limit_keys_from_json,
    snapshot,
    snapshot_of_run,
)
from scheduler_grpc.executions import DeadReason, ExecutionStatus
from scheduler_grpc.jobs import RetryPolicy


def _encoded(outcome: Outcome) -> tuple[Outcome, str | None]:
    """An outcome with its result as JSON text; one whose result orjson cannot encode is refused."""
    if outcome.result is None:
        return outcome, None
    try:
        return outcome, orjson.dumps(outcome.result).decode()
    except orjson.JSONEncodeError as exc:
        return _refused(outcome, str(exc)), None


def _refused(outcome: Outcome, reason: str) -> Outcome:
    """The outcome recorded in place of one whose values the store refused: `dead` (the values
    would be refused again on any retry), without its result."""
    return Outcome(outcome.execution_id, outcome.claim_token, ExecutionStatus.DEAD,
                   error=f"{REFUSED_ERROR}: {reason}", started_at=outcome.started_at,
                   dead_reason=DeadReason.PERMANENT, scheduled_for=outcome.scheduled_for)  # fmt: skip


def slot_of(given: str, key: str) -> str:
    """SQL: the slot of a run or attempt as given (`given`, an expression), or where it is NULL (an
    item queued before slots travelled with it) read by the id `key` alone: the partition key
    without which a statement reads every partition's index. A run's id is its first attempt's,
    and every attempt of a run shares its slot, so `key` may be a run id or an execution id."""
    return f"coalesce({given}, (SELECT f.scheduled_for FROM job_executions f WHERE f.id = {key}))"


def _slots(values: Sequence[datetime | None], n: int) -> list[datetime | None]:
    """One slot per item (None: unknown); empty: all unknown."""
    return list(values) if values else [None] * n


# `RunRepository.claim`'s first statement: the items whose run is still at its first attempt and
# `queued` (a run's first attempt has the run's id: one primary-key probe per item, whatever the
# statistics say of the day's partition), claimed as the whole statement claims them (the same
# start, the same columns; a first attempt has no interrupted one before it). No row lock first:
# the UPDATE waits for a concurrent writer of the row and then checks `queued` again, so a run
# another claim or an abandon took meanwhile is left to the whole statement, as is a retry.
_CLAIM_QUEUED = f"""
    WITH i AS MATERIALIZED (
        -- `queued` is a column, not a constant, as `running` in the whole completion: with the
        -- constant the planner may scan a day's partition for its queued rows (by statistics often
        -- taken before the day's runs were queued) instead of probing the primary key per item.
        SELECT i.*, 'queued'::text AS queued
        FROM unnest($1::text[]::uuid[], $2::text[], $4::bool[], $5::timestamptz[], $6::timestamptz[])
            AS i(run_id, token, reserve, leased_at, slot)
    ), c AS (
        UPDATE job_executions e SET status = 'running', claim_token = i.token, worker_id = $3,
               started_at = CASE WHEN i.reserve THEN greatest(clock_timestamp(), e.due_at)
                                 ELSE least(now(), greatest(coalesce(i.leased_at, now()),
                                                            date_trunc('milliseconds', e.due_at))) END
        FROM i WHERE e.id = i.run_id AND e.scheduled_for = i.slot AND e.status = i.queued
        RETURNING e.id, e.run_id, e.job_id, e.scheduled_for, e.attempt, e.started_at, e.due_at, e.trigger,
                  e.trace_context, e.limit_keys, {snapshot("e")}
    )
    SELECT c.id::text, c.run_id::text, c.job_id::text, c.scheduled_for, c.attempt, c.started_at, c.due_at,
           c.trigger, j.name, c.trace_context, c.limit_keys, {snapshot_of_run("c")},
           0::bigint AS interrupted, 0::bigint AS abandoned,
           CASE WHEN cardinality($4::bool[]) > 0 THEN clock_timestamp() END AS clock
    FROM c JOIN jobs j ON j.id = c.job_id
"""


# `RunRepository.complete`'s statement for a batch sent for the first time in which no outcome
# retries and every slot is known (most batches): the update of the whole statement alone. Its
# plan is a fraction of the whole statement's, which PostgreSQL may plan again at every execution
# (a custom plan: ~3 ms for a batch of 5 on 2 cores, against ~20 us per outcome of the update).
_COMPLETE_ONLY = """
    WITH r AS MATERIALIZED (
        -- `running` is a column, not a constant (see the whole statement).
        SELECT r.*, 'running'::text AS running
        FROM unnest($1::text[]::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::timestamptz[],
                    $7::timestamptz[])
            AS r(id, token, status, error, result, started_at, slot)
    )
    UPDATE job_executions e SET status = r.status, finished_at = now(), error = r.error,
           result = r.result::jsonb, started_at = coalesce(r.started_at, e.started_at)
    FROM r WHERE e.id = r.id AND e.scheduled_for = r.slot AND e.claim_token = r.token AND e.status = r.running
    RETURNING e.id::text, e.run_id::text, e.job_id::text, e.attempt, e.status
"""


def _claim_args(
    items: Sequence[tuple[str, str]],
    worker_id: str,
    reserved: list[bool],
    leased_at: list[datetime | None],
    slots: list[datetime | None],
) -> tuple[Any, ...]:
    """`_CLAIM_QUEUED`'s arguments: as the whole statement takes them, an empty list meaning none
    (unnest pads it with NULLs: `reserve` NULL is false, `slot` NULL claims nothing here)."""
    return ([run_id for run_id, _ in items], [token for _, token in items], worker_id, reserved, leased_at, slots)


def _claim_of(row: asyncpg.Record) -> Claim:
    """The claim a row of the claim statements (or of `resumable`) describes."""
    return Claim(
        run_id=row["run_id"],
        execution_id=row["id"],
        job_id=row["job_id"],
        job_name=row["name"],
        attempt=row["attempt"],
        scheduled_for=row["scheduled_for"],
        started_at=row["started_at"],
        handler=row["handler"],
        payload=row["payload"],
        timeout=row["timeout"],
        retry=RetryPolicy(row["max_retries"], row["initial_backoff"], row["max_backoff"], row["retry_jitter"]),
        queue=row["queue"],
        due_at=row["due_at"],
        clock=row["clock"],
        interrupted=row["interrupted"],
        trigger=TRIGGERS[row["trigger"]],
        trace_context=row["trace_context"],
        limits=limit_keys_from_json(row["limit_keys"]),
    )


class RunRepository:
    """Claims, completions and hand-backs of attempts in `job_executions` (`ports.RunStore`).

    Over a pool (each call on a connection of its own) or over the one connection of a transaction.
    """

    def __init__(self, pool: Queryable) -> None:
        self._pool = pool

    async def upstream_results(self, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """For runs a flow run created: each upstream node's result by job name (None where its run
        has none, e.g. it failed), by run id; runs outside any flow run are absent. One statement
        for a claimed batch: the worker asks only for runs no schedule, trigger or backfill made."""
        if not run_ids:
            return {}
        rows = await self._pool.fetch(
            f"""SELECT me.run_id, j.name, x.result
               FROM flow_nodes me JOIN flow_nodes u ON u.flow_run_id = me.flow_run_id
                                                   AND u.job_id = ANY(me.upstream_ids)
               JOIN jobs j ON j.id = u.job_id
               LEFT JOIN LATERAL {latest_attempt("u.run_id", "a.result", slot="u.run_scheduled_for")} x ON true
               WHERE me.run_id = ANY($1::uuid[])""",
            ids(run_ids),
        )
        found: dict[str, dict[str, Any]] = {}
        for row in rows:
            found.setdefault(str(row["run_id"]), {})[row["name"]] = row["result"]
        return found

    async def claim(
        self,
        items: Sequence[tuple[str, str]],
        worker_id: str,
        *,
        reserved: Sequence[bool] = (),
        leased_at: Sequence[datetime | None] = (),
        slots: Sequence[datetime | None] = (),
    ) -> list[Claim]:
        """Claim the current attempt of each run `(run_id, lease_token)` for `worker_id`.

        `slots` gives each run's `scheduled_for` (from its queue item, `dispatch.item_slot`; one per
        item, None or empty: unknown): the claim then reads and writes one partition per run. An
        unknown slot is read by the run id first (every partition's index: correct, slower).

        `reserved` flags items a worker reserved ahead of their due time (one flag per item; empty:
        none): their attempt's `started_at` is the expected start, the later of the database clock
        and the attempt's `due_at`, and the worker starts it when `Claim.clock` reaches that (the
        completion then writes the real start, `Outcome.started_at`).

        Any other item starts when the queue leased it: `leased_at` gives each item's lease instant
        (`Lease.leased_at`: Redis clock, whole milliseconds, the instant its limits admitted it; one
        per item, None or empty: unknown), and the attempt's `started_at` is that instant, kept
        between the attempt's `due_at` (to the millisecond) and this statement's `now()`, so
        whatever the offset between the two clocks it never precedes its due time (by a whole
        millisecond) nor follows its claim (with one clock the bounds do not bind: a lease follows
        its item's due time and precedes its claim). Without a lease instant it starts `now()`.
        So a rate limit's admissions and the recorded starts are the same instants, however long
        the claim took after the lease.

        The lease token becomes the attempt's claim token; only it can complete the attempt. Per run,
        the latest attempt decides:

        * `queued` -> it becomes `running` under this token;
        * `running` under another token (its worker lost the lease) or `abandoned` -> that attempt
          is recorded `abandoned` and a new attempt starts `running` under this token (when the old
          holder or the leader queued that next attempt while this claim waited for the row, that
          queued attempt starts `running` under this token);
        * `running` under this token -> returned again (a repeated claim is harmless);
        * finished, or no row (job deleted) -> nothing: the caller acks the item away;
        * `running` under another token with a cancel requested -> recorded `cancelled`, nothing
          restarts: the cancel request outlives the worker that was to honour it.

        What to run comes from the run's own snapshot of its job (see migration 0002), not from the
        job as it is now.

        Two statements at most: the first claims the items whose run's first attempt is still
        `queued` and whose slot is given (as a rule, every item but retries), and the whole
        statement above runs only for the items it did not claim (for all of them without
        `slots`). The first is the one most claims need, at a fraction of the other's cost per
        statement (one access to the table instead of six, each planned and started over every
        partition).
        """
        if not items:
            return []
        reserved, leased_at, slots = list(reserved), list(leased_at), list(slots)
        rows: list[asyncpg.Record] = []
        if slots:  # without slots the first statement could claim nothing
            rows += await self._pool.fetch(_CLAIM_QUEUED, *_claim_args(items, worker_id, reserved, leased_at, slots))
        if len(rows) < len(items):
            claimed = {row["run_id"] for row in rows}  # as PostgreSQL writes a uuid: lower case
            rest = [i for i, (run_id, _) in enumerate(items) if run_id.lower() not in claimed]
            if rest:  # (none when the batch named a claimed run twice)
                rows += await self._claim_any(
                    [items[i] for i in rest],
                    worker_id,
                    [reserved[i] for i in rest] if reserved else [],
                    [leased_at[i] for i in rest] if leased_at else [],
                    [slots[i] for i in rest] if slots else [],
                )
        return [_claim_of(row) for row in rows]

    async def _claim_any(
        self,
        items: Sequence[tuple[str, str]],
        worker_id: str,
        reserved: list[bool],
        leased_at: list[datetime | None],
        slots: list[datetime | None],
    ) -> list[asyncpg.Record]:
        """The whole claim (every case of `claim`'s list) of `items`."""
        return await self._pool.fetch(
            f"""
            WITH given AS (
                -- Ids travel as text both ways: cheaper for the client than uuid objects.
                -- `reserve` is NULL (not reserved) for every item when $6 is empty, `leased_at` NULL
                -- (unknown: the start is now()) when $7 is, `slot` NULL (unknown) when $8 is.
                SELECT * FROM unnest($1::text[]::uuid[], $2::text[], $6::bool[], $7::timestamptz[],
                                     $8::timestamptz[])
                    AS i(run_id, token, reserve, leased_at, slot)
            ), items AS MATERIALIZED (
                -- Materialized: each item's slot is a plain value for the lookup below to prune by.
                SELECT i.run_id, i.token, i.reserve, i.leased_at, {slot_of("i.slot", "i.run_id")} AS slot
                FROM given i
            ), latest AS (
                SELECT x.id, x.run_id, x.job_id, x.scheduled_for, x.attempt, x.status, x.claim_token,
                       x.priority, x.started_at, x.due_at, x.trigger, x.cancel_requested_at, i.token, i.reserve,
                       x.trace_context, x.limit_keys, {snapshot("x")},
                       -- A ready item's start: its lease, within [its due time, this claim].
                       least(now(), greatest(coalesce(i.leased_at, now()), date_trunc('milliseconds', x.due_at)))
                           AS leased_start
                FROM items i CROSS JOIN LATERAL {latest_attempt("i.run_id", lock=True, slot="i.slot")} x
            ), started AS (
                UPDATE job_executions e SET status = 'running', claim_token = l.token, worker_id = $3,
                       started_at = CASE WHEN l.reserve THEN greatest(clock_timestamp(), l.due_at)
                                         ELSE l.leased_start END
                -- With the slot (the partition key): one partition's primary key, not every one's.
                FROM latest l WHERE e.id = l.id AND e.scheduled_for = l.scheduled_for AND l.status = 'queued'
                RETURNING e.id, e.run_id, e.job_id, e.scheduled_for, e.attempt, e.started_at, e.due_at, e.trigger,
                          e.trace_context, e.limit_keys, {snapshot("e")}
            ), abandoned AS (
                UPDATE job_executions e
                SET status = CASE WHEN l.cancel_requested_at IS NULL THEN 'abandoned' ELSE 'cancelled' END,
                    finished_at = now(), error = CASE WHEN l.cancel_requested_at IS NULL THEN $4 ELSE $5 END,
                    started_at = least(l.started_at, now())  -- a reserved attempt taken over before its start
                FROM latest l WHERE e.id = l.id AND e.scheduled_for = l.scheduled_for
                                AND l.status = 'running' AND l.claim_token <> l.token
                RETURNING e.id
            ), restarted AS (
                INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, priority,
                                            claim_token, worker_id, started_at, trace_context, limit_keys,
                                            {SNAPSHOT_COLUMNS})
                SELECT uuid_v7(), l.run_id, l.job_id, l.scheduled_for, l.attempt + 1, 'running', 'retry',
                       l.priority, l.token, $3,
                       CASE WHEN l.reserve THEN greatest(clock_timestamp(), l.due_at) ELSE l.leased_start END,
                       l.trace_context, l.limit_keys, {snapshot("l")}
                FROM latest l
                WHERE l.status = 'abandoned'
                   OR (l.status = 'running' AND l.claim_token <> l.token AND l.cancel_requested_at IS NULL)
                -- The old holder (or the leader, for an expired lease) may have ended the attempt and
                -- queued the next one while we waited for its row lock (release, abandon): that
                -- attempt is not in our snapshot. We hold the item's current lease, so that queued
                -- attempt is ours to run: claimed as it is (its snapshot and due time), started no
                -- earlier than its due time. One in any other state is left alone (nothing claimed:
                -- the caller acks the item, as for a finished run).
                ON CONFLICT (job_id, scheduled_for, attempt) DO UPDATE
                    SET status = 'running', claim_token = EXCLUDED.claim_token, worker_id = EXCLUDED.worker_id,
                        started_at = greatest(EXCLUDED.started_at, job_executions.due_at)
                    WHERE job_executions.status = 'queued'
                RETURNING id, run_id, job_id, scheduled_for, attempt, started_at, due_at, trigger, trace_context,
                          limit_keys, {SNAPSHOT_COLUMNS}
            ), claimed AS (
                SELECT * FROM started
                UNION ALL SELECT * FROM restarted
                UNION ALL SELECT l.id, l.run_id, l.job_id, l.scheduled_for, l.attempt, l.started_at, l.due_at,
                                 l.trigger, l.trace_context, l.limit_keys, {snapshot("l")}
                          FROM latest l WHERE l.status = 'running' AND l.claim_token = l.token
            )
            SELECT c.id::text, c.run_id::text, c.job_id::text, c.scheduled_for, c.attempt, c.started_at, c.due_at,
                   c.trigger, j.name, c.trace_context, c.limit_keys,
                   {snapshot_of_run("c")},
                   CASE WHEN c.attempt = 1 THEN 0  -- a first attempt has no earlier ones: no probe
                        ELSE (SELECT count(*) FROM job_executions p
                              WHERE p.run_id = c.run_id AND p.scheduled_for = c.scheduled_for
                                AND p.status = 'interrupted') END AS interrupted,
                   (SELECT count(*) FROM abandoned) AS abandoned,
                   -- Read last, after the writes: a reserved attempt's wait counted from it errs late
                   -- (by the reply's transfer), never early. Only for a batch with reservations.
                   CASE WHEN cardinality($6::bool[]) > 0 THEN clock_timestamp() END AS clock
            FROM claimed c JOIN jobs j ON j.id = c.job_id
            """,
            [run_id for run_id, _ in items],
            [token for _, token in items],
            worker_id,
            LOST_WORKER_ERROR,
            CANCELLED_ERROR,
            reserved,
            leased_at,
            slots,
        )

    async def resumable(self, items: Sequence[tuple[str, str]]) -> list[Claim]:
        """The attempts `(execution_id, claim_token)` still `running` under their token, as their
        claims: what a remote worker's new stream may resume (read only; the queue's lease, kept
        under the same token, decides whether the run is still free to take back).
        """
        if not items:
            return []
        rows = await self._pool.fetch(
            f"""
            SELECT e.id::text, e.run_id::text, e.job_id::text, e.scheduled_for, e.attempt, e.started_at, e.due_at,
                   e.trigger, j.name, e.trace_context, e.limit_keys, {snapshot_of_run("e")},
                   CASE WHEN e.attempt = 1 THEN 0
                        ELSE (SELECT count(*) FROM job_executions p
                              WHERE p.run_id = e.run_id AND p.status = 'interrupted') END AS interrupted,
                   NULL::timestamptz AS clock  -- not a reservation's claim: nothing to wait for
            FROM unnest($1::uuid[], $2::text[]) AS r(id, token)
            JOIN job_executions e ON e.id = r.id AND e.claim_token = r.token AND e.status = 'running'
            JOIN jobs j ON j.id = e.job_id
            """,
            ids([execution_id for execution_id, _ in items]),
            [token for _, token in items],
        )
        return [_claim_of(row) for row in rows]

    async def complete(self, outcomes: Sequence[Outcome], *, resent: bool = True) -> list[Completed]:
        """Record how attempts ended; each only under its claim token and while still `running`.

        An attempt whose worker lost its lease (someone else's claim abandoned it) changes nothing:
        it is simply absent from the result. Outcomes with `retry_after` add the next attempt, `queued`.
        Safe to repeat: an outcome already recorded under the same token is reported again, as long
        as `resent` is true (the default). A caller sending outcomes for the first time may pass
        False to skip looking for earlier recordings (one index probe per outcome).

        A value the store refuses (a result orjson cannot encode, or one PostgreSQL refuses: a CHECK,
        a NUL character) fails only the outcome that carried it: that attempt is recorded `dead`
        with `REFUSED_ERROR` (its result dropped) and reported with that status, and the batch's
        other outcomes are recorded as they are (after such a refusal, one statement each).
        """
        if not outcomes:
            return []
        encoded = [_encoded(outcome) for outcome in outcomes]
        try:
            async with self._savepoint():
                return await self._complete(encoded, resent)
        except asyncpg.PostgresError as exc:
            if not faults.is_request_error(exc):
                raise
            if len(encoded) > 1:
                # Perhaps one outcome's data, not the statement: again one by one, so only it fails.
                return [done for outcome, _ in encoded for done in await self.complete([outcome], resent=resent)]
            outcome, _ = encoded[0]
            if outcome.result is None:
                raise  # refused without a result (or without it already): not the data, a bug
            async with self._savepoint():
                return await self._complete([(_refused(outcome, str(exc)), None)], resent)

    @asynccontextmanager
    async def _savepoint(self) -> AsyncIterator[None]:
        """A statement that may be refused, under a savepoint when this repository works inside a
        transaction (so the transaction survives the refusal); as is over a pool."""
        if isinstance(self._pool, asyncpg.Pool):
            yield
        else:
            async with self._pool.transaction():
                yield

    async def _complete(self, encoded: Sequence[tuple[Outcome, str | None]], resent: bool) -> list[Completed]:
        outcomes = [outcome for outcome, _ in encoded]
        if not resent and all(o.retry_after is None and o.scheduled_for is not None for o in outcomes):
            # Nothing to retry, nothing to look up again, every slot known: the update alone.
            rows = await self._pool.fetch(
                _COMPLETE_ONLY,
                [outcome.execution_id for outcome in outcomes],
                [outcome.claim_token for outcome in outcomes],
                [outcome.status.value for outcome in outcomes],
                [outcome.error for outcome in outcomes],
                [result for _, result in encoded],
                [outcome.started_at for outcome in outcomes],
                [outcome.scheduled_for for outcome in outcomes],
            )
            return [
                Completed(row["id"], row["run_id"], row["job_id"], row["attempt"], STATUSES[row["status"]], None)
                for row in rows
            ]
        rows = await self._pool.fetch(
            f"""
            WITH r AS MATERIALIZED (
                -- `running` is a column, not a constant, so the planner cannot use `status =
                -- 'running'` to scan the table (its statistics often count no running rows, and a
                -- sequential scan of the whole history per batch would follow): each outcome
                -- finds its row by primary key, (id, slot): one partition.
                SELECT r.*, 'running'::text AS running, {slot_of("r.given_slot", "r.id")} AS slot
                FROM unnest($1::text[]::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::interval[],
                            $8::timestamptz[], $9::timestamptz[])
                    AS r(id, token, status, error, result, retry_after, started_at, given_slot)
            ), done AS (
                UPDATE job_executions e SET status = r.status, finished_at = now(), error = r.error,
                       result = r.result::jsonb, started_at = coalesce(r.started_at, e.started_at)
                FROM r WHERE e.id = r.id AND e.scheduled_for = r.slot AND e.claim_token = r.token
                         AND e.status = r.running
                RETURNING e.id, e.run_id, e.job_id, e.scheduled_for, e.attempt, e.priority, e.status, r.retry_after,
                          e.cancel_requested_at
            ), retried AS (
                -- A run whose cancel was requested meanwhile is not retried: the cancel wins. The
                -- snapshot comes from the attempt's row as the statement's snapshot shows it (the
                -- completion does not change it), read only for the few outcomes that retry.
                INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                            priority, trace_context, limit_keys, {SNAPSHOT_COLUMNS})
                SELECT uuid_v7(), d.run_id, d.job_id, d.scheduled_for, d.attempt + 1, 'queued', 'retry',
                       now() + d.retry_after, d.priority, p.trace_context, p.limit_keys, {snapshot("p")}
                FROM done d JOIN job_executions p ON p.id = d.id AND p.scheduled_for = d.scheduled_for
                WHERE d.retry_after IS NOT NULL AND d.cancel_requested_at IS NULL
                ON CONFLICT DO NOTHING
                RETURNING id, run_id
            ), again AS (
                -- The same outcome sent again because the reply of a committed first try was lost
                -- (the worker retries a failed write): report it again instead of "lease lost".
                -- The statement's snapshot shows rows `done` updates as still running: no overlap.
                SELECT e.id, e.run_id, e.job_id, e.attempt, e.status,
                       (SELECT n.id FROM job_executions n
                        WHERE n.run_id = e.run_id AND n.scheduled_for = e.scheduled_for AND n.attempt = e.attempt + 1
                          AND n.trigger = 'retry') AS retry_id
                FROM r JOIN job_executions e ON e.id = r.id AND e.scheduled_for = r.slot AND e.claim_token = r.token
                                            AND e.status = r.status
                WHERE $7
            )
            -- A retry's id comes as a row of its own (no id, the run id and the retry id), joined to
            -- its outcome here: a join in SQL rescans `retried` once per outcome.
            SELECT d.id::text, d.run_id::text, d.job_id::text, d.attempt, d.status, NULL::text AS retry_id FROM done d
            UNION ALL SELECT NULL, run_id::text, NULL, NULL, NULL, id::text FROM retried
            UNION ALL SELECT id::text, run_id::text, job_id::text, attempt, status, retry_id::text FROM again
            """,
            [outcome.execution_id for outcome in outcomes],
            [outcome.claim_token for outcome in outcomes],
            [outcome.status.value for outcome in outcomes],
            [outcome.error for outcome in outcomes],
            [result for _, result in encoded],
            [outcome.retry_after for outcome in outcomes],
            resent,
            [outcome.started_at for outcome in outcomes],
            [outcome.scheduled_for for outcome in outcomes],
        )
        retries = {row["run_id"]: row["retry_id"] for row in rows if row["id"] is None}
        return [
            Completed(
                execution_id=row["id"],
                run_id=row["run_id"],
                job_id=row["job_id"],
                attempt=row["attempt"],
                status=STATUSES[row["status"]],
                retry_execution_id=row["retry_id"] or retries.get(row["run_id"]),
            )
            for row in rows
            if row["id"] is not None
        ]

    async def release(
        self,
        items: Sequence[tuple[str, str]],
        *,
        reason: str = INTERRUPTED_ERROR,
        delay: timedelta = timedelta(0),
        slots: Sequence[datetime | None] = (),
    ) -> int:
        """Hand claimed attempts `(execution_id, claim_token)` back without an outcome of their own.

        Each still `running` under its token is recorded `interrupted` (history is never rewritten:
        its worker, start and end stay on the row) and its run gets the next attempt, `queued`, due
        after `delay`, with the same snapshot. An interruption is not the handler's failure: it
        spends no retry budget (`Claim.budget_attempt`). A run whose cancel was requested is
        recorded `cancelled` instead, with no next attempt.

        Used on graceful shutdown (attempts the grace period did not let finish) and when a
        claimed run's breaker turns out to be open.

        Returns:
            How many attempts were handed back.
        """
        return await end_and_continue(self._pool, items, ExecutionStatus.INTERRUPTED, reason, delay, slots=slots)

    async def unclaim(
        self, items: Sequence[tuple[str, str]], *, slots: Sequence[datetime | None] = ()
    ) -> dict[str, ExecutionStatus]:
        """Undo the claims of reserved attempts `(execution_id, claim_token)` that never started.

        Each still `running` under its token goes back to `queued` as if never claimed (no worker,
        no token, no start): the same attempt, so no attempt and no retry budget is spent, and the
        next claim of its queue item takes it. One whose cancel was requested is recorded
        `cancelled` instead (it never ran, so it has no start either).

        Returns:
            By execution id, the status each attempt now has (`queued` or `cancelled`); attempts
            no longer running under the token (lease lost, finished) are absent.
        """
        if not items:
            return {}
        rows = await self._pool.fetch(
            f"""
            UPDATE job_executions e
            SET status = CASE WHEN e.cancel_requested_at IS NULL THEN 'queued' ELSE 'cancelled' END,
                finished_at = CASE WHEN e.cancel_requested_at IS NULL THEN NULL ELSE now() END,
                error = CASE WHEN e.cancel_requested_at IS NULL THEN NULL ELSE $3 END,
                claim_token = NULL, worker_id = NULL, started_at = NULL
            FROM (SELECT r.id, r.token, {slot_of("r.slot", "r.id")} AS slot
                  FROM unnest($1::uuid[], $2::text[], $4::timestamptz[]) AS r(id, token, slot) OFFSET 0) r
            WHERE e.id = r.id AND e.scheduled_for = r.slot AND e.claim_token = r.token AND e.status = 'running'
            RETURNING e.id::text, e.status
            """,
            ids([execution_id for execution_id, _ in items]),
            [token for _, token in items],
            CANCELLED_ERROR,
            _slots(slots, len(items)),
        )
        return {row["id"]: STATUSES[row["status"]] for row in rows}

    async def cancel_requested(
        self, execution_ids: Sequence[str], *, slots: Sequence[datetime | None] = ()
    ) -> list[str]:
        """Which of these attempts are still `running` with a cancel requested (the worker's poll).
        `slots`: each attempt's `scheduled_for` (None or empty: unknown, found by id alone)."""
        if not execution_ids:
            return []
        rows = await self._pool.fetch(
            f"""SELECT x.id FROM (SELECT r.id, {slot_of("r.slot", "r.id")} AS slot
                                  FROM unnest($1::uuid[], $2::timestamptz[]) AS r(id, slot) OFFSET 0) r
               -- Lateral: each attempt by its primary key, never a scan of the open rows of every day.
               CROSS JOIN LATERAL (
                   SELECT e.id FROM job_executions e
                   WHERE e.id = r.id AND e.scheduled_for = r.slot AND e.cancel_requested_at IS NOT NULL
                     AND e.finished_at IS NULL AND e.status = 'running'
                   LIMIT 1  -- (kept a subquery: not flattened into a join the planner may turn around)
               ) x""",
            ids(execution_ids),
            _slots(slots, len(execution_ids)),
        )
        return [str(row["id"]) for row in rows]

    async def abandon(self, items: Sequence[tuple[str, str]], *, slots: Sequence[datetime | None] = ()) -> int:
        """A worker that lost its lease gives up attempts `(execution_id, claim_token)`.

        Each still `running` under that token is recorded `abandoned` and its run gets the next
        attempt, `queued`: whoever holds the run's queue item now claims that attempt, and if Redis
        lost the item altogether, reconcile enqueues it again.
        """
        return await end_and_continue(
            self._pool, items, ExecutionStatus.ABANDONED, LOST_WORKER_ERROR, timedelta(0), slots=slots
        )


async def end_and_continue(
    pool: Queryable,
    items: Sequence[tuple[str, str]],
    status: ExecutionStatus,
    error: str,
    delay: timedelta,
    *,
    by_run: bool = False,
    slots: Sequence[datetime | None] = (),
) -> int:
    """End attempts `(execution_id, claim_token)` still `running` under their token with `status`
    (`cancelled` instead where a cancel was requested) and give each run its next attempt,
    `queued`, due after `delay`, with the same snapshot. Returns how many attempts ended.

    With `by_run`, items are `(run_id, claim_token)`: the run's attempt running under that token
    (a token is unique per delivery, so it names one attempt).

    `slots`: each item's `scheduled_for` (None or empty: unknown, read by the id first: a run's id
    is its first attempt's id, and every attempt of a run shares its slot)."""
    if not items:
        return 0
    rows = await pool.fetch(
        f"""
        WITH gone AS (
            UPDATE job_executions e
            SET status = CASE WHEN e.cancel_requested_at IS NULL THEN $3 ELSE 'cancelled' END,
                finished_at = now(), error = CASE WHEN e.cancel_requested_at IS NULL THEN $4 ELSE $5 END,
                -- A reserved attempt ended before its expected start (its lease lost while
                -- held) did not start later than now.
                started_at = least(e.started_at, now())
            FROM (SELECT r.id, r.token, {slot_of("r.slot", "r.id")} AS slot
                  FROM unnest($1::uuid[], $2::text[], $7::timestamptz[]) AS r(id, token, slot) OFFSET 0) r
            WHERE e.{"run_id" if by_run else "id"} = r.id AND e.scheduled_for = r.slot AND e.claim_token = r.token
              AND e.status = 'running'
            RETURNING e.run_id, e.job_id, e.scheduled_for, e.attempt, e.priority, e.status, e.trace_context,
                      e.limit_keys, {snapshot("e")}
        ), next AS (
            INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                        priority, trace_context, limit_keys, {SNAPSHOT_COLUMNS})
            SELECT uuid_v7(), g.run_id, g.job_id, g.scheduled_for, g.attempt + 1, 'queued', 'retry',
                   now() + $6::interval, g.priority, g.trace_context, g.limit_keys, {snapshot("g")}
            FROM gone g WHERE g.status = $3
            ON CONFLICT DO NOTHING
            RETURNING id
        )
        SELECT (SELECT count(*) FROM gone) AS ended
        """,
        ids([execution_id for execution_id, _ in items]),
        [token for _, token in items],
        status.value,
        outputs.bound_error(error),
        CANCELLED_ERROR,
        delay,
        _slots(slots, len(items)),
    )
    return int(rows[0]["ended"])
