"""One remote worker's stream, server side: a `Session` is one in-process `Worker` (the same
stages, run tracker, claims, leases, completions, breakers, cancels, limits and events) whose
handlers are the worker's (`RemoteHandler`), plus what only a stream has: credit, acks, pings.

* Credit: the worker grants credit (`on_credit`); each assignment spends one. The session's fetch
  is bounded by it (`Shared.capacity`): runs are not even leased without credit. The credit held
  plus the assignments without an outcome may never exceed the hello's slots (INVALID_ARGUMENT
  `credit.grant`, which ends the stream).
* Ack: an assignment not acknowledged within the ack timeout goes back unspent (`NotAcknowledged`,
  a `HandBack`: `unclaim`, `nack` without counting the delivery, no limit key paused).
* Outcome: the result is the handler's return value; an error raises `HandlerError` (retried by
  the job's policy) or `PermanentHandlerError`; `rate_limited` raises `RateLimited`. An outcome
  without a live assignment of this stream under its claim token is answered `Rejected`.
* Cancel: a cancel of the run's task (a cancel request, the job's timeout, a stop) sends `Cancel`
  to the worker, then the `CancelledError` goes on.
* Pings: every ping interval; two unanswered end the stream (a worker whose receive loop died cannot
  keep its leases).
* The end (any cause: a crash, a proxy, a network cut, unanswered pings, the server's stop, the
  worker closing its side, which the server cannot tell from its connection's loss): unacknowledged
  assignments go back unspent at once. Acknowledged ones are parked (`Stop.PARK`): let go as they
  are, nothing recorded, their leases no longer extended, so the leader recovers them once the
  leases expire (as a killed worker's runs), unless a new stream resumes them first. (The SDKs
  close their side only when they hold no run.)
* Resume (`resume`, before the welcome): the hello's held runs whose attempt is still `running`
  under the claim token (PostgreSQL) and whose lease still carries that token (Redis: extended
  again, which fails once the leader recovered it or another delivery holds it) are adopted by
  this session's worker (RUNNING under the same token, their job's timeout counted from their
  start): their outcomes, cancels and leases go through this stream. The others are refused,
  each with why. A session of this process still holding an adopted run lets it go (parked,
  nothing recorded); one in another process holds it only until its own stream is found dead
  (two unanswered pings), then parks it: both keep the same lease under the same token
  meanwhile, and an outcome is recorded once, under that token.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, cast

from redis.asyncio import Redis

from scheduler_grpc import outputs, stores
from scheduler_grpc.config import Settings
from scheduler_grpc.db.executions import Claim
from scheduler_grpc.errors import Aborted, InvalidArgument, Unavailable
from scheduler_grpc.handlers import ExecutionContext, HandlerError, PermanentHandlerError, RateLimited
from scheduler_grpc.ports import HistoryPruning, RunStore
from scheduler_grpc.queue import Lease
from scheduler_grpc.remote.handler import NotAcknowledged, SessionRegistry
from scheduler_grpc.remote.protocol import (
    Assignment,
    CancelOrder,
    Drain,
    Failed,
    Hello,
    Outbound,
    OutcomeReport,
    Ping,
    Rejected,
    Succeeded,
    Throttled,
    Welcome,
)
from scheduler_grpc.sharding import ShardMap
from scheduler_grpc.worker import State, Stop, Worker
from scheduler_grpc.worker.attempt import Attempt

log = logging.getLogger("scheduler_grpc.remote")

_CLOSED: Final = object()
_STOP_REASONS: Final = {
    Stop.CANCEL: "cancelled",
    Stop.LOST: "lease lost",
    Stop.SHUTDOWN: "stopping",  # the stream's end (or the server's stop): its runs are handed back
    Stop.PARK: "resumed on another stream",  # (never sent: the run goes on elsewhere)
}
# Messages waiting to go out beyond the assignments' own bound (rejections, pings, cancels): a
# worker that sends bad messages without reading the answers loses its stream.
OUTBOX_SLACK: Final = 256
ASSIGNMENT_BATCH: Final = 500  # most assignments in one message
# A fetch leases at most this share of the slots: a busy worker's credit comes back all at once (its
# no-op handlers end together), and a fetch of all of it would move the whole window in lockstep
# (lease, claim, send, run, report, then lease again); in parts, one part's lease and claim overlap
# the others' round trips to the worker. Measured (200 slots, no-op handlers, shared 2-core host):
# thirds ~10 % faster than halves, quarters no faster than thirds.
FETCH_SHARE: Final = 3


@dataclass(eq=False, slots=True)
class _Pending:
    """An assignment sent and not reported yet: `outcome` gets its report, or `NotAcknowledged`
    when it goes back unacknowledged (`_AckTimedOut` past `ack_by`, the loop's time)."""

    token: str
    run_id: str
    outcome: asyncio.Future[OutcomeReport]
    ack_by: float
    acked: bool = False
    cancelled: bool = False
    parked: bool = False  # let go: no cancel is sent, nothing is recorded


class _AckTimedOut(NotAcknowledged):
    """Not acknowledged within the ack timeout (the worker is told so by a cancel)."""


class Session:
    """One `Connect` stream's worker. Use `async with session.running():`; read `outbound()`; feed
    the worker's messages to `on_credit`, `on_ack`, `on_outcome`, `on_pong`.

    Args:
        hello: What the worker said first (checked: `protocol.check_hello`).
        redis: The server's Redis client (queue, events, heartbeats, cancel channel).
        runs: The attempts in PostgreSQL.
        history: What `system.cleanup` prunes through (never run remotely; the Worker needs it).
        settings: The server's settings (ack timeout, ping interval, visibility timeout, breakers).
        peer_host: The worker's host as the server sees it (for its id).
        on_adopted: Told of the runs (execution id: claim token) this session resumed, so that
            another session of this process still holding them lets them go.
    """

    def __init__(
        self,
        hello: Hello,
        *,
        redis: Redis,
        runs: RunStore,
        history: HistoryPruning,
        settings: Settings,
        peer_host: str,
        on_adopted: Callable[[Session, Mapping[str, str]], None] | None = None,
        shard_map: ShardMap | None = None,
    ) -> None:
        self.hello = hello
        self._runs = runs
        self._on_adopted = on_adopted
        self.id = f"remote:{peer_host}:{uuid.uuid4().hex[:8]}"
        self._ack_timeout = settings.remote_ack_timeout
        self._ping_interval = settings.remote_ping_interval
        self._lease_timeout = settings.visibility_timeout
        worker_settings = dataclasses.replace(
            settings,
            queue=hello.queue or settings.queue,
            # No grace: at a stream's end nobody can report an outcome any more.
            shutdown_grace=timedelta(0),
            # Reservations hold runs ahead of their due time; a remote worker gets runs when due.
            worker_reserve_ahead=timedelta(0),
        )
        self.worker = Worker(
            redis, runs, SessionRegistry(self, list(hello.handlers)), worker_settings,
            history=history, worker_id=self.id, concurrency=hello.slots,
            identity={"host": peer_host, "pid": 0, "remote": True,
                      "sdk": f"{hello.sdk}/{hello.sdk_version}" if hello.sdk_version else hello.sdk},
            shard_map=shard_map,
        )  # fmt: skip
        self._tracker = self.worker._shared.tracker
        self._slot_free = self.worker._shared.slot_free
        self.worker._shared.capacity = self._capacity
        self._fetch_most = max(1, hello.slots // FETCH_SHARE)
        self._credit = 0
        self._credit_changed = asyncio.Event()
        self._sent_live = 0  # assignments sent whose handler call has not returned
        self._pending: dict[str, _Pending] = {}  # by execution id
        # The unacknowledged ones, in the order sent (so by `ack_by`), watched by one timer for
        # the oldest rather than a timeout per assignment.
        self._unacked: dict[str, _Pending] = {}
        self._ack_timer: asyncio.TimerHandle | None = None
        self._adopting: dict[str, _Pending] = {}  # resumed runs whose task has not taken them yet
        self._resumed: list[str] = []
        self._refused: list[Rejected] = []
        self._outbox: collections.deque[Outbound | object] = collections.deque()
        self._outbox_ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._closing = False
        self._error: Exception | None = None
        self._nonce = 0
        self._answered = 0
        self.closed: asyncio.Future[None] | None = None  # the end's hand-back, once begun
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # done after it

    def drain(self, deadline: datetime) -> None:
        """The server is stopping: take no new work (no more assignments), finish by `deadline`."""
        self._closing = True
        self._credit = 0  # nothing more is leased; what is claimed meanwhile goes back unspent
        self._credit_changed.set()
        self._send(Drain(deadline))

    # -- lifetime ------------------------------------------------------------------------------------

    def welcome(self) -> Welcome:
        return Welcome(
            self.id, self._ack_timeout, self._lease_timeout, datetime.now(UTC), self._ping_interval,
            resumed=self._resumed, refused=self._refused,
        )  # fmt: skip

    # -- resume ----------------------------------------------------------------------------------------

    async def resume(self) -> None:
        """Adopt the hello's held runs that are still theirs to resume (before the welcome, which
        says which were and which not).

        Raises:
            Unavailable: a store failed (the worker reconnects and asks again).
        """
        held = {run.execution_id: (index, run.claim_token) for index, run in enumerate(self.hello.held)}
        if not held:
            return
        try:
            claims = await self._runs.resumable([(eid, token) for eid, (_, token) in held.items()])
            served = {spec.name for spec in self.hello.handlers}
            worker = self.worker
            wanted: list[tuple[Claim, str]] = []
            for claim in claims:
                index, token = held[claim.execution_id]
                if claim.handler not in served:
                    self._refuse(claim.execution_id, "INVALID_ARGUMENT", f"hello.held_runs[{index}].execution_id",
                                 f"its handler {claim.handler!r} is not among this hello's handlers")  # fmt: skip
                elif claim.queue != worker.queue.name:
                    self._refuse(claim.execution_id, "INVALID_ARGUMENT", f"hello.held_runs[{index}].execution_id",
                                 f"its queue is {claim.queue!r}, not this stream's {worker.queue.name!r}")  # fmt: skip
                else:
                    wanted.append((claim, token))
            # The lease decides: extended again under the token only while nobody took it back.
            deadlines = await worker.queue.extend_many([(c.run_id, t) for c, t in wanted], self._lease_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not stores.is_fault(exc):
                raise
            log.warning("could not resume held runs: %r", exc, extra={"worker_id": self.id})
            raise Unavailable("could not resume the held runs now (a store failed); reconnect") from None
        found = {claim.execution_id for claim in claims}
        for eid, (index, _) in held.items():
            if eid not in found:
                self._refuse(eid, "FAILED_PRECONDITION", f"hello.held_runs[{index}].claim_token",
                             "not running under this claim token (finished, handed back, taken over, or a foreign "
                             "token)")  # fmt: skip
        adopted: list[Attempt] = []
        loop = asyncio.get_running_loop()
        for (claim, token), deadline in zip(wanted, deadlines, strict=True):
            index = held[claim.execution_id][0]
            if deadline is None:
                self._refuse(claim.execution_id, "FAILED_PRECONDITION", f"hello.held_runs[{index}].claim_token",
                             "its lease expired: the run went back to the queue or another worker has it")  # fmt: skip
                continue
            attempt = Attempt(Lease(claim.run_id, token, b"", 0, 0, deadline))
            attempt.claim = claim
            pending = _Pending(token, claim.run_id, loop.create_future(), loop.time(), acked=True)
            self._pending[claim.execution_id] = self._adopting[claim.execution_id] = pending
            self._resumed.append(claim.execution_id)
            adopted.append(attempt)
        if adopted:
            if self._on_adopted is not None:
                self._on_adopted(self, {a.claim.execution_id: a.token for a in adopted})
            worker._executor.adopt(adopted)
            log.info("resumed held runs", extra={"worker_id": self.id, "runs": len(adopted)})

    def _refuse(self, execution_id: str, code: str, field: str, message: str) -> None:
        self._refused.append(Rejected(execution_id, code, field, message))

    def let_go(self, runs: Mapping[str, str]) -> None:
        """Runs (execution id: claim token) another stream resumed: those this session holds under
        the same token are parked (no cancel sent, nothing recorded)."""
        tracker = self._tracker
        for execution_id, token in runs.items():
            pending = self._pending.get(execution_id)
            if pending is None or pending.token != token:
                continue
            self._drop(execution_id, pending)
            pending.parked = True
            run = tracker.get(pending.run_id)
            if run is not None and run.token == token and tracker.request_stop(run, Stop.PARK):
                assert run.task is not None  # a RUNNING run has its task
                run.task.cancel()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Session]:
        """Run the session's worker and pings; on exit (however it is left) hand everything back."""
        worker = asyncio.create_task(self.worker.run(self._stop), name=f"remote-worker {self.id}")
        pings = asyncio.create_task(self._ping_loop(), name=f"remote-pings {self.id}")
        worker.add_done_callback(self._worker_ended)
        try:
            await self.resume()
            yield self
        finally:
            pings.cancel()
            # In a task of its own, shielded: the stream's task may be cancelled (the client went
            # away) while closing; `RemoteWorkers.drain` waits for it.
            self.closed = asyncio.ensure_future(self._close(worker))
            await asyncio.shield(self.closed)

    def _worker_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("remote worker's session failed", exc_info=error, extra={"worker_id": self.id})
            self.fail(Aborted("the server's worker for this stream failed; reconnect"))

    async def _close(self, worker: asyncio.Task[None]) -> None:
        self._closing = True
        # Acknowledged: parked, let go as they are for a new stream to resume (or their leases to expire).
        if self._ack_timer is not None:
            self._ack_timer.cancel()
        parked = [pending.run_id for pending in self._pending.values() if pending.acked]
        unacked = [p for p in self._pending.values() if not p.acked and not p.outcome.done()]
        for pending in unacked:
            pending.outcome.set_exception(NotAcknowledged("the stream ended before the assignment was acknowledged"))
        for pending in self._pending.values():
            pending.parked = True
        self._pending.clear()
        runs = [run for run in map(self._tracker.get, parked) if run is not None and run.state is State.RUNNING]
        with contextlib.suppress(Exception):
            stopped = await self.worker._executor.stop(runs, Stop.PARK)
            if stopped:
                log.info("parked the runs of an ended stream", extra={"worker_id": self.id, "runs": len(stopped)})
        self._stop.set()
        self._credit_changed.set()
        try:
            with contextlib.suppress(Exception):
                await worker
            self._end_outbox()
        finally:
            if not self.ended.done():
                self.ended.set_result(None)

    def fail(self, error: Exception) -> None:
        """End the stream with `error` (the servicer raises it once the outbound messages end)."""
        if self._error is None:
            self._error = error
        self._end_outbox()

    def end(self) -> None:
        """End the stream without an error (the worker closed its side)."""
        self._end_outbox()

    def _end_outbox(self) -> None:
        self._outbox.append(_CLOSED)
        self._outbox_ready.set()

    # -- outbound --------------------------------------------------------------------------------------

    def _send(self, message: Outbound) -> None:
        if len(self._outbox) > self.hello.slots + OUTBOX_SLACK:
            self.fail(Aborted("the worker does not read its stream; reconnect"))
            return
        self._outbox.append(message)
        self._outbox_ready.set()

    async def outbound(self) -> AsyncIterator[Outbound | list[Assignment]]:
        """The messages to send, until the session ends; then raises its error, if any. Assignments
        waiting one after another come as one list (one write for all of them)."""
        outbox = self._outbox
        while True:
            while not outbox:
                self._outbox_ready.clear()
                await self._outbox_ready.wait()
            message = outbox.popleft()
            if message is _CLOSED:
                break
            if isinstance(message, Assignment) and outbox and isinstance(outbox[0], Assignment):
                batch = [message]
                while outbox and isinstance(outbox[0], Assignment) and len(batch) < ASSIGNMENT_BATCH:
                    batch.append(cast(Assignment, outbox.popleft()))
                yield batch
                continue
            yield cast(Outbound, message)
        if self._error is not None:
            raise self._error

    async def _ping_loop(self) -> None:
        interval = self._ping_interval.total_seconds()
        while True:
            await asyncio.sleep(interval)
            if self._nonce - self._answered >= 2:
                log.warning("remote worker missed two pings; ending its stream", extra={"worker_id": self.id})
                self.fail(Aborted("no answer to two pings; the stream is ended (reconnect)"))
                return
            self._nonce += 1
            self._send(Ping(self._nonce))

    # -- the worker's messages -------------------------------------------------------------------------

    def on_credit(self, grant: int) -> None:
        """More credit.

        Raises:
            InvalidArgument: `credit.grant` below 1, or over the slots with what is held.
        """
        if grant < 1:
            raise InvalidArgument("credit.grant", f"must be at least 1, got {grant}")
        held = self._credit + len(self._pending)
        if held + grant > self.hello.slots:
            raise InvalidArgument(
                "credit.grant",
                f"{grant} more would make {held + grant} (credit {self._credit} + {len(self._pending)} assignments "
                f"without an outcome), over the hello's {self.hello.slots} slots",
            )
        self._credit += grant
        self._credit_changed.set()
        self._slot_free.set()

    def on_ack(self, execution_id: str, claim_token: str) -> None:
        """An assignment received. A late ack (the assignment went back) is answered by a cancel."""
        pending = self._pending.get(execution_id)
        if pending is None or pending.token != claim_token:
            self._send(CancelOrder(execution_id, "not acknowledged in time; the run went back to the queue"))
            return
        if not pending.acked:
            pending.acked = True
            self._unacked.pop(execution_id, None)  # (gone already if its ack timeout just passed)

    def on_outcome(self, report: OutcomeReport) -> None:
        """An assignment's end; one without a live assignment of this stream is answered `Rejected`."""
        pending = self._pending.get(report.execution_id)
        if pending is None:
            self._send(Rejected(report.execution_id, "NOT_FOUND", "outcome.execution_id",
                                "no assignment of this stream has this execution id (finished, handed back or "
                                "never sent)"))  # fmt: skip
            return
        if pending.token != report.claim_token:
            self._send(Rejected(report.execution_id, "FAILED_PRECONDITION", "outcome.claim_token",
                                "not the claim token of this assignment"))  # fmt: skip
            return
        del self._pending[report.execution_id]
        if isinstance(report.result, Succeeded):
            try:
                outputs.bound_result(report.result.value)
            except outputs.Unstorable as exc:
                self._send(Rejected(report.execution_id, "INVALID_ARGUMENT", "outcome.value", str(exc)))
                report = OutcomeReport(report.execution_id, report.claim_token, Failed(f"result refused: {exc}"))
        if not pending.acked:  # an outcome acknowledges too
            pending.acked = True
            self._unacked.pop(report.execution_id, None)
        if not pending.outcome.done():
            pending.outcome.set_result(report)

    def on_pong(self, nonce: int) -> None:
        self._answered = max(self._answered, min(nonce, self._nonce))

    # -- credit bounds the fetch -----------------------------------------------------------------------

    def _capacity(self) -> int:
        # Credit not yet spent, less the runs leased or claimed that have not been sent yet; at most
        # a share of the slots per fetch (FETCH_SHARE).
        unsent = self._tracker.count(State.LEASED) + self._tracker.running - self._sent_live
        return min(self._credit - max(unsent, 0), self._fetch_most)

    # -- a run's round trip (RemoteHandler.run) --------------------------------------------------------

    async def execute(self, handler: str, ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        """Send the assignment, wait for its ack (within the ack timeout) and its outcome."""
        pending = self._adopting.pop(ctx.execution_id, None) if self._adopting else None
        if pending is not None:  # resumed from an earlier stream: sent and acknowledged there
            self._sent_live += 1
            try:
                report = await pending.outcome
            except asyncio.CancelledError:
                self._cancelled(ctx, pending)
                raise
            finally:
                self._sent_live -= 1
            return _result(report)
        while self._credit <= 0 and not self._closing:
            self._credit_changed.clear()
            await self._credit_changed.wait()
        if self._closing:
            raise NotAcknowledged("the stream is ending")
        loop = asyncio.get_running_loop()
        pending = _Pending(
            ctx.claim_token, ctx.run_id, loop.create_future(), loop.time() + self._ack_timeout.total_seconds()
        )
        self._credit -= 1
        self._pending[ctx.execution_id] = pending
        self._unacked[ctx.execution_id] = pending
        if self._ack_timer is None:
            self._ack_timer = loop.call_at(pending.ack_by, self._ack_deadlines)
        self._sent_live += 1
        try:
            self._send(Assignment(
                run_id=ctx.run_id, execution_id=ctx.execution_id, job_id=ctx.job_id, job_name=ctx.job_name,
                attempt=ctx.attempt, claim_token=ctx.claim_token, handler=handler, payload=payload,
                deadline=datetime.now(UTC) + ctx.timeout, scheduled_for=ctx.scheduled_for,
            ))  # fmt: skip
            try:
                report = await pending.outcome
            except _AckTimedOut:
                self._drop(ctx.execution_id, pending)
                self._send(CancelOrder(ctx.execution_id, "not acknowledged in time; the run went back to the queue"))
                raise NotAcknowledged() from None
            except NotAcknowledged:
                self._drop(ctx.execution_id, pending)
                raise
        except asyncio.CancelledError:
            self._cancelled(ctx, pending)
            raise
        finally:
            self._sent_live -= 1
        return _result(report)

    def _cancelled(self, ctx: ExecutionContext, pending: _Pending) -> None:
        """The task of a sent assignment was cancelled: the worker is told (unless parked)."""
        if self._pending.get(ctx.execution_id) is pending and not pending.parked:
            pending.cancelled = True
            if not pending.acked:
                self._drop(ctx.execution_id, pending)
            # (An acknowledged one stays pending, its slot busy on the worker, until it reports its end.)
            self._send(CancelOrder(ctx.execution_id, self._cancel_reason(ctx.run_id)))

    def _cancel_reason(self, run_id: str) -> str:
        """Why the task of `run_id` was cancelled, as the worker is told (`Cancel.reason`)."""
        run = self._tracker.get(run_id)
        if run is not None:
            if run.stop is not None:
                return _STOP_REASONS[run.stop]
            if run.deadline is not None and run.deadline.expired:
                return "timed out"
        return "cancelled"

    def _ack_deadlines(self) -> None:
        """The ack timer: the assignments past their ack timeout go back (`_AckTimedOut`); then
        the timer is set for the oldest one left."""
        self._ack_timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        unacked = self._unacked
        while unacked:
            execution_id, pending = next(iter(unacked.items()))
            if pending.ack_by > now:
                self._ack_timer = loop.call_at(pending.ack_by, self._ack_deadlines)
                return
            del unacked[execution_id]
            if not pending.outcome.done():
                pending.outcome.set_exception(_AckTimedOut())

    def _drop(self, execution_id: str, pending: _Pending) -> None:
        if self._pending.get(execution_id) is pending:
            del self._pending[execution_id]
        if self._unacked.get(execution_id) is pending:
            del self._unacked[execution_id]
        # A credit never spent on a delivered assignment is not given back: the worker's own count
        # frees that slot when it hears of the end (a cancel, or the stream's end).


def _result(report: OutcomeReport) -> Any:
    result = report.result
    if isinstance(result, Succeeded):
        return result.value
    if isinstance(result, Throttled):
        raise RateLimited(result.retry_after, result.reason or "rate limited (remote worker)")
    assert isinstance(result, Failed)
    if result.permanent:
        raise PermanentHandlerError(result.message)
    raise HandlerError(result.message)
