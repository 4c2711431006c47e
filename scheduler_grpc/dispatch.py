"""Moving runs that PostgreSQL has queued into their Redis queues (the second half of the outbox).

Used by the leader (scan, reconcile), and by the API (trigger, backfill, dead-letter requeue).
Enqueueing is idempotent per run id, so doing it twice (a retry, a reconcile racing a scan) is safe.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta

from redis.asyncio import Redis

from scheduler_grpc import events, metrics, script_calls, stores
from scheduler_grpc.db.executions import Queued
from scheduler_grpc.errors import Unavailable
from scheduler_grpc.events import EventType, ExecutionEvent
from scheduler_grpc.executions import Execution
from scheduler_grpc.handlers import breaker_key
from scheduler_grpc.items import item_data
from scheduler_grpc.keys import WorkerKeys
from scheduler_grpc.ports import CancelStore
from scheduler_grpc.queue import CALL_TIMEOUT, LimitDefinition, NewItem, Queue
from scheduler_grpc.sharded import ShardedQueue
from scheduler_grpc.sharding import ShardMap

log = logging.getLogger(__name__)

# The definitions of named limits (`limit_sync.Definitions`): what an enqueue of runs that carry
# limit keys writes along with them, so a queue never waits for the definitions of its work.
DefinitionSource = Callable[[Iterable[str]], Awaitable[list[LimitDefinition]]]

# Bound on announcing and enqueueing runs already committed (each Redis call has its own bound too).
DISPATCH_TIMEOUT = timedelta(seconds=15)


class Queues:
    """One `Queue` object per queue name, created on first use.

    Args:
        redis: The client every queue uses (their scripts are registered once per client).
        capacity: Most queues kept; past it the least recently used is dropped (and made again if
            asked for: a `Queue` holds no state of its own). None keeps every queue: for the
            leader, whose names come from the jobs. A server, whose names come from requests (any
            valid name a viewer asks about), must bound them.
        definitions: Where `enqueue_runs` finds the definitions of the limits its runs carry
            (None: the runs go without them, and wait for `put_limit_definitions`).
        shard_map: The queues' shard counts (`sharding.py`); None: every queue has one shard.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        capacity: int | None = None,
        definitions: DefinitionSource | None = None,
        shard_map: ShardMap | None = None,
    ) -> None:
        self._redis = redis
        self.shard_map = shard_map or ShardMap()
        self._capacity = capacity
        self._queues: OrderedDict[str, ShardedQueue] = OrderedDict()
        self.definitions = definitions

    @property
    def client(self) -> Redis:
        """The client every queue uses."""
        return self._redis

    def get(self, name: str) -> ShardedQueue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = ShardedQueue(self._redis, name, shard_map=self.shard_map)
            if self._capacity is not None and len(self._queues) > self._capacity:
                self._queues.popitem(last=False)
        elif self._capacity is not None:
            self._queues.move_to_end(name)
        return queue

    def known(self, also: Iterable[str] = ()) -> list[Queue]:
        """The queues kept (every one asked for, without a capacity), after adding `also`'s."""
        for name in also:
            self.get(name)
        return list(self._queues.values())


def queue_item(run: Queued, now: datetime) -> NewItem:
    """The queue item of a run: its id, its priority, as data its breaker key (the handler's name, or
    `http.webhook:<host>`: a worker leaves work of an open breaker in the queue without claiming it)
    and its slot (`items.item_data`: the worker's statements then read one partition), and a delay
    if it is not due yet (a retry's backoff, a future one-shot)."""
    delay = run.due_at - now if run.due_at > now else None
    key = item_data(run.breaker_key or breaker_key(run.handler, run.payload), run.scheduled_for)
    return NewItem(run.run_id, run.priority, key, delay if delay and delay > timedelta(0) else None, run.limits)


async def enqueue_runs(queues: Queues, runs: Sequence[Queued], now: datetime | None = None) -> int:
    """Enqueue runs, one script call per queue; returns how many were new to Redis.

    Runs that carry limit keys take the definitions of their limits along (`Queues.definitions`),
    written in the same script call; runs without limits cost nothing more.
    """
    added = 0
    for name, items, definitions in await _by_queue(queues, runs, now or datetime.now(UTC)):
        added += await queues.get(name).enqueue_many(items, definitions)
    return added


async def _by_queue(
    queues: Queues, runs: Sequence[Queued], now: datetime
) -> list[tuple[str, list[NewItem], list[LimitDefinition]]]:
    """The runs' items by queue, each queue's with the definitions of the limits its runs carry."""
    by_queue: dict[str, list[NewItem]] = defaultdict(list)
    named: dict[str, set[str]] = defaultdict(set)
    for run in runs:
        by_queue[run.queue].append(queue_item(run, now))
        if run.limits:
            named[run.queue].update(limit.limit for limit in run.limits)
    found: dict[str, LimitDefinition] = {}
    if named and queues.definitions is not None:
        found = {d.name: d for d in await queues.definitions(set().union(*named.values()))}
    return [
        (name, items, [found[limit] for limit in sorted(named.get(name, ())) if limit in found])
        for name, items in by_queue.items()
    ]


