"""The due-scan's planning: misfire policies and catch-up bounds (pure; no servers)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from scheduler_grpc import schedule as schedule_module
from scheduler_grpc.executions import ExecutionStatus
from scheduler_grpc.jobs import Job, MisfirePolicy, ScheduleKind
from scheduler_grpc.schedule import (
    CronSchedule,
    FoldPolicy,
    GapPolicy,
    count_fires,
    fire_times,
    last_fire_before,
    parse_cron,
)
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


def rows(plan: Plan) -> list[tuple[str, str, str | None, int | None]]:
    """(status, slot, last slot of a missed range, its count) per planned row, times as HH:MM(:SS)."""

    def hm(value: datetime | None) -> str | None:
        return None if value is None else value.strftime("%H:%M:%S").removesuffix(":00")

    return [(s.status.value, hm(s.scheduled_for) or "", hm(s.missed_through), s.missed_count) for s in plan.slots]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # One `missed` row for the whole run of misfires; `run_once` runs its last slot (11:58).
        (MisfirePolicy.RUN_ONCE, [("missed", "11:54", "11:57", 4), ("queued", "11:58", None, None)]),
        (MisfirePolicy.SKIP, [("missed", "11:54", "11:58", 5)]),
        (MisfirePolicy.RUN_ALL, [("queued", f"11:5{minute}", None, None) for minute in range(4, 9)]),
    ],
)
def test_misfire_policies_after_an_outage(policy: MisfirePolicy, expected: list[tuple[object, ...]]) -> None:
    # Five slots (11:54..11:58) passed more than the 60 s grace ago; 11:59 is exactly 60 s old, so
    # it is not a misfire and runs under every policy, as does 12:00.
    plan = Plan()
    plan_job(minutely(NOW - timedelta(minutes=6), policy), NOW, LoopSettings(), plan)
    assert rows(plan) == [*expected, ("queued", "11:59", None, None), ("queued", "12:00", None, None)]
    assert plan.advances[0].new == NOW + timedelta(minutes=1)


def test_run_once_coalesces_into_the_latest_misfired_slot_when_nothing_newer_is_due() -> None:
    plan = Plan()
    loop = LoopSettings(misfire_grace=timedelta(seconds=10))
    # At 11:59:40 with a 10 s grace, 11:56..11:59 are all misfires; 11:59 is the last of them.
    plan_job(minutely(NOW - timedelta(minutes=4), MisfirePolicy.RUN_ONCE), NOW - timedelta(seconds=20), loop, plan)
    assert rows(plan) == [("missed", "11:56", "11:58", 3), ("queued", "11:59", None, None)]


def test_run_once_of_a_single_misfire_runs_it_and_records_no_range() -> None:
    plan = Plan()
    plan_job(minutely(NOW - timedelta(minutes=2), MisfirePolicy.RUN_ONCE), NOW, LoopSettings(), plan)
    assert rows(plan) == [
        ("queued", "11:58", None, None),
        ("queued", "11:59", None, None),
        ("queued", "12:00", None, None),
    ]


def test_a_day_long_outage_is_one_row_per_job_and_planned_without_walking_its_slots() -> None:
    plan = Plan()
    job = Job(name="s", handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * * *",
              id="00000000-0000-0000-0000-000000000003", next_run_time=NOW - timedelta(days=1),
              misfire_policy=MisfirePolicy.SKIP)  # fmt: skip
    began = time.perf_counter()
    plan_job(job, NOW, LoopSettings(misfire_grace=timedelta(seconds=2)), plan)
    took = time.perf_counter() - began
    # 86,398 per-second slots older than the grace: walking them takes seconds, counting them not.
    assert rows(plan) == [("missed", "12:00", "11:59:57", 86_398), ("queued", "11:59:58", None, None),
                          ("queued", "11:59:59", None, None), ("queued", "12:00", None, None)]  # fmt: skip
    assert plan.advances[0].new == NOW + timedelta(seconds=1)
    assert took < 0.5, f"planning a day of misfires took {took:.2f}s"


def test_a_long_range_in_a_dst_zone_is_recorded_with_an_unknown_count() -> None:
    plan = Plan()
    job = Job(name="p", handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * * *",
              time_zone="Europe/Paris", id="00000000-0000-0000-0000-000000000004",
              next_run_time=NOW - timedelta(minutes=20), misfire_policy=MisfirePolicy.RUN_ONCE)  # fmt: skip
    plan_job(job, NOW, LoopSettings(misfire_grace=timedelta(seconds=1)), plan)
    # With a 1 s grace 11:59:58 is the last misfire: `run_once` runs it; the range ends before it.
    assert rows(plan) == [("missed", "11:40", "11:59:57", None), ("queued", "11:59:58", None, None),
                          ("queued", "11:59:59", None, None), ("queued", "12:00", None, None)]  # fmt: skip


def test_run_all_catch_up_is_bounded_per_scan_and_continues_where_it_stopped() -> None:
    plan = Plan()
    loop = LoopSettings(max_slots_per_job=100)
    plan_job(minutely(NOW - timedelta(days=1), MisfirePolicy.RUN_ALL), NOW, loop, plan)
    assert len(plan.slots) == 100
    assert all(slot.status is ExecutionStatus.QUEUED for slot in plan.slots)
    assert plan.advances[0].new == plan.slots[-1].scheduled_for + timedelta(minutes=1)


_DST_SCHEDULES = [
    parse_cron(expression, "Europe/Paris", gap, fold)
    for expression in ("*/20 * * * *", "30 2 * * *", "0 * * * *", "15,45 1-3 * * *")
    for gap in GapPolicy
    for fold in FoldPolicy
] + [parse_cron(expression) for expression in ("*/20 * * * *", "30 */5 * * * *", "0 */2 * * *", "15,45 1-3 * * *")]


@pytest.mark.parametrize(
    "schedule", _DST_SCHEDULES, ids=lambda s: f"{s.expression}-{s.time_zone}-{s.gap_policy}-{s.fold_policy}"
)
def test_the_last_misfire_and_the_count_match_a_walk_of_every_slot_across_dst(schedule: CronSchedule) -> None:
    # Both 2026 transitions of Europe/Paris (a skipped and a repeated hour, both at 01:00 UTC), with
    # bounds every 10 minutes for 5 hours; in UTC, the arithmetic of fixed-period schedules against
    # the same walk. A next_run_time off the schedule's grid (7 s late) counts as a slot, as a walk
    # from it would.
    for night in (datetime(2026, 3, 28, 22, tzinfo=UTC), datetime(2026, 10, 24, 22, tzinfo=UTC)):
        for late in (timedelta(0), timedelta(seconds=7)):
            start = night - timedelta(hours=6) + late
            fires = [start]
            for fire in fire_times(schedule, start):
                if fire.instant >= night + timedelta(hours=6):
                    break
                fires.append(fire.instant)
            for step in range(1, 31):
                bound = night + timedelta(minutes=10 * step)
                walked = [instant for instant in fires if instant < bound]
                assert last_fire_before(schedule, start, bound) == walked[-1], bound
                assert count_fires(schedule, start, walked[-1], walk_limit=1000) == len(walked)
                assert count_fires(schedule, start, walked[-1], walk_limit=2) in (len(walked), None)


def test_a_one_shot_fires_once_and_is_done() -> None:
    plan = Plan()
    job = Job(name="once", handler="test.echo", schedule_kind=ScheduleKind.ONCE, run_at=NOW,
              id="00000000-0000-0000-0000-000000000002", next_run_time=NOW)  # fmt: skip
    plan_job(job, NOW, LoopSettings(), plan)
    assert statuses(plan) == ["queued"]
    assert plan.advances[0].new is None


def test_the_last_misfire_of_a_burst_schedule_is_found_in_few_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every second of local hour 0, then 23 quiet hours: walking the window that holds the burst
    # would be 3,600 steps; the bisection takes about a hundred at most.
    schedule = parse_cron("* * 0 * * *", "Europe/Paris")
    steps = 0
    real = schedule_module._next_local

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal steps
        steps += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(schedule_module, "_next_local", counted)
    first = datetime(2026, 5, 31, 22, 0, tzinfo=UTC)  # 00:00 in Paris (UTC+2)
    for bound, expected in [
        (datetime(2026, 6, 1, 18, tzinfo=UTC), datetime(2026, 5, 31, 22, 59, 59, tzinfo=UTC)),
        (datetime(2026, 5, 31, 22, 30, 0, 500, tzinfo=UTC), datetime(2026, 5, 31, 22, 30, tzinfo=UTC)),
        (datetime(2026, 6, 2, 21, tzinfo=UTC), datetime(2026, 6, 1, 22, 59, 59, tzinfo=UTC)),
    ]:
        steps = 0
        assert last_fire_before(schedule, first, bound) == expected
        assert steps < 200, f"{steps} walk steps"  # O(log): a walk takes 3,600+
