"""The worker's stages around the execute stage: fetch, claim, complete, extend (and give up lost
leases), cancel. Each is a loop that asks the run tracker what to do and tells it what happened;
every loop rides out store faults (counted, logged once per `STORE_ERROR_LOG_EVERY`, backed off)
and ends the role only on a bug."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from redis.asyncio.cluster import RedisCluster

from scheduler_grpc import metrics, stores, tracing
from scheduler_grpc.db.executions import REFUSED_ERROR, Claim, Completed
from scheduler_grpc.events import EventType
from scheduler_grpc.executions import DeadReason, ExecutionStatus, Trigger
from scheduler_grpc.items import item_breaker_key, item_slot
from scheduler_grpc.keys import WorkerKeys
from scheduler_grpc.queue import Lease
from scheduler_grpc.worker.attempt import Attempt, with_start
from scheduler_grpc.worker.executor import Executor
from scheduler_grpc.worker.lifecycle import State, Stop
from scheduler_grpc.worker.support import (
    BATCH_WAIT,
    CANCEL_POLL_INTERVAL,
    COMPLETION_BATCH,
    COMPLETION_RETRY_FOR,
    FETCH_WAIT,
    MS,
    PUBLISH_BATCH,
    RESERVE_BATCH,
    DueStarts,
    Shared,
    StoreTrouble,
    faulted,
    log,
)

# Attempts these make are never a flow run's downstream runs (a flow run's root has no upstreams):
# the claim path asks PostgreSQL for upstream results only for the others (upstream, retry, ...).
_ROOT_TRIGGERS = frozenset({Trigger.SCHEDULE, Trigger.MANUAL, Trigger.BACKFILL})
_WORKER_KEYS = WorkerKeys()
_EVENT_OF = {
    ExecutionStatus.SUCCEEDED: EventType.SUCCEEDED,
    ExecutionStatus.FAILED: EventType.FAILED,
    ExecutionStatus.TIMED_OUT: EventType.TIMED_OUT,
    ExecutionStatus.DEAD: EventType.DEAD,
    ExecutionStatus.CANCELLED: EventType.CANCELLED,
}

Batch = tuple[list[Attempt], float]  # leased runs and the monotonic time their dequeue replied


async def give_back(shared: Shared, leases: Sequence[Lease], fetched: float) -> None:
    """Return unclaimed leases to the queue, their deliveries given back: a ready item to ready, a
    reserved one delayed until its due time (ready, any worker would start it early)."""
    elapsed = timedelta(seconds=time.monotonic() - fetched)
    # A millisecond more: the queue's clock reads whole milliseconds.
    retries = [
        (lease, max(lease.due_in - elapsed + MS, timedelta(0)) if lease.due_in is not None else timedelta(0))
        for lease in leases
    ]
    await shared.queue.finish_many(retries=retries)


async def give_back_runs(shared: Shared, runs: Sequence[Attempt], fetched: float) -> None:
    """`give_back` for tracked LEASED/RESERVED runs, which then end HANDED_BACK (LAPSED if even
    that fails: their leases expire, the leader recovers the items)."""
    end = State.LAPSED
    try:
        await give_back(shared, [run.lease for run in runs], fetched)
        end = State.HANDED_BACK
    finally:
        for run in runs:
            shared.tracker.end(run, end)


class Fetcher:
    """Leases as many items as there are free slots (and reservations), in one blocking script call,
    and hands each batch to the claim stage through a one-batch buffer (so the next batch is leased
    while the previous one is claimed).

    Solo deliveries (`Lease.solo`): a reply that says a solo item waits (`solo_waiting`) makes it
    stop fetching until the worker holds nothing, then dequeue once as idle, which may bring the
    solo item alone; then it goes on as before, whatever it got.
    """

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        self.claiming: asyncio.Queue[Batch] = asyncio.Queue(maxsize=1)
        self._min_batch = max(1, shared.tracker.concurrency // 4)
        self._solo_waiting = False

    async def loop(self) -> None:
        shared = self._shared
        trouble = StoreTrouble("taking work", shared.id)
        while True:
            if not await self._wait_for_room():
                continue
            try:
                batch = await self._fetch()
                trouble.recovered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis failing: the leases expire, nothing is lost
                if not stores.is_fault(exc):
                    raise
                await asyncio.sleep(trouble.failed(exc))
                continue
            if not batch[0]:
                continue
            try:
                await self.claiming.put(batch)
            except BaseException:  # stopping while the claim stage is busy: hand the batch back now
                with contextlib.suppress(Exception):
                    await give_back_runs(shared, *batch)
                raise

    async def _fetch(self) -> Batch:
        """One dequeue for the free slots (and reservations), booked first; what it leased, tracked.
        A lease the booking has no room for any more (held runs came due and took the slots
        meanwhile) goes straight back."""
        shared, tracker = self._shared, self._shared.tracker
        reservations = 0
        if shared.settings.worker_reserve_ahead:
            reservations = min(RESERVE_BATCH, tracker.reservation_room())
        free = self._free()
        tracker.book(free, reservations)
        runs: list[Attempt] = []
        extra: list[Lease] = []
        try:
            leases = await self._dequeue(free, reservations)
            fetched = time.monotonic()
            for lease in leases:
                run = Attempt(lease)
                if tracker.lease(run):
                    runs.append(run)
                else:
                    extra.append(lease)
        finally:
            tracker.end_booking()
        if extra:
            shared.spawn(self._give_back_extra(extra, fetched), name="give-back")
        return runs, fetched

    async def _give_back_extra(self, leases: list[Lease], fetched: float) -> None:
        try:
            await give_back(self._shared, leases, fetched)
        except Exception as exc:
            faulted(exc, "give back leases", self._shared.id)

    def _free(self) -> int:
        """The free slots, bounded by the worker's `capacity` (a remote worker's credit) if any."""
        free = self._shared.tracker.free_slots()
        capacity = self._shared.capacity
        return free if capacity is None else min(free, capacity())

    async def _wait_for_room(self) -> bool:
        """Wait until slots are free (after a reply saying a solo item waits: until the worker holds
        nothing, so the next dequeue is an idle one); False: look again."""
        tracker = self._shared.tracker
        if self._solo_waiting:
            while not tracker.idle:
                await self._slots_changed()
            self._solo_waiting = False
            return self._free() > 0  # (a remote worker's credit may be spent)
        if self._free() <= 0:
            await self._slots_changed()
            return False
        if self._free() < self._min_batch and tracker.running:
            # A few slots free while others are about to be: wait a moment for them, so a busy
            # worker leases (and claims, records) in batches rather than one item at a time.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(BATCH_WAIT):
                    while self._free() < self._min_batch:
                        await self._slots_changed()
            if self._free() <= 0:  # held runs came due meanwhile and took the slots
                return False
        return True

    async def _slots_changed(self) -> None:
        self._shared.slot_free.clear()
        await self._shared.slot_free.wait()

    def _held(self) -> int:
        """Reservations held that are not due yet (the queue's fair share counts them)."""
        return self._shared.tracker.count(State.RESERVED, State.HELD)

    async def _dequeue(self, free: int, reservations: int) -> list[Lease]:
        shared = self._shared
        window = shared.settings.worker_reserve_ahead if reservations else timedelta(0)
        leases = await shared.queue.dequeue_blocking(
            shared.id, shared.settings.visibility_timeout, free, FETCH_WAIT,
            reserve=window, reserve_count=reservations, idle=shared.tracker.idle,
            held=self._held,
        )  # fmt: skip
        self._solo_waiting = leases.solo_waiting
        return leases


class Claimer:
    """Claims each leased batch in PostgreSQL (one statement) and hands the claims to the execute
    stage; items whose breaker is open go back first, delayed, without spending an attempt; items
    with nothing left to run are acked away."""

    def __init__(self, shared: Shared, fetcher: Fetcher, executor: Executor) -> None:
        self._shared = shared
        self._claiming = fetcher.claiming
        self._executor = executor

    async def loop(self) -> None:
        shared = self._shared
        trouble = StoreTrouble("claiming work", shared.id)
        while True:
            runs, fetched = await self._claiming.get()
            try:
                await self._take(runs, fetched)
                trouble.recovered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # PostgreSQL or Redis failing: the leases expire, nothing is lost
                if not stores.is_fault(exc):
                    raise
                await asyncio.sleep(trouble.failed(exc))
            finally:
                # Neither claimed nor given back (a store failed on the way): the leases lapse.
                for run in runs:
                    if run.state in (State.LEASED, State.RESERVED):
                        shared.tracker.end(run, State.LAPSED)
                self._claiming.task_done()

    async def _take(self, runs: list[Attempt], fetched: float) -> None:
        wanted = await self._defer_blocked(runs, fetched)
        if not wanted:
            return
        began = time.time_ns() if tracing.enabled else 0
        claims, replied = await self._claim(wanted, fetched)
        by_run = {claim.run_id: claim for claim in claims}
        claimed: list[Attempt] = []
        nothing_to_do: list[Attempt] = []
        for run in wanted:
            claim = by_run.get(run.id)
            if claim is None:
                nothing_to_do.append(run)
            else:
                run.claim = claim
                claimed.append(run)
        if began:
            _trace_claims(claimed, began, self._shared.id)
        self._executor.start(claimed, replied)
        self._shared.stats.claimed += len(claimed)
        if nothing_to_do:  # finished meanwhile, or its job was deleted
            await self._shared.queue.ack_many([run.lease for run in nothing_to_do])
            for run in nothing_to_do:
                self._shared.tracker.end(run, State.DROPPED)

    async def _defer_blocked(self, runs: list[Attempt], fetched: float) -> list[Attempt]:
        """Give back the items whose breaker is open (after its wait, never before a reserved item's
        due time); returns the others."""
        shared = self._shared
        deferred: dict[timedelta, list[Attempt]] = {}
        wanted: list[Attempt] = []
        for run in runs:
            wait = shared.breakers.blocked_for(item_breaker_key(run.lease.data))
            if wait > timedelta(0):
                deferred.setdefault(wait, []).append(run)
            else:
                wanted.append(run)
        for wait, group in deferred.items():
            await _pause_host_keys(shared, group, wait)  # first: no run of those keys is taken meanwhile
            if any(run.reserved for run in group):
                elapsed = timedelta(seconds=time.monotonic() - fetched)
                await shared.queue.finish_many(retries=[
                    (run.lease, max(wait, (run.lease.due_in or timedelta(0)) - elapsed + MS)) for run in group
                ])  # fmt: skip
            else:
                await shared.queue.nack_many([run.lease for run in group], wait, count_delivery=False)
            shared.stats.breaker_deferred += len(group)
            for run in group:
                shared.tracker.end(run, State.HANDED_BACK)
        return wanted

    async def _claim(self, runs: list[Attempt], fetched: float) -> tuple[list[Claim], float]:
        """One statement claims `runs` under their lease tokens (and one more fetches the upstream
        results of flow runs' downstream runs); on any failure the leases go back first. Returns the
        claims and the monotonic time the claim replied (a held run's due time counts from it)."""
        shared = self._shared
        items = [(run.id, run.token) for run in runs]
        # A ready run starts at its lease, the instant its limits admitted it, not at this claim.
        leased_at = [run.lease.leased_at for run in runs]
        # Each run's slot, from its item: the claim reads one partition per run.
        slots = [item_slot(run.lease.data) for run in runs]
        try:
            if any(run.reserved for run in runs):
                reserved = [run.reserved for run in runs]
                claims = await shared.runs.claim(items, shared.id, reserved=reserved, leased_at=leased_at, slots=slots)
            else:  # a batch without reservations pays nothing for them
                claims = await shared.runs.claim(items, shared.id, leased_at=leased_at, slots=slots)
            replied = time.monotonic()
            flow_runs = [claim.run_id for claim in claims if claim.trigger not in _ROOT_TRIGGERS]
            if flow_runs:  # a flow run's downstream runs: their handlers get the upstream results
                upstream = await shared.runs.upstream_results(flow_runs)
                claims = [
                    replace(claim, upstream_results=upstream[claim.run_id]) if claim.run_id in upstream else claim
                    for claim in claims
                ]
        except BaseException:
            await give_back_runs(shared, runs, fetched)
            raise
        return claims, replied


def _trace_claims(claimed: Sequence[Attempt], began: int, worker_id: str) -> None:
    """A `run.claim` span per claimed run that has a trace (a child of the span that made it),
    over the batch's claim statement."""
    for run in claimed:
        claim = run.claim
        if claim.trace_context is None:
            continue
        tracing.start(
            "run.claim",
            parent=tracing.parent(claim.trace_context),
            start_time=began,
            attributes={"scheduler.run_id": claim.run_id, "scheduler.execution_id": claim.execution_id,
                        "scheduler.attempt": claim.attempt, "scheduler.worker_id": worker_id,
                        "scheduler.claim_batch": len(claimed), "scheduler.reserved": run.reserved},
        ).end()  # fmt: skip


class Completer:
    """Takes outcomes in batches: one statement records them (only under the claim token, so an
    attempt whose lease was lost cannot overwrite its replacement), then one script call tells the
    queue (acks, retries with backoff, dead letters). Recording that fails is retried (the leases
    kept meanwhile) for up to COMPLETION_RETRY_FOR, then let go: the runs run again elsewhere."""

    def __init__(self, shared: Shared, dues: DueStarts) -> None:
        self._shared = shared
        self._dues = dues
        self._durations: dict[str, Any] = {}  # handler -> its EXECUTION_DURATION child
        self._settled = asyncio.Event()

    async def loop(self) -> None:
        shared = self._shared
        while True:
            await shared.outbox.room()  # events not published yet bound how far recording runs ahead
            while not shared.tracker.has_finished():
                self._settled.set()
                shared.outcomes.clear()
                await shared.outcomes.wait()
            self._settled.clear()
            await self._dues.give_way()  # an instant's held runs start first
            batch = shared.tracker.take_finished(COMPLETION_BATCH)
            try:
                await self._complete(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not stores.is_fault(exc):
                    raise
                log.warning("could not record outcomes, giving up: %r", exc,
                            extra={"worker_id": shared.id, "count": len(batch)})  # fmt: skip
            finally:
                for run in batch:
                    if run.state is State.RECORDING:
                        shared.tracker.end(run, State.LAPSED)
                metrics.WORKER_SLOTS.labels("busy").set(shared.tracker.running)

    async def settled(self) -> None:
        """Wait until no outcome waits or is being recorded."""
        while self._shared.tracker.count(State.FINISHED, State.RECORDING):
            self._settled.clear()
            await self._settled.wait()

    async def _complete(self, batch: list[Attempt]) -> None:
        shared = self._shared
        until = time.monotonic() + COMPLETION_RETRY_FOR.total_seconds()
        # A reserved run's real start goes with its outcome (set here, off its start path).
        outcomes = []
        for run in batch:
            assert run.outcome is not None  # a FINISHED run has its outcome
            outcomes.append(run.outcome if run.started_at is None else with_start(run.outcome, run.started_at))
        tries = 0

        async def record() -> list[Completed]:
            nonlocal tries
            tries += 1  # a try after a failed one may follow a lost reply: then look for its record
            return await shared.runs.complete(outcomes, resent=tries > 1)

        recorded = await shared.retrying("recording outcomes", record, until)
        tell = _QueueReport(shared)
        completed = {c.execution_id: c for c in recorded}
        for run in batch:
            tell.add(run, completed.get(run.claim.execution_id))
        tell.count(self._durations)
        # One script call for the whole batch; safe to repeat: a lease already acted on answers
        # "lost" and changes nothing.
        await shared.retrying(
            "finishing queue items", lambda: shared.queue.finish_many(tell.acks, tell.retries, tell.deaths), until
        )
        shared.outbox.add(tell.events)
        shared.tracker.end_all(batch, State.RECORDED)


class _QueueReport:
    """What one recorded batch tells the queue, the event stream and the metrics."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        self.acks: list[Lease] = []
        self.retries: list[tuple[Lease, timedelta]] = []
        self.deaths: list[tuple[Lease, str]] = []
        self.events: list[bytes] = []
        self._counts: dict[tuple[str, str], int] = {}
        self._durations: dict[str, list[float]] = {}
        self._now = datetime.now(UTC).isoformat()
        self._debug = log.isEnabledFor(logging.DEBUG)

    def add(self, run: Attempt, done: Completed | None) -> None:
        outcome, claim, shared = run.outcome, run.claim, self._shared
        assert outcome is not None
        self._durations.setdefault(claim.handler, []).append(run.seconds)
        if done is None:
            shared.stats.lost_leases += 1  # another attempt replaced this one: change nothing
            return
        status, error, retry_after, dead = outcome.status, outcome.error, outcome.retry_after, outcome.dead_reason
        if done.status is not status:  # the store refused the outcome's values: recorded dead instead
            status, error, retry_after, dead = done.status, REFUSED_ERROR, None, DeadReason.PERMANENT
        if self._debug:
            log.debug(
                "attempt finished",
                extra={"execution_id": claim.execution_id, "job_id": claim.job_id, "attempt": claim.attempt,
                       "worker_id": shared.id, "status": status.value},
            )  # fmt: skip
        key = (status.value, claim.handler)
        self._counts[key] = self._counts.get(key, 0) + 1
        self.events.append(shared.event(_EVENT_OF[status], claim, error=error or "", now=self._now))
        if retry_after is not None:
            # The delivery is given back: only stalls count towards the stall limit.
            self.retries.append((run.lease, retry_after))
            metrics.RETRIES.labels(claim.handler).inc()
            if done.retry_execution_id is not None:
                self.events.append(
                    shared.event(EventType.RETRYING, claim, execution_id=done.retry_execution_id,
                                 attempt=claim.attempt + 1, now=self._now)
                )  # fmt: skip
        elif status is ExecutionStatus.DEAD:
            self.deaths.append((run.lease, error or "dead"))
            metrics.DEAD_LETTERED.labels(dead or DeadReason.PERMANENT).inc()
        else:
            self.acks.append(run.lease)

    def count(self, children: dict[str, Any]) -> None:
        """The batch's counters and duration histograms (a child per handler, looked up once:
        `labels()` takes a lock)."""
        stats = self._shared.stats
        stats.completed += sum(self._counts.values())
        for (status_value, handler), count in self._counts.items():
            stats.by_status[status_value] = stats.by_status.get(status_value, 0) + count
            metrics.EXECUTIONS.labels(status_value, handler).inc(count)
        for handler, seconds in self._durations.items():
            duration = children.get(handler)
            if duration is None:
                duration = children[handler] = metrics.EXECUTION_DURATION.labels(handler)
            metrics.observe_many(duration, seconds)


class Leases:
    """Keeps the leases of every run the worker holds (one script call every third of the
    visibility timeout), and gives up the runs whose lease was lost: their tasks stop and their
    attempts are recorded `abandoned` (the run goes on in a new attempt wherever its item is now)."""

    def __init__(self, shared: Shared, executor: Executor) -> None:
        self._shared = shared
        self._executor = executor

    async def loop(self) -> None:
        shared = self._shared
        interval = shared.settings.visibility_timeout.total_seconds() / 3
        trouble = StoreTrouble("extending leases", shared.id)
        pause = interval
        while True:
            await asyncio.sleep(pause)
            pause = interval
            runs = shared.tracker.extendable()
            if not runs:
                continue
            try:
                deadlines = await shared.queue.extend_many([r.lease for r in runs], shared.settings.visibility_timeout)
                trouble.recovered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # READONLY, BUSY, OOM, unreachable: try again soon, never die of it
                if not stores.is_fault(exc):
                    raise
                pause = min(trouble.failed(exc), interval)
                continue
            # Only runs with a task are stopped; the others end soon by themselves (an outcome from
            # a lost lease is refused by its claim token) or are found lost again once claimed.
            lost = [r for r, deadline in zip(runs, deadlines, strict=True) if deadline is None]
            lost = [r for r in lost if shared.tracker.request_stop(r, Stop.LOST)]
            if lost:
                # In a task of its own: a handler slow to stop (a process's kill grace, a
                # plugin's clean-up) must not hold up the extension of every other lease.
                shared.spawn(self._give_up(lost), name="give-up")

    async def _give_up(self, lost: list[Attempt]) -> None:
        shared = self._shared
        await self._executor.stop(lost, Stop.LOST)
        losing = [run for run in lost if run.state is State.LOSING]
        if not losing:
            return
        end = State.LAPSED
        try:
            until = time.monotonic() + COMPLETION_RETRY_FOR.total_seconds()
            items = [(r.claim.execution_id, r.token) for r in losing]
            slots = [r.claim.scheduled_for for r in losing]
            await shared.retrying("abandoning lost attempts", lambda: shared.runs.abandon(items, slots=slots), until)
            end = State.ABANDONED
            shared.stats.lost_leases += len(losing)
            log.warning("leases lost; attempts abandoned", extra={"worker_id": shared.id, "runs": len(losing)})
        except Exception as exc:
            faulted(exc, "abandon lost attempts", shared.id)
        finally:
            for run in losing:
                shared.tracker.end(run, end)


class Cancels:
    """Cancels runs on request (CancelExecution, the `replace` concurrency policy): pub/sub makes it
    fast, a poll of the running attempts' persisted requests (`CANCEL_POLL_INTERVAL`) certain."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared

    async def listen(self) -> None:
        """The fast path. A message missed (sent before the run was tracked, or while reconnecting)
        is still honoured by `poll`, which reads the persisted request."""
        shared = self._shared
        trouble = StoreTrouble("cancel channel", shared.id)
        while True:
            pubsub = shared.redis.pubsub(ignore_subscribe_messages=True)
            try:
                if isinstance(shared.redis, RedisCluster):
                    await shared.redis.initialize()  # as `leader._subscribe` does, for redis-py's sake
                await pubsub.subscribe(_WORKER_KEYS.cancel)
                trouble.recovered()
                while True:
                    message = await pubsub.get_message(timeout=5.0)
                    if message is not None:
                        self.on_request(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarting: subscribe again
                if not stores.is_fault(exc):
                    raise
                await asyncio.sleep(trouble.failed(exc))
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def poll(self) -> None:
        """Every CANCEL_POLL_INTERVAL, one query: which of our runs' attempts have a cancel request."""
        shared = self._shared
        trouble = StoreTrouble("polling cancel requests", shared.id)
        pause = CANCEL_POLL_INTERVAL.total_seconds()
        while True:
            await asyncio.sleep(pause)
            pause = CANCEL_POLL_INTERVAL.total_seconds()
            stoppable = shared.tracker.stoppable()
            by_execution = {r.claim.execution_id: r.id for r in stoppable}
            if not by_execution:
                continue
            try:
                requested = await shared.runs.cancel_requested(
                    [r.claim.execution_id for r in stoppable], slots=[r.claim.scheduled_for for r in stoppable]
                )
                trouble.recovered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not stores.is_fault(exc):
                    raise
                pause = max(pause, trouble.failed(exc))
                continue
            for execution_id in requested:
                self.on_request(by_execution[execution_id])

    def on_request(self, data: bytes | str) -> None:
        run_id = data.decode() if isinstance(data, bytes) else str(data)
        run = self._shared.tracker.get(run_id)
        if run is not None and self._shared.tracker.request_stop(run, Stop.CANCEL):
            log.info("cancelling on request", extra={"run_id": run_id, "worker_id": self._shared.id})
            assert run.task is not None  # a run in a state with a task
            run.task.cancel()


async def publish_loop(shared: Shared, dues: DueStarts) -> None:
    """Publish the outbox's events, oldest first, in batches (each after the held runs due then have
    started, `DueStarts.give_way`); a batch that cannot be published within COMPLETION_RETRY_FOR
    (or by the end of a stop) is dropped, logged: the changes it describes are recorded in
    PostgreSQL."""
    while True:
        batch = await shared.outbox.take(PUBLISH_BATCH)
        await dues.give_way()
        until = time.monotonic() + COMPLETION_RETRY_FOR.total_seconds()
        try:
            await shared.retrying(
                "publishing events", functools.partial(shared.events.publish_encoded, batch, ids=False), until
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not stores.is_fault(exc):
                raise
            log.warning("could not publish events, dropping them: %r", exc,
                        extra={"worker_id": shared.id, "count": len(batch)})  # fmt: skip
        finally:
            shared.outbox.done()


async def _pause_host_keys(shared: Shared, runs: Sequence[Attempt], wait: timedelta) -> None:
    """Runs deferred for an open breaker on a webhook host (`http.webhook:<host>`) pause the limit
    keys they carry that equal the host until the breaker half-opens (issue 22): the other runs of
    those keys then wait in the queue instead of being fetched and deferred one by one."""
    by_host: dict[str, list[str]] = {}
    for run in runs:
        handler, _, host = item_breaker_key(run.lease.data).partition(":")
        if handler == "http.webhook" and host:
            by_host.setdefault(host, []).append(run.id)
    for host, ids in by_host.items():
        await shared.queue.pause_keys_equal(ids, host, wait)
