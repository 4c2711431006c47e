"""The execute stage: one supervised task per claimed run, from its start (or its hold, for a
reservation) to its outcome, and the hand-backs of runs that stop without one."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from scheduler_grpc import metrics, tracing
from scheduler_grpc.breakers import BreakerOpen
from scheduler_grpc.db.executions import Claim
from scheduler_grpc.errors import SchedulerError
from scheduler_grpc.events import EventType
from scheduler_grpc.executions import DeadReason, ExecutionStatus, Trigger
from scheduler_grpc.handlers import ExecutionContext, HandlerRegistry, HandlerSettings, RateLimited, breaker_key
from scheduler_grpc.items import item_breaker_key
from scheduler_grpc.worker.attempt import Attempt, Deadline, HandBack, failed, run_handler, run_handler_traced
from scheduler_grpc.worker.lifecycle import State, Stop
from scheduler_grpc.worker.support import MS, DueStarts, Maintenance, Shared, faulted, log, sleep_until

_LATENESS_TRIGGERS = frozenset({Trigger.SCHEDULE, Trigger.MANUAL})


class Executor:
    """Runs claimed attempts, each in a task of its own, supervised (a bug in one ends the role),
    and drives each run's lifecycle from its start to its outcome (`RunTracker.finished`) or its
    hand-back. Every end of a run's task, however it ends, goes through `_ended`."""

    def __init__(self, shared: Shared, registry: HandlerRegistry, maintenance: Maintenance) -> None:
        self._shared = shared
        self._registry = registry
        self._handler_settings = HandlerSettings.from_settings(shared.settings)
        self._maintenance = maintenance
        self._grace = shared.settings.worker_reserve_grace.total_seconds()
        self._held_started: list[Attempt] = []  # started in this turn of the loop (`_started_held`)
        self.dues = DueStarts()  # when the held runs come due: recording gives way to their starts

    # -- starting ------------------------------------------------------------------------------------

    def start(self, runs: Sequence[Attempt], replied: float) -> None:
        """Claimed runs (their `claim` set): the ready ones start now (their STARTED events added
        first, so each precedes its end in the stream), the reserved ones are held."""
        shared = self._shared
        ready = [run for run in runs if not run.reserved]
        now = datetime.now(UTC).isoformat()
        shared.outbox.add([shared.event(EventType.STARTED, run.claim, now=now) for run in ready])
        deadlines: dict[timedelta, Deadline] = {}
        admissions: dict[str, int] = {}
        for run in runs:
            shared.tracker.claimed(run)
            if run.claim.limits:
                for name in {limit.limit for limit in run.claim.limits}:
                    admissions[name] = admissions.get(name, 0) + 1
            if run.reserved:
                assert run.claim.clock is not None  # a claim with reservations reads the clock
                run.due = replied + max((run.claim.started_at - run.claim.clock).total_seconds(), 0.0)
                self.dues.add(run)
                self._spawn(run, self._hold(run, replied))
                continue
            timeout = run.claim.timeout
            deadline = deadlines.get(timeout)
            if deadline is None:
                count = sum(1 for other in ready if other.claim.timeout == timeout)
                deadline = deadlines[timeout] = Deadline(timeout.total_seconds(), count)
            run.deadline = deadline
            self._spawn(run, self._execute_traced(run) if tracing.enabled else self._execute(run))
        for name, count in admissions.items():  # one labelled child per limit and batch, not per run
            metrics.LIMIT_ADMISSIONS.labels(name).inc(count)
        self.observe_starts([run.claim for run in ready])

    def _spawn(self, run: Attempt, body: Coroutine[Any, Any, None]) -> None:
        # Supervised by `_ended` rather than the task group: one done callback per run, not two.
        run.task = asyncio.get_running_loop().create_task(body)
        run.task.add_done_callback(functools.partial(self._ended, run))

    def granted(self, run: Attempt) -> None:
        """The tracker gave a STARTING run its slot: wake its task."""
        waiter = run.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- a run's task --------------------------------------------------------------------------------

    async def _hold(self, run: Attempt, replied: float) -> None:
        """A reserved run, claimed ahead: wait for its due time on the database clock, take a slot,
        run it. Handed back (`unreserve`) if its breaker is open then, or if no slot frees up
        within the reserve grace.

        The claim says when the run is due (`started_at`, the later of its `due_at` and the claim's
        clock) and what the database clock read (`clock`); the wait is their difference less the
        time since the reply: late by the reply's transfer, never early, whatever the host clocks.
        """
        shared, claim = self._shared, run.claim
        assert claim.clock is not None
        await sleep_until(run.due)
        wait = shared.breakers.blocked_for(item_breaker_key(run.lease.data))
        if wait > timedelta(0):
            shared.stats.breaker_deferred += 1
            shared.tracker.returning(run)
            await self.unreserve([run], wait)
            return
        if not shared.tracker.due(run) and not await self._slot(run):
            log.warning("no slot for a reserved run within the grace; handed back",
                        extra={"run_id": run.id, "worker_id": shared.id})  # fmt: skip
            shared.tracker.returning(run)
            await self.unreserve([run])
            return
        # Started: the slot is ours. Its STARTED event is added before its handler can end (the
        # outcome's event waits for the completion stage).
        run.started_at = max(claim.started_at, claim.clock + timedelta(seconds=time.monotonic() - replied))
        run.deadline = Deadline(claim.timeout.total_seconds(), 1)
        self._started_held(run)
        await (self._execute_traced(run) if tracing.enabled else self._execute(run))

    async def _slot(self, run: Attempt) -> bool:
        """Wait for the slot of a STARTING run until the reserve grace is over; True once granted."""
        left = run.due + self._grace - time.monotonic()
        if left > 0:
            run.waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(left):
                    await run.waiter
            except TimeoutError:
                pass
            finally:
                run.waiter = None
        return run.state is State.RUNNING  # granted, even if the grace ran out meanwhile

    async def _execute_traced(self, run: Attempt) -> None:
        """`_execute` under the attempt's `run.attempt` span (a child of the span that made the run,
        whose `traceparent` the claim read), current while it runs; a run made while tracing was
        off has no trace to join and runs untraced."""
        claim = run.claim
        if claim.trace_context is None:
            await self._execute(run)
            return
        span = tracing.start(
            "run.attempt",
            parent=tracing.parent(claim.trace_context),
            kind="CONSUMER",
            attributes={
                "scheduler.run_id": claim.run_id, "scheduler.execution_id": claim.execution_id,
                "scheduler.job_id": claim.job_id, "scheduler.job_name": claim.job_name,
                "scheduler.attempt": claim.attempt, "scheduler.handler": claim.handler,
                "scheduler.trigger": claim.trigger.value, "scheduler.worker_id": self._shared.id,
            },
        )  # fmt: skip
        try:
            with tracing.current(span):
                await self._execute(run, traced=True)
            if run.outcome is not None:
                span.set_attribute("scheduler.status", run.outcome.status.value)
                if failed(run.outcome):
                    tracing.span_error(span, run.outcome.error or run.outcome.status.value)
        except BaseException as exc:
            tracing.span_error(span, "cancelled" if isinstance(exc, asyncio.CancelledError) else repr(exc))
            raise
        finally:
            span.end()

    async def _execute(self, run: Attempt, *, traced: bool = False) -> None:
        """A started run: its handler under its breaker (with its span when `traced`); its outcome to
        the completion stage."""
        shared, claim = self._shared, run.claim
        try:
            handler = self._registry.get(claim.handler)
            breaker = shared.breakers.get(handler.breaker_key(claim.payload))
            breaker.admit()
        except BreakerOpen as exc:
            # Rare since the item carries its breaker key (checked before the claim): the breaker
            # opened between that check and now. Not a failure and no retry spent: recorded
            # `interrupted`, the next attempt due (and the item back in the queue) after the wait.
            shared.tracker.returning(run)
            await self._defer(run, exc)
            return
        except SchedulerError as exc:  # unknown handler (plugin removed): a permanent failure
            outcome = run.end_with(ExecutionStatus.DEAD, error=str(exc), dead=DeadReason.PERMANENT)
        else:
            try:
                if not traced:
                    outcome = await run_handler(run, handler, self._context(run))
                else:
                    outcome = await run_handler_traced(run, handler, self._context(run))
            except RateLimited as exc:
                # Back-pressure, not a failure: the breaker does not count it, no attempt is spent.
                shared.tracker.returning(run)
                await self._throttle(run, exc)
                return
            except HandBack as exc:  # never this worker's to run: back as it was
                shared.tracker.returning(run)
                await self._unspent(run, exc)
                return
            breaker.record(failed(outcome))  # a cancelled attempt counts neither way
        run.outcome = outcome
        shared.tracker.finished(run)

    def _context(self, run: Attempt) -> ExecutionContext:
        claim = run.claim
        return ExecutionContext(
            execution_id=claim.execution_id,
            job_id=claim.job_id,
            job_name=claim.job_name,
            attempt=claim.attempt,
            scheduled_for=claim.scheduled_for,
            timeout=claim.timeout,
            upstream_results=claim.upstream_results,
            run_id=claim.run_id,
            claim_token=run.token,
            settings=self._handler_settings,
            maintenance=self._maintenance,
            log=logging.LoggerAdapter(
                log,
                {
                    "execution_id": claim.execution_id,
                    "job_id": claim.job_id,
                    "attempt": claim.attempt,
                    "worker_id": self._shared.id,
                },
            ),
        )

    def _ended(self, run: Attempt, task: asyncio.Task[None]) -> None:
        """The task of `run` is over, however it ended (even cancelled before its first step, when
        none of its own code ran): its deadline is told, a stop we asked for moves the run on, and
        an exception (a bug) ends the role."""
        if not task.cancelled() and (error := task.exception()) is not None:
            self._shared.fail(error)
            return
        try:
            if run.deadline is not None:
                run.deadline.finished()
            if not task.cancelled():
                return
            if run.stop is Stop.CANCEL and run.state is State.RUNNING:
                run.outcome = run.end_with(ExecutionStatus.CANCELLED, error="cancelled")
            # A task cancelled without a stop of ours (`abort`: the role is ending on a bug) stays as it is.
            if self._shared.tracker.stopped(run) is State.RETURNING and run.stop is Stop.CANCEL:
                # A held run cancelled on request: recorded cancelled (it never ran).
                self._shared.spawn(self.unreserve([run]), name="cancel-held")
        except BaseException as exc:  # in a callback: raising would only be logged
            self._shared.fail(exc)

    # -- hand-backs ----------------------------------------------------------------------------------

    async def _throttle(self, run: Attempt, exc: RateLimited) -> None:
        """A handler said "rate limited, retry after T": the attempt goes back to `queued` unspent
        (`unclaim`: the attempt count does not move), and the item back to the queue without
        counting the delivery, its limit keys paused for T (`nack(retry_after=)`: the other runs of
        those keys wait too, runs of other keys go on); a run without limit keys waits T itself.
        A run whose cancel was requested meanwhile is recorded `cancelled` instead."""
        shared, claim, lease = self._shared, run.claim, run.lease
        shared.stats.throttled += 1
        for name in {limit.limit for limit in claim.limits}:
            metrics.LIMIT_THROTTLE_WAITS.labels(name).inc()
        end = State.LAPSED
        try:
            statuses = await shared.runs.unclaim([(claim.execution_id, lease.token)], slots=[claim.scheduled_for])
            status = statuses.get(claim.execution_id)
            wait = max(exc.retry_after, MS)
            if status is ExecutionStatus.QUEUED:
                await shared.queue.nack(lease.id, lease.token, count_delivery=False, retry_after=wait)
                end = State.HANDED_BACK
            elif status is ExecutionStatus.CANCELLED:
                await shared.queue.finish_many([lease])
                shared.outbox.add([shared.event(EventType.CANCELLED, claim, error="cancelled")])
                end = State.HANDED_BACK
            extra = {"run_id": claim.run_id, "retry_after_s": wait.total_seconds(), "reason": exc.reason}
            log.info("rate limited by the upstream; handed back", extra=extra)
        except Exception as error:
            faulted(error, "hand back a rate-limited run", shared.id)
        finally:
            shared.tracker.end(run, end)

    async def _unspent(self, run: Attempt, exc: HandBack) -> None:
        """A run that was never this worker's to run goes back as it was: its attempt to `queued`
        (`unclaim`: no attempt, no retry budget spent), its item back to the queue without counting
        the delivery, due after `exc.delay` (no limit key paused, no throttle wait counted: not
        back-pressure). A run whose cancel was requested meanwhile is recorded `cancelled` instead."""
        shared, claim, lease = self._shared, run.claim, run.lease
        shared.stats.unspent += 1
        end = State.LAPSED
        try:
            statuses = await shared.runs.unclaim([(claim.execution_id, lease.token)], slots=[claim.scheduled_for])
            status = statuses.get(claim.execution_id)
            if status is ExecutionStatus.QUEUED:
                await shared.queue.nack(lease.id, lease.token, exc.delay, count_delivery=False)
                end = State.HANDED_BACK
            elif status is ExecutionStatus.CANCELLED:
                await shared.queue.finish_many([lease])
                shared.outbox.add([shared.event(EventType.CANCELLED, claim, error="cancelled")])
                end = State.HANDED_BACK
            log.debug("handed back unspent", extra={"run_id": claim.run_id, "reason": exc.reason})
        except Exception as error:
            faulted(error, "hand back a run unspent", shared.id)
        finally:
            shared.tracker.end(run, end)

    async def _defer(self, run: Attempt, exc: BreakerOpen) -> None:
        shared, claim, lease = self._shared, run.claim, run.lease
        shared.stats.breaker_deferred += 1
        end = State.LAPSED
        try:
            await self._pause_host_keys(claim, exc.retry_after)
            await shared.runs.release(
                [(claim.execution_id, lease.token)], reason=str(exc), delay=exc.retry_after, slots=[claim.scheduled_for]
            )
            await shared.queue.nack(lease.id, lease.token, exc.retry_after, count_delivery=False)
            shared.outbox.add([shared.event(EventType.INTERRUPTED, claim, error=str(exc))])
            end = State.HANDED_BACK
        except Exception as error:
            faulted(error, "defer a run", shared.id)
        finally:
            shared.tracker.end(run, end)

    async def _pause_host_keys(self, claim: Claim, wait: timedelta) -> None:
        """An open breaker on a webhook host pauses the limit keys of the run that equal that host
        (a limit keyed on the host: `key: payload.host` or the host as a constant) until the
        breaker half-opens, so the runs of those keys wait in the queue instead of coming here."""
        if not claim.limits:
            return
        _, _, host = breaker_key(claim.handler, claim.payload).partition(":")
        if claim.handler != "http.webhook" or not host:
            return
        for limit in claim.limits:
            if limit.key.lower() == host and wait > timedelta(0):
                await self._shared.queue.pause_key(limit.limit, limit.key, wait)

    async def unreserve(self, runs: Sequence[Attempt], delay: timedelta = timedelta(0)) -> None:
        """Hand back RETURNING held runs that never started: each attempt back to `queued`, unspent
        (or `cancelled` where a cancel was requested), each item back to the queue without counting
        the delivery, delayed until its due time if that is still ahead (and at least `delay`)."""
        if not runs:
            return
        shared = self._shared
        ends = dict.fromkeys(runs, State.LAPSED)
        try:
            statuses = await shared.runs.unclaim(
                [(r.claim.execution_id, r.token) for r in runs], slots=[r.claim.scheduled_for for r in runs]
            )
            now = time.monotonic()
            retries: list[tuple[Attempt, timedelta]] = []
            cancelled: list[Attempt] = []
            for run in runs:
                status = statuses.get(run.claim.execution_id)
                if status is ExecutionStatus.QUEUED:
                    ahead = timedelta(seconds=max(run.due - now, 0.0))
                    retries.append((run, max(delay, ahead + MS if ahead else ahead)))
                elif status is ExecutionStatus.CANCELLED:
                    cancelled.append(run)
                # None: no longer ours (lease lost, taken over): nothing to give back; it lapses.
            await shared.queue.finish_many([r.lease for r in cancelled], [(r.lease, wait) for r, wait in retries])
            stamp = datetime.now(UTC).isoformat()
            shared.outbox.add(
                [shared.event(EventType.CANCELLED, r.claim, error="cancelled", now=stamp) for r in cancelled]
            )
            for run in cancelled:
                metrics.EXECUTIONS.labels(ExecutionStatus.CANCELLED.value, run.claim.handler).inc()
            ends.update(dict.fromkeys([run for run, _ in retries] + cancelled, State.UNRESERVED))
        except Exception as exc:
            faulted(exc, "hand back reserved runs", shared.id)
        finally:
            for run, end in ends.items():
                shared.tracker.end(run, end)

    async def hand_back(self, runs: Sequence[Attempt]) -> None:
        """RETURNING runs interrupted by a stop are recorded `interrupted`, their runs get a `queued`
        next attempt, and their items go straight back to ready (not after the visibility timeout)."""
        if not runs:
            return
        shared = self._shared
        end = State.LAPSED
        try:
            await shared.runs.release(
                [(r.claim.execution_id, r.token) for r in runs], slots=[r.claim.scheduled_for for r in runs]
            )
            await shared.queue.nack_many([r.lease for r in runs], count_delivery=False)
            now = datetime.now(UTC).isoformat()
            shared.outbox.add([shared.event(EventType.INTERRUPTED, r.claim, now=now) for r in runs])
            end = State.HANDED_BACK
        except Exception as exc:
            faulted(exc, "hand back unfinished runs", shared.id)
        finally:
            for run in runs:
                shared.tracker.end(run, end)
        log.warning("handed back unfinished runs", extra={"worker_id": shared.id, "runs": len(runs)})

    def adopt(self, runs: Sequence[Attempt]) -> None:
        """Runs claimed by another holder that let them go (a remote worker's parked runs, resumed
        under their claim tokens; each with its `claim`) run here now, from where they are: no new
        start (their STARTED events were published), their job's timeout counted from their
        recorded start."""
        now = datetime.now(UTC)
        for run in runs:
            self._shared.tracker.adopt(run)
            left = run.claim.started_at + run.claim.timeout - now
            run.deadline = Deadline(max(left.total_seconds(), 0.0), 1)
            self._spawn(run, self._execute(run))

    # -- stopping ------------------------------------------------------------------------------------

    async def abort(self) -> None:
        """The role is ending on a bug: stop every run's task (what they hold lapses)."""
        tasks = [run.task for run in self._shared.tracker if run.task is not None and not run.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def stop(self, runs: Sequence[Attempt], why: Stop) -> list[Attempt]:
        """Cancel the tasks of `runs` for `why` and wait for them to end; returns those the stop
        moved on (the others ended by themselves, or had been asked to stop before)."""
        stopping = [run for run in runs if self._shared.tracker.request_stop(run, why)]
        tasks = [run.task for run in runs if run.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        return stopping

    async def release_held(self) -> None:
        """Stopping: hand back every held run that has not started."""
        held = self._shared.tracker.in_state(State.HELD, State.STARTING)
        if not held:
            return
        stopped = [run for run in await self.stop(held, Stop.SHUTDOWN) if run.state is State.RETURNING]
        await self.unreserve(stopped)
        log.info("handed back reserved runs", extra={"worker_id": self._shared.id, "runs": len(stopped)})

    async def drain(self, grace: timedelta) -> None:
        """Stopping: let running handlers finish within `grace`, then stop the rest and hand them back."""
        tasks = [run.task for run in self._shared.tracker.in_state(State.RUNNING) if run.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace.total_seconds())
        unfinished = self._shared.tracker.in_state(State.RUNNING)
        if unfinished:
            stopped = await self.stop(unfinished, Stop.SHUTDOWN)
            # A task that finished just before its cancellation reported its outcome: keep that.
            await self.hand_back([run for run in stopped if run.state is State.RETURNING])
        # Tasks still handing their runs back (a breaker's deferral, a cancelled reservation): their
        # writes are bounded by the stores' call timeouts.
        rest = [run.task for run in self._shared.tracker if run.task is not None and not run.task.done()]
        if rest:
            await asyncio.wait(rest)

    # -- metrics -------------------------------------------------------------------------------------

    def observe_starts(self, claims: Sequence[Claim], starts: Sequence[datetime] = ()) -> None:
        """Lateness and queue wait of attempts that started (at `starts`, default their claims'
        `started_at`: a ready run's lease instant)."""
        metrics.WORKER_SLOTS.labels("busy").set(self._shared.tracker.running)
        lateness: list[float] = []
        waits: list[float] = []
        for claim, started in zip(claims, starts or [c.started_at for c in claims], strict=True):
            # Scheduling lateness is a slot's or a trigger's: a backfill or a dead-letter requeue runs
            # a slot of the past on purpose, and its age would swamp the histogram.
            if claim.attempt == 1 and claim.trigger in _LATENESS_TRIGGERS:
                lateness.append(max((started - claim.scheduled_for).total_seconds(), 0.0))
            if claim.due_at is not None:
                waits.append(max((started - claim.due_at).total_seconds(), 0.0))
        metrics.observe_many(metrics.LATENESS, lateness)
        metrics.observe_many(metrics.QUEUE_WAIT, waits)

    def _started_held(self, run: Attempt) -> None:
        """A held run started: its STARTED event and metrics, gathered for all the held runs that
        start in this turn of the event loop (a crowd of them is due at one instant) and given out
        once, after them, off their start path."""
        if not self._held_started:
            asyncio.get_running_loop().call_soon(self._observe_held_starts)
        self._held_started.append(run)

    def _observe_held_starts(self) -> None:
        started, self._held_started = self._held_started, []
        claims = [r.claim for r in started]
        starts = [r.started_at or r.claim.started_at for r in started]
        shared = self._shared
        shared.outbox.add([
            shared.event(EventType.STARTED, claim, now=start.isoformat())
            for claim, start in zip(claims, starts, strict=True)
        ])  # fmt: skip
        self.observe_starts(claims, starts)
