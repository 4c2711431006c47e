"""Job dependencies, the graph side (issue 13): edges, cycle refusal (also under concurrent edits on
two server processes), delete of an upstream, and the pure flow rules."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import replace
from datetime import timedelta

import asyncpg
import pytest
import redis.asyncio as aioredis
from scheduler_client import SchedulerClient
from scheduler_client.errors import FailedPrecondition as ClientFailedPrecondition
from scheduler_client.errors import InvalidArgument as ClientInvalidArgument

from scheduler_grpc import flowrun
from scheduler_grpc.control import Control
from scheduler_grpc.db.executions import Advance, PlannedSlot
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.flows import FlowRepository, NodeDecision
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.dispatch import Queues
from scheduler_grpc.errors import FailedPrecondition, Fenced, InvalidArgument, NotFound
from scheduler_grpc.executions import ExecutionStatus
from scheduler_grpc.flows import (
    Decision,
    Outcome,
    TriggerRule,
    UnresolvedReference,
    decide,
    resolve_payload,
)
from scheduler_grpc.jobs import JobSpec, ScheduleKind
from tests.api_helpers import ADMIN, ADMIN_PASSWORD, start_server, wait_for_server
from tests.engine_helpers import Roles


def spec(name: str, *depends_on: str, rule: TriggerRule = TriggerRule.ALL_SUCCEEDED) -> JobSpec:
    return JobSpec(name=name, handler="test.echo", depends_on=tuple(depends_on), trigger_rule=rule)


async def depend(control: Control, name: str, *upstreams: str) -> None:
    job = await control.get_job_by_name(name)
    await control.update_job(job.id, replace(job, depends_on=tuple(upstreams)))


async def test_depends_on_by_name_or_id_is_stored_as_ids_in_order(control: Control) -> None:
    a = await control.create_job(spec("a"))
    b = await control.create_job(spec("b"))
    c = await control.create_job(
        spec("c", "b", a.id, "b"),
    )
    assert c.depends_on == (b.id, a.id)
    assert (await control.get_job(c.id)).depends_on == (b.id, a.id)
    assert (await control.get_job(a.id)).depends_on == ()


async def test_unknown_upstream_is_refused_naming_the_index(control: Control) -> None:
    await control.create_job(spec("a"))
    with pytest.raises(InvalidArgument) as error:
        await control.create_job(spec("c", "a", "nope"))
    assert error.value.field == "depends_on[1]"
    assert "nope" in error.value.message
    with pytest.raises(NotFound):  # nothing was stored
        await control.get_job_by_name("c")


async def test_from_references_must_name_an_upstream(control: Control) -> None:
    await control.create_job(spec("src"))
    ok = await control.create_job(
        replace(spec("dst", "src"), payload={"x": {"$from": "src.result.path"}, "y": [{"$from": "src.result"}]})
    )
    assert ok.payload["x"] == {"$from": "src.result.path"}
    with pytest.raises(InvalidArgument) as error:
        await control.create_job(replace(spec("orphan"), payload={"x": {"$from": "src.result"}}))
    assert error.value.field == "payload"
    assert "names no upstream of this job (its depends_on: none)" in error.value.message
    with pytest.raises(InvalidArgument, match=r"payload: .*expected"):
        await control.create_job(replace(spec("bad", "src"), payload={"x": {"$from": "src"}}))
    with pytest.raises(InvalidArgument, match=r"its depends_on: src\)"):
        await control.update_job(ok.id, replace(ok, payload={"x": {"$from": "other.result"}}))


async def test_a_cycle_of_length_1_is_refused(control: Control) -> None:
    with pytest.raises(InvalidArgument) as error:
        await control.create_job(spec("self", "self"))
    assert "would create a cycle: self → self" in str(error.value)
    job = await control.create_job(spec("loner"))
    with pytest.raises(InvalidArgument) as error:
        await control.update_job(job.id, replace(job, depends_on=(job.id,)))
    assert error.value.field == "depends_on[0]"
    assert f"would create a cycle: {job.id} → {job.id}" in str(error.value)


async def test_a_cycle_of_length_2_is_refused_with_its_path(control: Control) -> None:
    await control.create_job(spec("a"))
    await control.create_job(spec("b", "a"))
    with pytest.raises(InvalidArgument) as error:
        await depend(control, "a", "b")
    assert error.value.field == "depends_on"
    assert error.value.message == "would create a cycle: a → b → a"
    assert (await control.get_job_by_name("a")).depends_on == ()


async def test_the_issue_example_names_the_path(control: Control) -> None:
    await control.create_job(spec("load"))
    await control.create_job(spec("extract", "load"))
    await control.create_job(spec("transform", "extract"))
    with pytest.raises(InvalidArgument) as error:
        await depend(control, "load", "transform")
    assert str(error.value) == "depends_on: would create a cycle: load → extract → transform → load"


async def test_a_cycle_of_length_50_is_refused_with_its_path(control: Control) -> None:
    names = [f"j{i:02d}" for i in range(50)]
    await control.create_job(spec(names[0]))
    for previous, name in itertools.pairwise(names):
        await control.create_job(spec(name, previous))
    with pytest.raises(InvalidArgument) as error:
        await depend(control, names[0], names[-1])
    assert error.value.message == "would create a cycle: " + " → ".join([*names, names[0]])
    # A diamond-rich graph that is still acyclic passes: every job may depend on all earlier ones.
    await depend(control, names[-1], *names[:-1])


async def test_deleting_an_upstream_needs_detach(control: Control, pool: asyncpg.Pool) -> None:
    a = await control.create_job(spec("a"))
    b = await control.create_job(spec("b", "a"))
    with pytest.raises(FailedPrecondition) as error:
        await control.delete_job(a.id)
    assert "b" in str(error.value)
    await control.delete_job(a.id, detach_dependents=True)
    assert (await control.get_job(b.id)).depends_on == ()
    assert await pool.fetchval("SELECT count(*) FROM job_dependencies") == 0


async def test_concurrent_opposite_edges_on_two_servers_never_both_succeed(
    roles: Roles, redis: aioredis.Redis, pool: asyncpg.Pool
) -> None:
    """A->B and B->A sent at the same moment through two server processes: exactly one wins per pair
    (and the API names the field of a refused edge, and refuses deleting an upstream)."""
    first, second = start_server(roles), start_server(roles)
    await wait_for_server(first)
    await wait_for_server(second)
    pairs = 40
    async with (
        SchedulerClient.connect(first.target) as one,
        SchedulerClient.connect(second.target) as two,
    ):
        await one.login(ADMIN, ADMIN_PASSWORD)
        await two.login(ADMIN, ADMIN_PASSWORD)
        jobs = [
            (await one.create_job(f"race-a-{i}", "test.echo"), await one.create_job(f"race-b-{i}", "test.echo"))
            for i in range(pairs)
        ]
        outcomes = await asyncio.gather(
            *(
                call
                for a, b in jobs
                for call in (one.update_job(a.id, depends_on=[b.id]), two.update_job(b.id, depends_on=[a.id]))
            ),
            return_exceptions=True,
        )
    for index in range(pairs):
        pair = outcomes[2 * index : 2 * index + 2]
        won = [outcome for outcome in pair if not isinstance(outcome, BaseException)]
        lost = [outcome for outcome in pair if isinstance(outcome, BaseException)]
        assert len(won) == 1, f"pair {index}: {pair}"
        assert isinstance(lost[0], ClientInvalidArgument), lost
        assert "job.depends_on: would create a cycle" in str(lost[0])
    mutual = await pool.fetchval(
        """SELECT count(*) FROM job_dependencies x JOIN job_dependencies y
           ON x.job_id = y.upstream_id AND x.upstream_id = y.job_id"""
    )
    assert mutual == 0

    # The same servers, for the API's field names and the delete of an upstream.
    async with SchedulerClient.connect(first.target) as client:
        await client.login(ADMIN, ADMIN_PASSWORD)
        a = await client.create_job("api-a", "test.echo")
        b = await client.create_job("api-b", "test.echo", depends_on=["api-a"], trigger_rule="all_done")
        assert list(b.depends_on) == [a.id]
        assert b.trigger_rule == 2
        with pytest.raises(ClientInvalidArgument, match=r"job.depends_on\[0\]: no job 'ghost'"):
            await client.create_job("api-c", "test.echo", depends_on=["ghost"])
        with pytest.raises(
            ClientInvalidArgument, match=r"job\.depends_on: would create a cycle: api-a → api-b → api-a"
        ):
            await client.update_job(a.id, depends_on=[b.id])
        with pytest.raises(ClientFailedPrecondition, match="api-b"):
            await client.delete_job(a.id)
        await client.delete_job(a.id, detach_dependents=True)
        assert list((await client.get_job(b.id)).depends_on) == []


def test_trigger_rules_decide_once_every_upstream_is_final() -> None:
    ok, failed, skipped = Outcome.SUCCEEDED, Outcome.FAILED, Outcome.SKIPPED
    assert decide(TriggerRule.ALL_SUCCEEDED, [ok, None]) is None
    assert decide(TriggerRule.ALL_SUCCEEDED, [ok, ok]) is Decision.RUN
    assert decide(TriggerRule.ALL_SUCCEEDED, [ok, failed]) is Decision.UPSTREAM_FAILED
    assert decide(TriggerRule.ALL_SUCCEEDED, [ok, skipped]) is Decision.SKIPPED
    assert decide(TriggerRule.ALL_DONE, [failed, skipped]) is Decision.RUN
    assert decide(TriggerRule.ANY_FAILED, [ok, failed]) is Decision.RUN
    assert decide(TriggerRule.ANY_FAILED, [ok, ok]) is Decision.SKIPPED


def test_from_references_resolve_by_the_longest_upstream_name() -> None:
    results = {"extract": {"path": "/tmp/x", "rows": [1, 2]}, "extract.v2": {"path": "/tmp/y"}}
    payload = {"a": {"$from": "extract.result.path"}, "b": [{"$from": "extract.v2.result.path"}],
               "c": {"$from": "extract.result.rows.1"}, "d": {"$from": "extract.result"}, "e": 5}  # fmt: skip
    assert resolve_payload(payload, results) == {
        "a": "/tmp/x", "b": ["/tmp/y"], "c": 2, "d": results["extract"], "e": 5,
    }  # fmt: skip
    with pytest.raises(UnresolvedReference, match=r"extract\.result has no 'missing'"):
        resolve_payload({"x": {"$from": "extract.result.missing"}}, results)
    with pytest.raises(UnresolvedReference, match="no upstream"):
        resolve_payload({"x": {"$from": "other.result"}}, results)


async def test_two_deciders_racing_on_one_node_create_one_run(control: Control, pool: asyncpg.Pool) -> None:
    """Two upstreams finishing at the same instant (two leaders, or a leader and its successor):
    both decide the join in their own transaction at once; the compare-and-set keyed on (flow run,
    job) lets exactly one create its run."""
    a = await control.create_job(spec("root"))
    await control.create_job(spec("left", "root"))
    await control.create_job(spec("right", "root"))
    join = await control.create_job(spec("join", "left", "right"))
    flow_ids = [(await control.trigger_job(a.id))[0].run_id for _ in range(20)]

    async def decide(flow_id: str) -> int:
        async with pool.acquire() as conn, conn.transaction():
            queued, _ = await FlowRepository(conn).decide(flow_id, [NodeDecision(join.id, "queued")], None)
            return len(queued)

    created = await asyncio.gather(*(decide(flow_id) for flow_id in flow_ids for _ in range(2)))
    assert sorted(created) == [0] * 20 + [1] * 20
    runs = await pool.fetch("SELECT run_id FROM job_executions WHERE job_id = $1", uuid.UUID(join.id))
    assert len(runs) == 20
    nodes = await pool.fetch("SELECT run_id FROM flow_nodes WHERE job_id = $1", uuid.UUID(join.id))
    assert sorted(str(row["run_id"]) for row in nodes) == sorted(str(row["run_id"]) for row in runs)


async def test_the_leader_step_pages_through_every_open_flow_run_and_is_fenced(
    control: Control, pool: asyncpg.Pool, redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process leader step (no worker: the root runs are finished by hand, as a worker would):
    more open flow runs than one page are all advanced, and a stale term writes nothing."""
    root = await control.create_job(spec("page-root"))
    child = await control.create_job(spec("page-child", "page-root"))
    flow_ids = [(await control.trigger_job(root.id))[0].run_id for _ in range(5)]
    await pool.execute(
        """UPDATE job_executions SET status = 'succeeded', started_at = now(), finished_at = now(),
               worker_id = 'test', claim_token = 't', result = '{"n": 1}'
           WHERE job_id = $1""",
        uuid.UUID(root.id),
    )
    old = await LeadershipRepository(pool).begin_term("scheduler", "old")
    current = await LeadershipRepository(pool).begin_term("scheduler", "new")
    assert old is not None
    assert current is not None
    monkeypatch.setattr(flowrun, "FLOW_PAGE", 2)
    flows, queues = FlowRepository(pool), Queues(redis)
    with pytest.raises(Fenced):
        await flowrun.advance(flows, redis, queues, old.term)
    assert await pool.fetchval("SELECT count(*) FROM job_executions WHERE job_id = $1", uuid.UUID(child.id)) == 0
    assert await flowrun.advance(flows, redis, queues, current.term) == 5
    assert await flowrun.advance(flows, redis, queues, current.term) == 0  # decided once
    for flow_id in flow_ids:
        flow = await control.get_flow_run(flow_id)
        assert {node.job_name: node.state for node in flow.nodes} == {"page-root": "succeeded", "page-child": "queued"}
    assert await queues.get("default").stats() is not None
    assert (await queues.get("default").stats()).ready == 5 + 5  # the roots (never claimed) and the children


