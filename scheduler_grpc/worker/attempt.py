"""One attempt on this worker: the run record the stages share (`Attempt`), the deadline timer a
batch's attempts share (`Deadline`), and how a handler's end becomes an `Outcome` (or a hand-back:
`RateLimited`, `HandBack`)."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timedelta
from typing import Any

from scheduler_grpc import outputs, tracing
from scheduler_grpc.db.executions import Claim, Outcome
from scheduler_grpc.executions import DeadReason, ExecutionStatus
from scheduler_grpc.handlers import ExecutionContext, HandlerError, PermanentHandlerError, RateLimited
from scheduler_grpc.queue import Lease
from scheduler_grpc.worker.lifecycle import Run

log = logging.getLogger("scheduler_grpc.worker")


class HandBack(Exception):
    """Raised instead of running a run that was never this worker's to run (a remote worker's
    handler it does not serve, an assignment it did not acknowledge): the run goes back to the
    queue exactly as it was (`Executor._unspent`): its attempt `queued` again as if never claimed
    (no attempt, no retry budget spent), its delivery not counted, due again after `delay`. Unlike
    `RateLimited` (the upstream's back-pressure) it pauses no limit key and counts no throttle wait.
    """

    def __init__(self, reason: str, delay: timedelta = timedelta(0)) -> None:
        super().__init__(reason)
        self.reason = reason
        self.delay = delay


class Attempt(Run):
    """A delivery this worker holds (`Run`), with what its stages need: the lease, then the claim,
    the task that runs it, its deadline and its outcome.

    A reserved one is first held: claimed, waiting for its due time (`due`, monotonic), without a
    slot or a deadline; `started_at` is then its real start (database clock).
    """

    __slots__ = ("claim", "deadline", "due", "lease", "outcome", "seconds", "started_at", "task", "waiter")
    claim: Claim  # set when claimed (state HELD or RUNNING on)

    def __init__(self, lease: Lease) -> None:
        # `Run.__init__`, inlined (one call less per run on the hot path).
        self.id = lease.id
        self.token = lease.token
        self.reserved = lease.due_in is not None
        self.solo = lease.solo
        self.state = None
        self.stop = None
        self.lease = lease
        self.deadline: Deadline | None = None  # set at the start (a held run's timeout starts with it)
        self.task: asyncio.Task[None] | None = None
        self.outcome: Outcome | None = None  # set when its handler is done
        self.seconds = 0.0  # how long its handler ran (observed with its batch's outcomes)
        self.due = 0.0
        self.started_at: datetime | None = None
        self.waiter: asyncio.Future[None] | None = None  # a STARTING run's wait for a slot

    def end_with(
        self, status: ExecutionStatus, error: str | None = None, result: Any = None, dead: DeadReason | None = None
    ) -> Outcome:
        return Outcome(self.claim.execution_id, self.token, status, error=error, result=result, dead_reason=dead,
                       scheduled_for=self.claim.scheduled_for)  # fmt: skip


class Deadline:
    """The timeout of the claims of one batch that share a job timeout: one timer for all of them
    instead of one `asyncio.timeout` (a timer armed, moved and cancelled) per run.

    When it fires it cancels the handlers still running (`running`); each of them takes that
    cancellation as its timeout (`release`, as `asyncio.timeout` turns it into TimeoutError). The
    timer is cancelled once every run of the group has finished (`finished`), so a drained batch
    leaves no timer behind.
    """

    __slots__ = ("_pending", "_timer", "expired", "running")

    def __init__(self, seconds: float, runs: int) -> None:
        self.running: dict[str, Attempt] = {}  # by run id, while their handlers run
        self.expired = False
        self._pending = runs
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self.expired = True
        for attempt in self.running.values():
            assert attempt.task is not None  # a handler runs in its task
            attempt.task.cancel()

    def release(self, attempt: Attempt) -> bool:
        """`attempt`'s handler is done (however it ended): off the deadline. The deadline's
        cancellation, if any, is taken back (whatever the handler made of it, as `asyncio.timeout`
        does), so it never hides or outlives another one.

        Returns:
            True when the deadline cancelled this handler and nothing else did: its timeout.
        """
        if self.running.pop(attempt.id, None) is None or not self.expired:
            return False
        assert attempt.task is not None
        return attempt.task.uncancel() == 0

    def finished(self) -> None:
        """One run of the group is done (whatever its end)."""
        self._pending -= 1
        if self._pending <= 0:
            self._timer.cancel()


async def run_handler(attempt: Attempt, handler: Any, ctx: ExecutionContext) -> Outcome:
    """Run the handler of `attempt` under its deadline: its outcome. A cancellation other than the
    deadline's (a cancel request, a stop, a lost lease) propagates, and so does `RateLimited`
    (back-pressure: the caller hands the run back, no outcome), as does `HandBack`."""
    claim, deadline = attempt.claim, attempt.deadline
    assert deadline is not None
    if deadline.expired:  # its batch's timeout passed before this handler could start
        return failure(attempt, ExecutionStatus.TIMED_OUT, timed_out(claim))
    status, error, result = ExecutionStatus.SUCCEEDED, None, None
    deadline.running[attempt.id] = attempt
    began = time.perf_counter()
    try:
        result = outputs.bound_result(await handler.run(ctx, claim.payload))
    except asyncio.CancelledError:
        # The deadline's cancellation is this attempt's timeout: absorb exactly that one; any
        # other cancellation (a cancel request, a stop, a lost lease) goes on.
        if deadline.release(attempt):
            status, error = ExecutionStatus.TIMED_OUT, timed_out(claim)
        else:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise
            # Nobody cancelled this task: the handler raised CancelledError itself (a bug of its
            # own), which must not pass for a stop of ours.
            status, error = ExecutionStatus.FAILED, "CancelledError raised by the handler"
    except (RateLimited, HandBack):
        raise
    except PermanentHandlerError as exc:
        return attempt.end_with(ExecutionStatus.DEAD, error=str(exc), dead=DeadReason.PERMANENT)
    except (HandlerError, outputs.Unstorable) as exc:  # (a result over a bound: this attempt's failure)
        status, error = ExecutionStatus.FAILED, str(exc)
    except Exception as exc:  # a handler bug is this attempt's failure, not the worker's
        log.exception("handler raised", extra={"execution_id": claim.execution_id, "handler": claim.handler})
        status, error = ExecutionStatus.FAILED, f"{type(exc).__name__}: {exc}"
    finally:
        deadline.release(attempt)  # (a no-op when released above)
        attempt.seconds = time.perf_counter() - began
    if status is ExecutionStatus.SUCCEEDED:
        return Outcome(claim.execution_id, attempt.token, status, result=result, scheduled_for=claim.scheduled_for)
    assert error is not None
    return failure(attempt, status, error)


async def run_handler_traced(attempt: Attempt, handler: Any, ctx: ExecutionContext) -> Outcome:
    """`run_handler` under a `handler <name>` span, current while the handler runs (so its log
    lines carry it and the webhook handler sends it as `traceparent`)."""
    span = tracing.start(f"handler {attempt.claim.handler}", attributes={"scheduler.handler": attempt.claim.handler})
    try:
        with tracing.current(span):
            outcome = await run_handler(attempt, handler, ctx)
    except BaseException as exc:
        tracing.span_error(span, "cancelled" if isinstance(exc, asyncio.CancelledError) else repr(exc))
        raise
    else:
        if failed(outcome):
            tracing.span_error(span, outcome.error or outcome.status.value)
        return outcome
    finally:
        span.end()


def failure(attempt: Attempt, status: ExecutionStatus, error: str) -> Outcome:
    """The outcome of a failed attempt: retried while its budget allows, else dead."""
    claim = attempt.claim
    # Interrupted attempts (a worker's graceful stop) spend no retry budget.
    if claim.retry.allows_retry_after(claim.budget_attempt):
        backoff = claim.retry.backoff(claim.budget_attempt)
        return Outcome(claim.execution_id, attempt.token, status, error=error, retry_after=backoff,
                       scheduled_for=claim.scheduled_for)  # fmt: skip
    spent = f"{error} (retry budget of {claim.retry.max_retries} spent)"
    return attempt.end_with(ExecutionStatus.DEAD, error=spent, dead=DeadReason.RETRIES_EXHAUSTED)


def timed_out(claim: Claim) -> str:
    return f"timed out after {claim.timeout.total_seconds():g}s"


def failed(outcome: Outcome) -> bool:
    return outcome.status in (ExecutionStatus.FAILED, ExecutionStatus.TIMED_OUT, ExecutionStatus.DEAD)


def with_start(outcome: Outcome, started_at: datetime) -> Outcome:
    # Built directly: `dataclasses.replace` costs several times more.
    return Outcome(outcome.execution_id, outcome.claim_token, outcome.status, outcome.error, outcome.result,
                   outcome.retry_after, started_at, outcome.dead_reason, outcome.scheduled_for)  # fmt: skip
