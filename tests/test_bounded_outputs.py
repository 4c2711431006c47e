"""Nothing a job outputs stops a role (issue 19, defects 1-3): a value the store refuses fails the item
that carried it, bounded where it is produced, in the unit it is stored in."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from scheduler_grpc.db.executions import REFUSED_ERROR, ExecutionRepository, Outcome
from scheduler_grpc.db.jobs import JobRepository
from scheduler_grpc.executions import ExecutionStatus, Trigger
from scheduler_grpc.jobs import JobSpec
from scheduler_grpc.outputs import MAX_ERROR_CHARS


async def _claimed(pool: asyncpg.Pool, n: int) -> list[tuple[str, str]]:
    """`n` runs of a new job, claimed: (execution id, claim token) each."""
    job = await JobRepository(pool).create(JobSpec(name=f"bounded-{uuid.uuid4().hex[:8]}", handler="test.echo"), None)
    base = datetime(2020, 1, 1, tzinfo=UTC)
    executions = ExecutionRepository(pool)
    runs = [q.run_id for q in await executions.trigger(job.id, Trigger.BACKFILL, [base + timedelta(seconds=i)
                                                                                  for i in range(n)])]  # fmt: skip
    claims = {c.run_id: c for c in await executions.claim([(run, f"t-{run}") for run in runs], "w")}
    return [(claims[run].execution_id, f"t-{run}") for run in runs]


async def _rows(pool: asyncpg.Pool, ids: list[str]) -> list[tuple[str, str | None, Any]]:
    rows = await pool.fetch(
        "SELECT id::text, status, error, result FROM job_executions WHERE id = ANY($1::uuid[])",
        [uuid.UUID(i) for i in ids],
    )
    by_id = {row["id"]: (row["status"], row["error"], row["result"]) for row in rows}
    return [by_id[i] for i in ids]


async def test_a_refused_result_fails_only_its_own_outcome_of_a_completion_batch(pool: asyncpg.Pool) -> None:
    """Defect 2 (the repository's side): the batch's other outcomes are recorded; each refused one
    is recorded `dead` with an error saying the store refused its result."""
    claimed = await _claimed(pool, 6)
    results: list[Any] = [
        {"ok": 1},
        {"big": "x" * 70_000},  # PostgreSQL's CHECK refuses it
        {"nul": "a\x00b"},  # PostgreSQL refuses \u0000 in jsonb
        {"tags": {1, 2}},  # orjson cannot encode a set
    ]
    outcomes = [
        Outcome(i, token, ExecutionStatus.SUCCEEDED, result=result)
        for (i, token), result in zip(claimed, results, strict=False)
    ]
    outcomes.append(Outcome(*claimed[4], ExecutionStatus.FAILED, "e" * 20_000, retry_after=timedelta(seconds=9)))
    outcomes.append(Outcome(*claimed[5], ExecutionStatus.FAILED, "nul \x00 and \ud800", retry_after=timedelta(0)))
    done = {d.execution_id: d for d in await ExecutionRepository(pool).complete(outcomes, resent=False)}
    ids = [i for i, _ in claimed]
    assert set(done) == set(ids)
    assert [done[i].status for i in ids] == [ExecutionStatus.SUCCEEDED] + [ExecutionStatus.DEAD] * 3 + [
        ExecutionStatus.FAILED
    ] * 2
    assert done[ids[4]].retry_execution_id is not None
    rows = await _rows(pool, ids)
    assert rows[0] == ("succeeded", None, {"ok": 1})
    for status, error, result in rows[1:4]:
        assert (status, result) == ("dead", None)
        assert error is not None
        assert error.startswith(f"{REFUSED_ERROR}: ")
    assert "check constraint" in str(rows[1][1])
    assert rows[4][0] == "failed"
    assert len(str(rows[4][1])) == MAX_ERROR_CHARS
    assert rows[5][:2] == ("failed", "nul \ufffd and \ufffd")


async def test_a_refused_result_inside_a_transaction_keeps_the_transaction(pool: asyncpg.Pool) -> None:
    [(i, token), (j, token_j)] = await _claimed(pool, 2)
    async with pool.acquire() as connection, connection.transaction():
        done = await ExecutionRepository(connection).complete(
            [Outcome(i, token, ExecutionStatus.SUCCEEDED, result={"big": "x" * 70_000}),
             Outcome(j, token_j, ExecutionStatus.SUCCEEDED, result=[1])]
        )  # fmt: skip
        assert sorted(d.status.value for d in done) == ["dead", "succeeded"]
    assert [row[0] for row in await _rows(pool, [i, j])] == ["dead", "succeeded"]
