"""The worker role: the stages wired around one run tracker, started and stopped together."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from scheduler_grpc import metrics, stores
from scheduler_grpc import registry as workers
from scheduler_grpc.breakers import BreakerPolicy, Breakers, BreakerState
from scheduler_grpc.config import Settings
from scheduler_grpc.connections import connect
from scheduler_grpc.db.history import HistoryRepository
from scheduler_grpc.db.queue_shards import QueueShardRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.events import RedisEventBus
from scheduler_grpc.handlers import HandlerRegistry, HandlerSettings, default_registry, handler_of_breaker_key
from scheduler_grpc.ports import HistoryPruning, RunStore
from scheduler_grpc.registry import HEARTBEAT_INTERVAL
from scheduler_grpc.sharded import ShardedQueue
from scheduler_grpc.sharding import ShardMap
from scheduler_grpc.worker.attempt import Attempt
from scheduler_grpc.worker.executor import Executor
from scheduler_grpc.worker.lifecycle import RunTracker
from scheduler_grpc.worker.stages import Cancels, Claimer, Completer, Fetcher, Leases, publish_loop
from scheduler_grpc.worker.support import Maintenance, Shared, StoreTrouble, WorkerStats, log

DEFAULT_METRICS_PORT = 9100
# The cyclic garbage collector's first threshold for a busy worker (Python's default: 700). Each run
# allocates a task, its coroutines, a claim, an outcome, a context, events...: at 700 a worker
# draining a few thousand runs a second collected its youngest generations ~300 times per 20,000
# runs, ~0.25 s of CPU (~12 us per run, measured with gc.callbacks); at 5,000 about 10 times, ~0.03 s.
GC_THRESHOLD = (5_000, 20, 20)
_BREAKER_SEVERITY = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class Worker:
    """Executes runs from one queue with `concurrency` slots.

    Args:
        redis: Client for the queue, events, heartbeats and the cancel channel.
        runs: The attempts in PostgreSQL (claims, completions, hand-backs, cancel requests): the
            worker's hot path needs nothing else of PostgreSQL, so a test can hand it a wrapped
            `RunRepository`.
        registry: The handlers this worker can run.
        settings: Process settings (visibility timeout, grace, breakers, ...).
        history: What `system.cleanup` prunes the execution history through.
        worker_id: Unique id of this worker process (default host:pid:random).
        identity: What its heartbeats say instead of this process's facts (`WorkerInfo` fields:
            a remote worker's session gives its peer's host, pid 0, its SDK, `remote`).
    """

    def __init__(
        self,
        redis: Redis,
        runs: RunStore,
        registry: HandlerRegistry,
        settings: Settings,
        *,
        history: HistoryPruning,
        worker_id: str | None = None,
        concurrency: int | None = None,
        identity: Mapping[str, Any] | None = None,
        shard_map: ShardMap | None = None,
    ) -> None:
        self.id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.concurrency = concurrency or settings.worker_concurrency
        # Every shard of the queue (`sharding.py`); without a map, the queue's one shard.
        self.queue = ShardedQueue(
            redis,
            settings.queue,
            shard_map=shard_map or ShardMap(),
            call_timeout=settings.connect_timeout,
            max_stalls=settings.max_stalls,
        )
        self.breakers = Breakers(
            BreakerPolicy(
                window=settings.breaker_window,
                min_calls=settings.breaker_min_calls,
                failure_ratio=settings.breaker_failure_ratio,
                reset_timeout=settings.breaker_reset_timeout,
            ),
            on_change=self._breaker_changed,
        )
        tracker: RunTracker[Attempt] = RunTracker(
            self.concurrency, finished_max=self.concurrency * 4, reserve_max=settings.worker_reserve_max
        )
        bus = RedisEventBus(redis)
        shared = self._shared = Shared(
            self.id,
            redis=redis,
            runs=runs,
            queue=self.queue,
            events=bus,
            settings=settings,
            breakers=self.breakers,
            tracker=tracker,
        )
        self._registry = registry
        self._executor = Executor(shared, registry, Maintenance(history, bus, self.queue))
        tracker.hooks(on_slots=shared.slot_free.set, on_granted=self._executor.granted, on_finished=shared.outcomes.set)
        self._fetcher = Fetcher(shared)
        self._completer = Completer(shared, self._executor.dues)
        self._started_at = datetime.now(UTC)
        self._identity = dict(identity or {})

    @property
    def stats(self) -> WorkerStats:
        return self._shared.stats

    @property
    def active(self) -> int:
        """Slots in use (handlers running)."""
        return self._shared.tracker.running

    @property
    def idle(self) -> bool:
        """Holding no run (leased, claimed, held, running or waiting to be recorded)."""
        return self._shared.tracker.idle

    # -- the role ----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Work until `stop` is set, then shut down gracefully."""
        shared = self._shared
        log.info("worker started", extra={"worker_id": self.id, "slots": self.concurrency, "queue": self.queue.name})
        cancels, leases = Cancels(shared), Leases(shared, self._executor)
        claimer = Claimer(shared, self._fetcher, self._executor)
        try:
            await self._run(stop, claimer, cancels, leases)
        finally:
            shared.group = None
            await self._executor.abort()  # (nothing left after a graceful stop)
        await self._unregister()
        log.info("worker stopped", extra={"worker_id": self.id})

    async def _run(self, stop: asyncio.Event, claimer: Claimer, cancels: Cancels, leases: Leases) -> None:
        shared = self._shared
        async with asyncio.TaskGroup() as group:
            shared.group = group
            fetching = group.create_task(self._fetcher.loop(), name="fetch")
            claiming = group.create_task(claimer.loop(), name="claim")
            loops = [
                group.create_task(self._completer.loop(), name="complete"),
                group.create_task(leases.loop(), name="extend-leases"),
                group.create_task(self._heartbeat_loop(), name="heartbeat"),
                group.create_task(cancels.listen(), name="cancel-listener"),
                group.create_task(cancels.poll(), name="cancel-poll"),
                group.create_task(publish_loop(shared, self._executor.dues), name="publish-events"),
            ]
            await stop.wait()
            log.info("worker stopping: no new work", extra={"worker_id": self.id, "active": self.active})
            shared.retry_until = time.monotonic() + shared.settings.shutdown_grace.total_seconds() + 5
            fetching.cancel()
            await asyncio.wait([fetching])
            await self._fetcher.claiming.join()  # what was leased is claimed (or handed back) first
            claiming.cancel()
            await self._executor.release_held()  # reserved runs not started yet go back at once, unspent
            await self._executor.drain(shared.settings.shutdown_grace)
            await self._completer.settled()
            await shared.outbox.flushed()  # bounded: the publisher gives up by `retry_until`
            for task in loops:
                task.cancel()

    # -- heartbeats, breakers ----------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        trouble = StoreTrouble("heartbeat", self.id)
        while True:
            try:
                await self._beat()
                trouble.recovered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not stores.is_fault(exc):
                    raise
                trouble.failed(exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL.total_seconds())

    async def _beat(self) -> None:
        facts: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), **self._identity}
        await workers.beat(self._shared.redis, workers.WorkerInfo(
            id=self.id, slots=self.concurrency, active=self.active,
            queue=self.queue.name, handlers=self._registry.names(), started_at=self._started_at,
            breakers={key: state.value for key, state in self.breakers.states().items()}, **facts,
        ), call_timeout=HEARTBEAT_INTERVAL)  # fmt: skip

    async def _unregister(self) -> None:
        with contextlib.suppress(Exception):
            await workers.unregister(self._shared.redis, self.id)

    def _breaker_changed(self, key: str, old: BreakerState, new: BreakerState) -> None:
        # Metrics by handler: a webhook host is not a bounded label. The handler shows its worst breaker.
        handler = handler_of_breaker_key(key)
        states = [new] + [
            state for other, state in self.breakers.states().items()
            if other != key and handler_of_breaker_key(other) == handler
        ]  # fmt: skip
        worst = max(states, key=_BREAKER_SEVERITY.__getitem__)
        metrics.BREAKER_STATE.labels(handler).set(metrics.BREAKER_VALUES[worst.value])
        metrics.BREAKER_TRANSITIONS.labels(handler, new.value).inc()
        level = logging.WARNING if new is BreakerState.OPEN else logging.INFO
        log.log(level, "circuit breaker %s: %s -> %s", key, old, new, extra={"breaker": key, "worker_id": self.id})