async def test_a_fired_slot_starts_a_flow_run_over_its_own_descendants_only(
    control: Control, pool: asyncpg.Pool
) -> None:
    """The scheduler's fire statement (a cron job in the middle of a graph) starts a flow run in its
    own transaction, covering the fired job and what is downstream of it, not its upstreams."""
    await control.create_job(spec("upper"))
    middle = await control.create_job(
        replace(spec("middle", "upper"), schedule_kind=ScheduleKind.CRON, cron="* * * * *")
    )
    await control.create_job(spec("lower", "middle"))
    await control.create_job(spec("unrelated"))
    term = await LeadershipRepository(pool).begin_term("scheduler", "leader")
    assert term is not None
    assert middle.next_run_time is not None
    slot = middle.next_run_time
    (run,) = await FiringRepository(pool).fire(
        term.term,
        [Advance(middle.id, slot, slot + timedelta(minutes=1))],
        [PlannedSlot(middle.id, slot, ExecutionStatus.QUEUED, slot)],
    )
    flow = await control.get_flow_run(run.run_id)
    assert flow.root_job_id == middle.id
    assert {node.job_name: node.state for node in flow.nodes} == {"middle": "queued", "lower": "pending"}
    assert (await control.get_execution(run.run_id)).flow_run_id == run.run_id
    # A job without dependents starts none.
    lone = await control.create_job(spec("lone"))
    (alone,) = await control.trigger_job(lone.id)
    assert (await control.get_execution(alone.run_id)).flow_run_id is None
    assert await pool.fetchval("SELECT count(*) FROM flow_runs") == 1
