"""Recording gives way to starting: while held runs are due and not started yet, the completion and
publish stages wait (`DueStarts.give_way`, bounded), so an instant's crowd of held runs starts
before the outcomes of its first runs are recorded beside it on the same cores (issue 25's
lateness). Pure logic on a real event loop: no store is involved."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

from scheduler_grpc.queue import Lease
from scheduler_grpc.worker.attempt import Attempt
from scheduler_grpc.worker.lifecycle import RunTracker, State
from scheduler_grpc.worker.support import GIVE_WAY_MAX, DueStarts


def held(tracker: RunTracker[Attempt], dues: DueStarts, run_id: str, due: float) -> Attempt:
    """A run reserved, claimed and held until the monotonic `due`."""
    lease = Lease(run_id, f"t-{run_id}", b"", 0, 1, datetime.now(UTC), due_in=timedelta(seconds=1))
    run = Attempt(lease)
    tracker.book(0, 1)
    assert tracker.lease(run)
    tracker.end_booking()
    tracker.claimed(run)
    assert run.state is State.HELD
    run.due = due
    dues.add(run)
    return run


def finishes_at_once(dues: DueStarts) -> bool:
    """Whether `give_way` returns without waiting at all (its first step ends it)."""
    step = dues.give_way().__await__()
    try:
        next(step)
    except StopIteration:
        return True
    step.close()
    return False


async def turns(task: asyncio.Task[None], count: int = 20) -> None:
    for _ in range(count):  # loop turns, not time: the task had every chance to end
        await asyncio.sleep(0)


async def test_nothing_due_soon_costs_no_wait() -> None:
    tracker: RunTracker[Attempt] = RunTracker(1, finished_max=4, reserve_max=10)
    dues = DueStarts()
    assert finishes_at_once(dues)  # no held run at all
    held(tracker, dues, "later", time.monotonic() + 60)
    assert finishes_at_once(dues)


async def test_recording_waits_until_the_held_runs_due_now_have_started() -> None:
    tracker: RunTracker[Attempt] = RunTracker(2, finished_max=4, reserve_max=10)
    dues = DueStarts()
    now = time.monotonic()
    first, second = held(tracker, dues, "first", now - 0.001), held(tracker, dues, "second", now)
    held(tracker, dues, "later", now + 60)
    waiting = asyncio.create_task(dues.give_way())
    await turns(waiting)
    assert not waiting.done(), "two held runs are due and have not started"
    assert tracker.due(first)  # started: RUNNING
    await turns(waiting)
    assert not waiting.done()
    assert tracker.due(second)
    async with asyncio.timeout(GIVE_WAY_MAX * 20):
        await waiting
    assert finishes_at_once(dues)


async def test_a_held_run_waiting_for_a_slot_does_not_hold_recording_up() -> None:
    """A due run without a free slot (STARTING) may be waiting for what recording frees."""
    tracker: RunTracker[Attempt] = RunTracker(1, finished_max=4, reserve_max=10)
    dues = DueStarts()
    now = time.monotonic()
    first, second = held(tracker, dues, "first", now), held(tracker, dues, "second", now)
    assert tracker.due(first)
    assert not tracker.due(second)  # the one slot is taken
    assert second.state is State.STARTING
    assert finishes_at_once(dues)


async def test_the_wait_is_bounded_when_a_due_run_does_not_start() -> None:
    tracker: RunTracker[Attempt] = RunTracker(1, finished_max=4, reserve_max=10)
    dues = DueStarts()
    held(tracker, dues, "stuck", time.monotonic())
    waiting = asyncio.create_task(dues.give_way())
    await turns(waiting)
    assert not waiting.done()
    async with asyncio.timeout(GIVE_WAY_MAX * 20):  # it ends by itself after GIVE_WAY_MAX
        await waiting
