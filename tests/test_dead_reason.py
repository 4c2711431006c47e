"""Why a run is dead is decided where its failure is judged, not read back from its error text (issue 19, defect 11)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

import asyncpg
import redis.asyncio as aioredis

from scheduler_grpc import metrics
from scheduler_grpc.control import Control
from scheduler_grpc.handlers import ExecutionContext, Handler, HandlerError, JSONValue, PermanentHandlerError
from scheduler_grpc.jobs import JobSpec, RetryPolicy
from tests.engine_helpers import eventually
from tests.test_worker_faults import registry_with, running_worker, statuses

# An error text that mentions the retry budget: the reason must not be guessed from it.
MISLEADING = "the upstream API said: retry budget exceeded for this client"


class MisleadingHandler(Handler):
    """Fails with an error text that mentions the retry budget: permanently, or (`retryable`) not."""

    name: ClassVar[str] = "test.misleading"
    description: ClassVar[str] = "fail with a misleading error text"
    extra_fields: ClassVar[bool] = True

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        if payload.get("retryable"):
            raise HandlerError("upstream timed out")
        raise PermanentHandlerError(MISLEADING)


def dead_lettered(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("scheduler_dead_lettered_total", {"reason": reason}) or 0.0


async def test_a_permanent_failure_that_mentions_the_retry_budget_is_counted_permanent(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str
) -> None:
    registry = registry_with(MisleadingHandler())
    control = Control(redis, pool, registry)
    retry = RetryPolicy(3, timedelta(milliseconds=10), timedelta(milliseconds=10), False)
    permanent = await control.create_job(JobSpec(name="permanent", handler="test.misleading", retry=retry))
    exhausted = await control.create_job(
        JobSpec(name="exhausted", handler="test.misleading", payload={"retryable": True}, retry=retry)
    )
    before = {reason: dead_lettered(reason) for reason in ("permanent", "retries_exhausted")}
    # The breaker stays closed: its deferrals would add `interrupted` attempts to the histories.
    async with running_worker(redis_url, database_url, pool, registry, SCHEDULER_BREAKER_MIN_CALLS="1000"):
        runs = [(await control.trigger_job(job.id))[0] for job in (permanent, exhausted)]

        async def both_dead() -> list[list[str]]:
            found = [await statuses(pool, run.run_id) for run in runs]
            return found if all(s and s[-1] == "dead" for s in found) else []

        permanent_attempts, exhausted_attempts = await eventually(both_dead, within=20)
    assert permanent_attempts == ["dead"]  # never retried
    assert exhausted_attempts == ["failed", "failed", "failed", "dead"]
    assert dead_lettered("permanent") - before["permanent"] == 1
    assert dead_lettered("retries_exhausted") - before["retries_exhausted"] == 1