async def run_worker(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> int:
    """`scheduler-grpc worker`: execute jobs until SIGTERM/SIGINT."""
    port = settings.metrics_port if settings.metrics_port is not None else DEFAULT_METRICS_PORT
    # No session reset on release (a round trip per statement of the hot path): the worker's
    # statements leave no session state behind (SET LOCAL only, no LISTEN, no advisory locks).
    async with connect(settings, session_reset=False) as conns, metrics.serve(settings.metrics_host, port):
        registry = default_registry(HandlerSettings.from_settings(settings))
        try:
            worker = Worker(
                conns.redis, RunRepository(conns.pool), registry, settings,
                history=HistoryRepository(conns.pool), concurrency=args.concurrency,
                shard_map=ShardMap(QueueShardRepository(conns.pool).histories, lead=settings.queue_shard_lead),
            )  # fmt: skip
            # What start-up made (modules, the registry, pools) lives as long as the process: out of
            # the collector's sight, so a full collection does not walk it again and again.
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLD)
            metrics.WORKER_SLOTS.labels("total").set(worker.concurrency)
            metrics.WORKER_SLOTS.labels("busy").set(0)
            await worker.run(stop)
        except Exception:
            # Store errors never get here (every loop rides them out): this is a bug.
            log.exception("worker failed")
            raise
        finally:
            await registry.aclose()
    return 0
