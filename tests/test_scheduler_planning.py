"""The due-scan's planning: misfire policies and catch-up bounds (pure; no servers)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from scheduler_grpc.executions import ExecutionStatus
from scheduler_grpc.jobs import Job, MisfirePolicy, ScheduleKind
from scheduler_grpc.scheduler import LoopSettings, Plan, plan_job

NOW = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)


def minutely(next_run: datetime, policy: MisfirePolicy) -> Job:
    return Job(
        name="j",
        handler="test.echo",
        schedule_kind=ScheduleKind.CRON,
        cron="* * * * *",
        id="00000000-0000-0000-0000-000000000001",
        next_run_time=next_run,
        misfire_policy=policy,
    )


def statuses(plan: Plan) -> list[str]:
    return [slot.status.value for slot in plan.slots]


def test_a_slot_within_the_grace_runs() -> None:
    plan = Plan()
    plan_job(minutely(NOW, MisfirePolicy.SKIP), NOW + timedelta(seconds=30), LoopSettings(), plan)
    assert statuses(plan) == ["queued"]
    assert plan.advances[0].new == NOW + timedelta(minutes=1)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (MisfirePolicy.RUN_ONCE, ["missed", "missed", "missed", "missed", "queued"]),
        (MisfirePolicy.SKIP, ["missed"] * 5),
        (MisfirePolicy.RUN_ALL, ["queued"] * 5),
    ],
)
def test_misfire_policies_after_an_outage(policy: MisfirePolicy, expected: list[str]) -> None:
    # Five slots (11:54..11:58) passed more than the 60 s grace ago; 11:59 is exactly 60 s old, so
    # it is not a misfire and runs under every policy, as does 12:00.
    plan = Plan()
    plan_job(minutely(NOW - timedelta(minutes=6), policy), NOW, LoopSettings(), plan)
    assert statuses(plan)[:5] == expected
    assert statuses(plan)[5:] == ["queued", "queued"]  # 11:59 and 12:00 are not misfires
    assert [slot.scheduled_for.minute for slot in plan.slots] == [54, 55, 56, 57, 58, 59, 0]
    assert plan.advances[0].new == NOW + timedelta(minutes=1)


def test_run_once_coalesces_into_the_latest_misfired_slot_when_nothing_newer_is_due() -> None:
    plan = Plan()
    loop = LoopSettings(misfire_grace=timedelta(seconds=10))
    # At 11:59:40 with a 10 s grace, 11:56..11:59 are all misfires; 11:59 is the last of them.
    plan_job(minutely(NOW - timedelta(minutes=4), MisfirePolicy.RUN_ONCE), NOW - timedelta(seconds=20), loop, plan)
    assert statuses(plan) == ["missed", "missed", "missed", "queued"]


def test_catch_up_is_bounded_per_scan_and_continues_where_it_stopped() -> None:
    plan = Plan()
    loop = LoopSettings(max_slots_per_job=100)
    plan_job(minutely(NOW - timedelta(days=1), MisfirePolicy.SKIP), NOW, loop, plan)
    assert len(plan.slots) == 100
    assert all(slot.status is ExecutionStatus.MISSED for slot in plan.slots)
    assert plan.advances[0].new == plan.slots[-1].scheduled_for + timedelta(minutes=1)


def test_a_one_shot_fires_once_and_is_done() -> None:
    plan = Plan()
    job = Job(name="once", handler="test.echo", schedule_kind=ScheduleKind.ONCE, run_at=NOW,
              id="00000000-0000-0000-0000-000000000002", next_run_time=NOW)  # fmt: skip
    plan_job(job, NOW, LoopSettings(), plan)
    assert statuses(plan) == ["queued"]
    assert plan.advances[0].new is None
