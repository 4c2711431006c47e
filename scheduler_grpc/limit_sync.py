"""Limit definitions and held units in the queues (issue 22): what PostgreSQL defines, Redis enforces.

The queues' scripts admit a run with limit keys only under a definition in the queue's `limdef`
hash, and block it while the definition is missing. Definitions reach every queue three ways:

* with the work: every enqueue of runs that carry limit keys writes the definitions those runs
  name in the same script call, where the queue has none (`Definitions`, a per-process cache read
  from PostgreSQL at most once per `CACHE_FOR` per limit: runs without limits never touch it; it
  only fills a gap, so a stale copy never replaces a newer definition);
* on a change: creating, updating (an override too) or deleting a limit puts or forgets it in
  every queue a job names (`LimitSync.push`, `forget`);
* by the leader: every reconcile puts every definition in those queues again (`LimitSync.put_all`),
  so a Redis that lost them (a FLUSHALL) blocks no run for longer than one reconcile.

After Redis loses a queue, the units of runs still running are lost too; the leader's reconcile
counts them again from PostgreSQL (`LimitSync.recount`), before it re-enqueues the queued runs, so
caps hold while those runs finish, and gives them back once PostgreSQL no longer has them running.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from scheduler_grpc.db.executions import limit_keys_from_json
from scheduler_grpc.db.limits import LimitRepository
from scheduler_grpc.dispatch import Queues
from scheduler_grpc.gcra import LimitDefinition
from scheduler_grpc.limits import Limit, LimitKind
from scheduler_grpc.queue import MAX_BATCH, Queue

log = logging.getLogger(__name__)

WAKE_MOST = 1000  # groups one put wakes per limit (lua/queue_limits.lua)
WAKE_ROUNDS = 100  # puts per reconcile at most, so one reconcile wakes up to 100,000 groups per limit
CACHE_FOR = 5.0
"""Seconds a process reuses a definition it read for the enqueue of runs that carry it (a copy
that only fills a queue lacking the definition: see the module docstring)."""


def definition_of(limit: Limit) -> LimitDefinition:
    """A stored limit as the queues' scripts read it."""
    return LimitDefinition(
        name=limit.name,
        kind="concurrency" if limit.kind is LimitKind.CONCURRENCY else "rate",
        limit=limit.limit,
        period=limit.period,
        burst=limit.burst,
        overrides={key: (value.limit, value.burst) for key, value in limit.overrides.items()},
    )


class Definitions:
    """The definitions of named limits, read from PostgreSQL and kept `CACHE_FOR` seconds (the
    `Queues` provider: enqueues of runs with limit keys carry the definitions they need)."""

    def __init__(self, limits: LimitRepository) -> None:
        self._limits = limits
        self._cache: dict[str, tuple[float, LimitDefinition]] = {}

    async def __call__(self, names: Iterable[str]) -> list[LimitDefinition]:
        now = time.monotonic()
        wanted = set(names)
        stale = [name for name in wanted if (hit := self._cache.get(name)) is None or now - hit[0] > CACHE_FOR]
        if stale:
            for limit in await self._limits.by_names(sorted(stale)):
                self._cache[limit.name] = (now, definition_of(limit))
            if len(self._cache) > 10_000:  # bounded: drop what is old
                self._cache = {k: v for k, v in self._cache.items() if now - v[0] <= CACHE_FOR}
        return [self._cache[name][1] for name in sorted(wanted) if name in self._cache]

    def forget(self, name: str) -> None:
        self._cache.pop(name, None)


class LimitSync:
    """Puts definitions in the queues and keeps the units of running runs counted.

    Args:
        limits: The limits table (and the runs' limit keys).
        queues: The process's queues.
    """

    def __init__(self, limits: LimitRepository, queues: Queues) -> None:
        self._limits = limits
        self._queues = queues

    async def _targets(self) -> list[Queue]:
        return [self._queues.get(name) for name in await self._limits.queue_names()]

    async def push(self, limits: Sequence[Limit]) -> None:
        """Put these definitions in every queue a job names (create, update, override)."""
        definitions = [definition_of(limit) for limit in limits]
        for queue in await self._targets():
            await queue.put_limit_definitions(definitions)

    async def forget(self, name: str) -> None:
        """Take a deleted limit's definition out of the queues, unless open runs still carry it
        (they would wait for ever without one). A copy left in a queue no job names any more is
        replaced by the leader's next `put_all` once a job there names a limit of that name again."""
        if await self._limits.in_use_by_open_runs(name):
            log.info("deleted limit kept in the queues while runs carry it", extra={"limit": name})
            return
        # The queues jobs name now, and those this process used (the last job on a queue may be gone).
        targets = {queue.name: queue for queue in [*await self._targets(), *self._queues.known()]}
        for queue in targets.values():
            await queue.delete_limit_definitions([name])

    async def put_all(self) -> int:
        """Put every definition in every queue a job names (the leader's reconcile); returns how many."""
        definitions = [definition_of(limit) for limit in await self._limits.every_limit()]
        if definitions:
            for queue in await self._targets():
                for start in range(0, len(definitions), MAX_BATCH):
                    chunk = definitions[start : start + MAX_BATCH]
                    # A put wakes at most 1,000 groups parked per limit (after a FLUSHALL, every
                    # group waits for its definition): put again while it woke that many.
                    for _ in range(WAKE_ROUNDS):
                        if await queue.put_limit_definitions(chunk) < WAKE_MOST:
                            break
        return len(definitions)

    async def recount(self) -> tuple[int, set[str]]:
        """Count again the concurrency units of running runs that Redis lost, and give back those
        counted before whose runs are no longer running.

        Returns:
            How many runs were counted again now, and the runs still counted (the caller must not
            enqueue them: their queue item would take its units a second time).
        """
        held: set[str] = set()
        for queue in self._queues.known():
            counted = await queue.recounted()
            if counted:
                running = await self._limits.running_with_limits(counted)
                done = [run_id for run_id in counted if run_id not in running]
                if done:
                    await queue.unhold(done)
                held.update(running)
        recounted = 0
        after: str | None = None
        while True:
            page = await self._limits.running_runs_with_limits(after_run_id=after, limit=MAX_BATCH)
            by_queue: dict[str, list[tuple[str, object]]] = {}
            for run_id, name, keys in page:
                by_queue.setdefault(name, []).append((run_id, keys))
            for name, runs in by_queue.items():
                queue = self._queues.get(name)
                states = await queue.states(run_id for run_id, _ in runs)
                lost = [(run_id, limit_keys_from_json(keys)) for run_id, keys in runs if states.get(run_id) is None]
                if lost:
                    recounted += await queue.hold_running(lost)
                    held.update(run_id for run_id, _ in lost)
            if len(page) < MAX_BATCH:
                break
            after = page[-1][0]
        if recounted:
            log.warning("units of running runs counted again after Redis lost them", extra={"runs": recounted})
        for queue in self._queues.known():
            await queue.mark_limits_synced()
        return recounted, held

    async def lost(self) -> bool:
        """Whether a queue has lost the leader's mark since its last `recount` (Redis lost its
        data: a FLUSHALL, a failover to an empty replica). One HEXISTS per queue."""
        for queue in self._queues.known():
            if not await queue.limits_synced():
                return True
        return False


__all__ = ["CACHE_FOR", "Definitions", "LimitSync", "definition_of"]
