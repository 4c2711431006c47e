"""Flow runs with real scheduler and worker processes (issue 13): a diamond runs its join once per
flow run with both results, failures and trigger rules, pausing, cancelling, and crashes (kill -9
of a worker after an upstream finished, of the leader mid-flow, a lost enqueue)."""

from __future__ import annotations

import signal
from collections import Counter
from datetime import timedelta
from typing import Any

import asyncpg
import redis.asyncio as aioredis

from scheduler_grpc.control import Control
from scheduler_grpc.db.flows import FlowRepository, NodeDecision
from scheduler_grpc.flows import FlowRun, TriggerRule
from scheduler_grpc.jobs import JobSpec, RetryPolicy
from scheduler_grpc.keys import LeaderKeys
from tests.engine_helpers import Roles, eventually, wait_until_ready

QUICK_RETRY = RetryPolicy(max_retries=0, initial_backoff=timedelta(milliseconds=100))


def job(
    name: str,
    *depends_on: str,
    handler: str = "test.echo",
    payload: dict[str, Any] | None = None,
    rule: TriggerRule = TriggerRule.ALL_SUCCEEDED,
    retry: RetryPolicy = QUICK_RETRY,
) -> JobSpec:
    return JobSpec(
        name=name, handler=handler, payload=payload or {}, depends_on=depends_on, trigger_rule=rule, retry=retry
    )


async def start_engine(roles: Roles, redis: aioredis.Redis, *, schedulers: int = 1, workers: int = 1) -> None:
    for _ in range(schedulers):
        roles.start("scheduler")
    for _ in range(workers):
        roles.start("worker", "--concurrency", "4")
    await wait_until_ready(redis, workers=workers)


async def finished(control: Control, flow_run_id: str, within: float = 30) -> FlowRun:
    async def done() -> FlowRun | None:
        flow = await control.get_flow_run(flow_run_id)
        return flow if flow.state != "running" else None

    result = await eventually(done, within=within)
    assert result is not None
    return result


def states(flow: FlowRun) -> dict[str, str]:
    return {node.job_name: node.state for node in flow.nodes}


async def runs_per_flow(pool: asyncpg.Pool, name: str) -> Counter[str]:
    """How many runs (first attempts) job `name` has in each flow run."""
    rows = await pool.fetch(
        """SELECT n.flow_run_id FROM job_executions e JOIN jobs j ON j.id = e.job_id
           JOIN flow_nodes n ON n.run_id = e.run_id WHERE j.name = $1 AND e.attempt = 1""",
        name,
    )
    return Counter(str(row["flow_run_id"]) for row in rows)


async def diamond(control: Control, *, b_handler: str = "test.echo", b_payload: dict[str, Any] | None = None) -> str:
    """A -> B, A -> C, B & C -> D; D's payload takes B's and C's results; returns A's id."""
    a = await control.create_job(job("A", payload={"path": "/data/a.csv"}))
    await control.create_job(
        job(
            "B",
            "A",
            handler=b_handler,
            payload={"input": {"$from": "A.result.echo.path"}} if b_payload is None else b_payload,
        )
    )
    await control.create_job(job("C", "A", payload={"rows": 3}))
    await control.create_job(
        job("D", "B", "C", payload={"b": {"$from": "B.result"}, "rows": {"$from": "C.result.echo.rows"}})
    )
    return a.id