def created_events(runs: Sequence[Queued]) -> list[ExecutionEvent]:
    """The CREATED event of each new run (its first attempt's execution id is the run id)."""
    return [
        ExecutionEvent(EventType.CREATED, run.run_id, run.run_id, run.job_id, 1, handler=run.handler) for run in runs
    ]


async def dispatch_new_runs(redis: Redis, queues: Queues, runs: Sequence[Queued], now: datetime | None = None) -> int:
    """Announce new runs (CREATED), then enqueue them; returns how many were new to Redis.

    CREATED goes to the events stream before the run is in its queue, so no worker can claim it and
    publish STARTED first: a watcher sees CREATED before any later event of the run. If the enqueue
    then fails, PostgreSQL still has the run queued and the leader's reconcile enqueues it.
    """
    if not runs:
        return 0
    now = now or datetime.now(UTC)
    # Encoded straight from the runs, at one time for the batch, and without reading the stream ids
    # back: ~2 us per run less than `publish(created_events(runs))` (a BatchTriggerJobs call has 1,000).
    stamp = now.isoformat()
    encoded = [
        events.encode_fields(EventType.CREATED, run.run_id, run.run_id, run.job_id, 1, handler=run.handler,
                             worker_id="", error="", time=stamp)
        for run in runs
    ]  # fmt: skip
    if not (queues.client is redis and script_calls.together(redis)):
        await events.publish_encoded(redis, encoded, ids=False)
        return await enqueue_runs(queues, runs, now)
    # One server: the publish and every enqueue in one round trip, in this order.
    calls = [events.add_call(redis, encoded)]
    for name, items, definitions in await _by_queue(queues, runs, now):
        calls += await queues.get(name).enqueue_calls(items, definitions)
    try:
        async with asyncio.timeout(CALL_TIMEOUT.total_seconds()):
            replies = await script_calls.run_together(redis, calls)
    except Exception as exc:
        if not stores.is_unreachable(exc):
            raise
        raise Unavailable(f"Redis did not answer the enqueue of {len(runs)} runs: {exc or 'timed out'}") from exc
    return sum(int(reply) for reply in replies[1:])


async def dispatch_committed(redis: Redis, queues: Queues, runs: Sequence[Queued]) -> bool:
    """`dispatch_new_runs` for runs PostgreSQL has committed, for a caller that must get them: a
    failure is logged and counted (`scheduler_enqueue_deferred_total`), never raised, because the
    runs exist and the leader's reconcile enqueues them. Failing the call instead would invite a
    retry, and a retry without a request id runs the job twice.

    Returns:
        Whether the runs were announced and enqueued now.
    """
    try:
        async with asyncio.timeout(DISPATCH_TIMEOUT.total_seconds()):
            await dispatch_new_runs(redis, queues, runs)
    except Exception as exc:
        metrics.ENQUEUE_DEFERRED.inc(len(runs))
        metrics.store_error(exc)
        extra = {"runs": len(runs), "run_ids": [run.run_id for run in runs[:10]]}
        if stores.is_fault(exc):
            log.warning("enqueue after commit failed; reconcile enqueues the runs: %r", exc, extra=extra)
        else:  # not an outage: a bug, but the runs are committed all the same
            log.exception("enqueue after commit failed; reconcile enqueues the runs", extra=extra)
        return False
    return True


async def cancel_runs(
    redis: Redis,
    queues: Queues,
    executions: CancelStore,
    queue: str,
    run_ids: Sequence[str],
    *,
    term: int | None = None,
) -> list[Execution]:
    """Cancel runs: queued ones leave the queue at once; running ones are cancelled by their workers
    (asked on the cancel channel; each records `cancelled` when its handler has stopped).

    With `term` (the leader's `replace` policy) the PostgreSQL part is fenced by that leader term
    and raises `Fenced` without changing anything once it is stale; the Redis moves follow only
    what was committed.

    Returns the latest attempt of each run as it stands now.
    """
    if term is None:
        cancelled, running = await executions.cancel_runs(run_ids)
    else:
        async with executions.fenced(term) as fenced:
            cancelled, running = await fenced.cancel_runs(run_ids)
    if cancelled:
        await queues.get(queue).remove_many([execution.run_id for execution in cancelled])
        await events.publish(redis, [
            ExecutionEvent(EventType.CANCELLED, e.id, e.run_id, e.job_id, e.attempt) for e in cancelled
        ])  # fmt: skip
    if running:
        pipe = redis.pipeline(transaction=False)
        for execution in running:
            # PUBLISH by name: a cluster pipeline refuses its `publish` method (it cannot route a
            # channel), but routes the command by the channel's slot, and any node broadcasts it.
            pipe.execute_command("PUBLISH", WorkerKeys().cancel, execution.run_id)
        await pipe.execute()
    return [*cancelled, *running]
