"""The console's queue depth sampler: while the console serves, `Control.sample_queue_depths` once a
minute (one server process records each minute; see `scheduler_grpc.queue_depth`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

from scheduler_grpc import stores
from scheduler_grpc.control import Control

log = logging.getLogger(__name__)

INTERVAL: Final = 60.0
"""Seconds between samples: the minute `Control.sample_queue_depths` records one sample per queue for."""


@contextlib.asynccontextmanager
async def sampling(
    control: Control, clock: Callable[[], float] = time.time, interval: float = INTERVAL
) -> AsyncIterator[None]:
    """Sample queue depths every `interval` while the block runs (a supervised task, cancelled at exit)."""

    async def loop(tick: Callable[[], Awaitable[bool]]) -> None:
        failing = False
        while True:
            # First at the next minute boundary, not at start-up: a starting server has enough to do.
            await asyncio.sleep(interval - clock() % interval)
            try:
                await tick()
                failing = False
            except Exception as exc:
                # A store that does not answer: log once, try again next minute.
                if not stores.is_fault(exc):
                    raise
                if not failing:
                    log.warning("queue depth sampling failed; retrying each minute", extra={"error": repr(exc)})
                failing = True

    task = asyncio.create_task(loop(lambda: control.sample_queue_depths(clock())), name="console-depth-sampler")

    def crashed(done: asyncio.Task[None]) -> None:
        if not done.cancelled() and done.exception() is not None:
            log.error("queue depth sampling stopped", exc_info=done.exception())

    task.add_done_callback(crashed)
    try:
        yield
    finally:
        task.cancel()
        # Waits without raising the task's outcome; a cancellation of this block still propagates.
        await asyncio.wait({task})