async def test_a_diamond_runs_its_join_once_per_flow_run_with_both_results_and_retries_finish_first(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    await start_engine(roles, redis, workers=2)
    root = await diamond(control)
    flow_ids = [(await control.trigger_job(root))[0].run_id for _ in range(3)]
    for flow_id in flow_ids:
        flow = await finished(control, flow_id)
        assert flow.state == "succeeded"
        assert states(flow) == {"A": "succeeded", "B": "succeeded", "C": "succeeded", "D": "succeeded"}
        d_run = next(node.run_id for node in flow.nodes if node.job_name == "D")
        assert d_run is not None
        d = await control.get_execution(d_run)
        assert d.flow_run_id == flow_id
        # D's payload took B's result and C's rows (`$from`); its handler's context carried both
        # upstream results (test.echo returns them as "upstream"), and B's and C's carried A's.
        a_result = {"echo": {"path": "/data/a.csv"}}
        b_result = {"echo": {"input": "/data/a.csv"}, "upstream": {"A": a_result}}
        c_result = {"echo": {"rows": 3}, "upstream": {"A": a_result}}
        assert d.result == {"echo": {"b": b_result, "rows": 3}, "upstream": {"B": b_result, "C": c_result}}
    assert await runs_per_flow(pool, "D") == dict.fromkeys(flow_ids, 1)
    assert await FlowRepository(pool).upstream_results(d_run) == {"B": b_result, "C": c_result}
    # Every run of the flow runs is listed by flow run.
    page = await control.list_executions(flow_run_id=flow_ids[0])
    assert sorted(e.job_id for e in page.executions) == sorted(node.job_id for node in flow.nodes)
    # The same engine: a retried upstream (the flow waits for the run's final state).
    await check_a_retried_upstream_lets_the_flow_go_on_once_it_succeeds(control)


async def test_failure_records_dependents_upstream_failed_rules_decide_and_from_errors_are_named(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    await start_engine(roles, redis)
    root = await diamond(control, b_handler="test.fail", b_payload={})
    await control.create_job(job("after-D", "D"))  # transitively upstream_failed
    await control.create_job(job("report", "B", "C", rule=TriggerRule.ALL_DONE))
    await control.create_job(job("cleanup", "B", rule=TriggerRule.ANY_FAILED))
    await control.create_job(job("cleanup-c", "C", rule=TriggerRule.ANY_FAILED))
    await control.create_job(job("needs-c", "C"))
    paused = await control.create_job(job("paused", "C"))
    await control.pause_job(paused.id)
    await control.create_job(job("after-paused", "paused"))
    flow = await finished(control, (await control.trigger_job(root))[0].run_id)
    assert flow.state == "failed"
    assert states(flow) == {
        "A": "succeeded", "B": "dead", "C": "succeeded", "D": "upstream_failed", "after-D": "upstream_failed",
        "report": "succeeded", "cleanup": "succeeded", "cleanup-c": "skipped", "needs-c": "succeeded",
        "paused": "skipped", "after-paused": "skipped",
    }  # fmt: skip
    # Every node has its history row (never silently absent), each created once.
    for node in flow.nodes:
        history = await control._history.history(node.job_id)
        assert len(history) == 1, (node.job_name, history)
        assert history[0].flow_run_id == flow.id
    # The same engine: a `$from` path the upstream's result lacks.
    await check_a_missing_from_path_fails_the_downstream_run_with_the_reference_named(control)


async def check_a_retried_upstream_lets_the_flow_go_on_once_it_succeeds(control: Control) -> None:
    a = await control.create_job(
        job("flaky", handler="test.fail", payload={"fail_attempts": 1},
            retry=RetryPolicy(max_retries=2, initial_backoff=timedelta(milliseconds=100), jitter=False))
    )  # fmt: skip
    await control.create_job(job("next", "flaky", payload={"attempt": {"$from": "flaky.result.attempt"}}))
    flow = await finished(control, (await control.trigger_job(a.id))[0].run_id)
    assert states(flow) == {"flaky": "succeeded", "next": "succeeded"}
    assert [e.status.value for e in await control._history.history(a.id)] == ["failed", "succeeded"]
    downstream = await control.get_execution(next(n.run_id for n in flow.nodes if n.job_name == "next") or "")
    assert downstream.result == {"echo": {"attempt": 2}, "upstream": {"flaky": {"attempt": 2, "failed_attempts": 1}}}


async def check_a_missing_from_path_fails_the_downstream_run_with_the_reference_named(control: Control) -> None:
    a = await control.create_job(job("up", payload={"x": 1}))
    b = await control.create_job(job("down", "up", payload={"y": {"$from": "up.result.echo.nope"}}))
    flow = await finished(control, (await control.trigger_job(a.id))[0].run_id)
    assert states(flow) == {"up": "succeeded", "down": "dead"}
    (row,) = await control._history.history(b.id)
    assert row.error == """payload: {"$from": "up.result.echo.nope"}: up.result.echo has no 'nope'"""


async def test_cancelling_a_flow_run_cancels_its_running_run_and_records_the_rest(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    await start_engine(roles, redis)
    a = await control.create_job(job("slow", handler="test.delay", payload={"seconds": 30}))
    await control.create_job(job("then", "slow"))
    await control.create_job(job("then-too", "then"))
    flow_id = (await control.trigger_job(a.id))[0].run_id

    async def running() -> bool:
        return bool((await control.get_execution(flow_id)).status.value == "running")

    await eventually(running, within=15)
    flow = await control.cancel_flow_run(flow_id)
    assert flow.state == "cancelled"
    assert states(flow)["then"] == "cancelled"
    assert states(flow)["then-too"] == "cancelled"

    async def slow_cancelled() -> bool:
        return (await control.get_execution(flow_id)).status.value == "cancelled"

    await eventually(slow_cancelled, within=15)
    assert states(await control.get_flow_run(flow_id)) == {"slow": "cancelled", "then": "cancelled",
                                                            "then-too": "cancelled"}  # fmt: skip


async def test_kill_9_of_a_worker_after_an_upstream_finished_loses_and_duplicates_nothing(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    roles.start("scheduler")
    worker = roles.start("worker")
    await wait_until_ready(redis, workers=1)
    root = await diamond(control)
    flow_ids = [(await control.trigger_job(root))[0].run_id for _ in range(3)]

    async def some_upstream_done() -> bool:
        return bool(
            await pool.fetchval(
                """SELECT count(*) FROM job_executions e JOIN jobs j ON j.id = e.job_id
                   WHERE j.name = 'A' AND e.status = 'succeeded'"""
            )
        )

    await eventually(some_upstream_done, within=15)
    worker.signal(signal.SIGKILL)  # right after an upstream's completion: its downstream is not enqueued yet
    roles.start("worker")
    for flow_id in flow_ids:
        assert (await finished(control, flow_id)).state == "succeeded"
    for name in "ABCD":
        assert await runs_per_flow(pool, name) == dict.fromkeys(flow_ids, 1), name


async def test_a_downstream_run_committed_but_never_enqueued_is_enqueued_by_reconcile_and_runs_once(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    """A leader that crashed between committing a decision and enqueueing it (no scheduler at first:
    the test makes the decision itself, as that leader did, and never enqueues it)."""
    roles.start("worker")
    await wait_until_ready(redis, workers=1, leader=False)
    a = await control.create_job(job("first"))
    b = await control.create_job(job("second", "first"))
    flow_id = (await control.trigger_job(a.id))[0].run_id

    async def first_done() -> bool:
        return (await control.get_execution(flow_id)).status.value == "succeeded"

    await eventually(first_done, within=15)
    async with pool.acquire() as conn, conn.transaction():
        queued, _ = await FlowRepository(conn).decide(flow_id, [NodeDecision(b.id, "queued")], None)
    assert len(queued) == 1  # committed, and (the crash) not enqueued
    roles.start("scheduler")
    flow = await finished(control, flow_id)
    assert states(flow) == {"first": "succeeded", "second": "succeeded"}
    assert [e.status.value for e in await control._history.history(b.id)] == ["succeeded"]


async def test_kill_9_of_the_leader_mid_flows_loses_and_duplicates_nothing(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    await start_engine(roles, redis, schedulers=2, workers=2)
    root = await diamond(control)
    flow_ids = [(await control.trigger_job(root))[0].run_id for _ in range(6)]
    killed: list[str] = []
    for _ in range(2):

        async def new_leader() -> str:
            holder = (await redis.get(LeaderKeys().lock) or b"").decode()
            return holder if holder and holder.split(":")[0] not in killed else ""

        holder = await eventually(new_leader, within=20)
        leader = next(role for role in roles.started if holder.startswith(role.name + ":"))
        leader.signal(signal.SIGKILL)  # mid-flows: some decided, some not, some enqueues maybe lost
        killed.append(leader.name)
        roles.start("scheduler")
        flow_ids += [(await control.trigger_job(root))[0].run_id for _ in range(3)]
    for flow_id in flow_ids:
        assert (await finished(control, flow_id, within=60)).state == "succeeded"
    for name in "ABCD":
        assert await runs_per_flow(pool, name) == dict.fromkeys(flow_ids, 1), name
