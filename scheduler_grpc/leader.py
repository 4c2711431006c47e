"""Leader election with fencing tokens.

One scheduler process in a deployment leads; the others stand by. How:

- Lock. The leader holds the Redis key `LeaderKeys(scope).lock`, taken with
  `SET key <lease-id> NX PX <ttl>`. The lease id is new for every attempt, so an old holder can never
  mistake someone else's lock for its own.
- Term. Right after the SET succeeds the candidate takes a term from PostgreSQL
  (`LeadershipRepository.begin_term`): a sequence value recorded in `leader_state` only if higher than
  the recorded one. The term is the fencing token: it keeps increasing when Redis restarts empty or
  is flushed, and leader writes check it in their own transaction
  (`scheduler_grpc.db.leadership.assert_current_term`), so a deposed leader cannot change anything.
  If recording fails or a newer term exists, the candidate releases the lock and does not lead.
- Renewal. Every `renew_interval` (default TTL/3) a Lua compare-and-pexpire extends the lock only if
  it still holds our lease id. A renewal that finds another value or no key, fails, or does not
  answer within half a renewal interval ends the term at once: leader-only work is cancelled.
- Local deadline. Independently of Redis, a term is valid only until TTL minus a safety margin
  (TTL/5) after the last successful renewal was *sent*; the lock cannot expire in Redis before that.
  `Term.is_valid()` reads the monotonic clock, so a process resumed after a pause (SIGSTOP, a long GC,
  a blocked loop) sees its term invalid before any task has a chance to renew.
- Release. A Lua compare-and-delete (never deletes another holder's lock) that also publishes on
  `LeaderKeys(scope).released`; standbys subscribed there try at once, so a graceful handover takes
  milliseconds. Without a release (crash), standbys wake when the lock's PTTL says it expires (polled
  at least every `retry_interval`), so takeover happens within TTL plus a few milliseconds.

Caveat: the lock alone cannot stop two processes from *believing* they lead at once if someone
deletes the key or Redis loses its data (FLUSHALL, restart without persistence): the old leader only
notices at its next renewal (within one renewal interval). The fencing token is what keeps writes
correct in that window: the leader loops fence every PostgreSQL write (see `scheduler_grpc.scheduler`).
That is also why the default TTL can be short (2.5 s): a leader that lost its lock without noticing
cannot write under its stale term, so a fast takeover risks no double fire.

Faults: a Redis or PostgreSQL error never ends `run()`: a failed campaign attempt is retried every
`retry_interval` (logged when failures start, then at most once a minute), a failed renewal ends the
term and campaigning resumes. Only a bug (any other exception, of `lead` included) propagates.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NoReturn

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster

from scheduler_grpc import metrics, scripts, stores
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.keys import LeaderKeys

log = logging.getLogger(__name__)

DEFAULT_TTL = timedelta(milliseconds=2500)
"""Lifetime of the leader lock (as `config.Settings.leader_ttl`)."""
DEFAULT_RETRY_INTERVAL = timedelta(seconds=1)
"""Longest a standby waits between two looks at the lock, and the pause after a failed attempt."""

# A failed campaign attempt is logged when the failures start, then at most this often until one succeeds.
_STILL_FAILING_LOG_S = 60.0


# A standby wakes this long after the lock's PTTL, so its SET NX does not race the expiry itself.
_EXPIRY_SLACK_S = 0.002
# How often leader work that has not finished after a cancel is cancelled again.
_RECANCEL_S = 0.1


def _raise_if_cancelled() -> None:
    """Honour a cancellation of the current task that a library call absorbed.

    On Python 3.11, `asyncio.wait_for` returns the result instead of raising CancelledError when the
    awaited call completes in the same loop turn as the cancel (CPython gh-86296, fixed in 3.12),
    and redis-py sends every command through it when `socket_timeout` is set (its default is 5 s).
    The request stays counted on the task, so check after Redis calls in cancellable loops.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def _stop(*tasks: asyncio.Task[Any]) -> None:
    """Cancel `tasks` and wait until all are done, cancelling again every `_RECANCEL_S`.

    Cancellation is repeated because one cancel can be absorbed by library code (see
    `_raise_if_cancelled`); a task whose cleanup must finish should shield it.
    """
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=_RECANCEL_S)


@dataclass(eq=False)
class Term:
    """One leadership term of one elector.

    Attributes:
        token: The fencing token: strictly greater than every earlier term's, Redis restarts
            included. Leader writes pass it to `assert_current_term` in their transaction.
        holder: The elector's holder name.
        lease_id: The value of the Redis lock during this term (holder plus a random suffix).
        acquired_at: When the term began (PostgreSQL clock, UTC).
        scope: The election scope.
    """

    token: int
    holder: str
    lease_id: str
    acquired_at: datetime
    scope: str
    # Monotonic instants: when the last successful lock write (SET or renewal) was sent, and until
    # when the term may act. Only the elector moves them.
    _renewed_at: float = field(default=float("-inf"), init=False, repr=False)
    _valid_until: float = field(default=float("-inf"), init=False, repr=False)

    def is_valid(self) -> bool:
        """Whether the term may still act: it has not ended and its local deadline has not passed.

        Uses the monotonic clock only, so after a pause of the process it turns False at once,
        before the renewal task runs again. Leader loops check it before each unit of work; it does
        not replace fencing the write itself (`assert_current_term`).
        """
        return time.monotonic() < self._valid_until

    def remaining(self) -> timedelta:
        """How long the term stays valid unless renewed (zero once it has ended)."""
        return timedelta(seconds=max(0.0, self._valid_until - time.monotonic()))

    def _renewed(self, sent_at: float, valid_until: float) -> None:
        self._renewed_at = sent_at
        self._valid_until = valid_until

    def _end(self) -> None:
        self._valid_until = float("-inf")


class _Outcome(enum.Enum):
    FINISHED = "lead() returned"
    RESIGNED = "released on request"
    LOST = "lost"


class _SteppedDown(Exception):
    """Ends the leader task group when the term is over (the group then cancels lead())."""

    def __init__(self, reason: str, *, resigned: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.resigned = resigned


class _LeadFinished(Exception):
    """Ends the leader task group after lead() returned (the group then cancels the renewal)."""


class _TermRefused(Exception):
    """The lock was taken, but PostgreSQL already records a newer term."""


class LeaderElector:
    """Campaigns for leadership of one scope and runs the caller's leader work while it leads.

    Args:
        redis: Client for the lock; the pub/sub subscription takes a connection of its own from
            the client's pool.
        leadership: Where terms are taken (PostgreSQL).
        holder: Name of this process in status and logs (host, pid ...); need not be unique, the
            lease id is.
        scope: Election scope; one per deployment (default "scheduler").
        ttl: Lock lifetime (default 2.5 s). A crashed leader is replaced within about this long.
        renew_interval: Time between renewals (default TTL/3; at most TTL/2). Each renewal must
            answer within half of it, or the leader steps down.
        retry_interval: Longest a standby waits between looks at the lock, and the pause after a
            failed attempt or a graceful `release()` (default 1 s).

    Raises:
        ValueError: An interval is out of range.
    """

    def __init__(
        self,
        redis: Redis,
        leadership: LeadershipRepository,
        *,
        holder: str,
        scope: str = "scheduler",
        ttl: timedelta = DEFAULT_TTL,
        renew_interval: timedelta | None = None,
        retry_interval: timedelta = DEFAULT_RETRY_INTERVAL,
    ) -> None:
        if not holder:
            raise ValueError("holder must not be empty")
        self._ttl_ms = round(ttl.total_seconds() * 1000)
        if self._ttl_ms < 30:
            raise ValueError("ttl must be at least 30ms")
        ttl_s = self._ttl_ms / 1000
        renew_s = ttl_s / 3 if renew_interval is None else renew_interval.total_seconds()
        if not 0 < renew_s <= ttl_s / 2:
            raise ValueError("renew_interval must be positive and at most ttl/2")
        if retry_interval <= timedelta(0):
            raise ValueError("retry_interval must be positive")
        self._redis = redis
        self._leadership = leadership
        self._holder = holder
        self._scope = scope
        self._keys = LeaderKeys(scope)
        self._ttl_s = ttl_s
        self._renew_s = renew_s
        self._retry_s = retry_interval.total_seconds()
        # Every Redis call answers within half a renewal interval; with renew <= ttl/2 a failed
        # renewal is noticed by 3/4 of the TTL, before the local deadline below.
        self._call_timeout_s = renew_s / 2
        # The lock expires in Redis no sooner than TTL after the write was sent; stopping TTL/5
        # earlier leaves room for clock-rate differences and for cancelling leader work.
        self._valid_for_s = ttl_s - ttl_s / 5
        # Recording the term must finish well within the lock's life (the first renewal is due then).
        self._db_timeout_s = renew_s
        self._renew_lock = redis.register_script(scripts.source("leader_renew"))
        self._release_lock_script = redis.register_script(scripts.source("leader_release"))
        self._term: Term | None = None
        self._running = False
        self._resign = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def holder(self) -> str:
        """This elector's holder name."""
        return self._holder

    @property
    def scope(self) -> str:
        """The election scope."""
        return self._scope

    @property
    def is_leader(self) -> bool:
        """Whether this elector leads right now: it holds a term whose local deadline has not passed."""
        term = self._term
        return term is not None and term.is_valid()

    @property
    def term(self) -> Term | None:
        """The term being led, or None while standing by (check `Term.is_valid()` before acting)."""
        return self._term

    @property
    def since(self) -> datetime | None:
        """When the current term began (UTC), or None while standing by."""
        term = self._term
        return None if term is None else term.acquired_at

    async def run(self, lead: Callable[[Term], Awaitable[None]]) -> None:
        """Campaign for leadership, and while leading run `lead(term)`.

        When elected, `lead(term)` runs in a task group next to the renewal task. When the term ends
        (renewal failed, lock lost, local deadline passed, `release()`), `lead` is cancelled and
        awaited, the lock is released if still ours, and campaigning resumes. `lead` must honour
        cancellation promptly: the lock is released only after it has finished. It is cancelled
        again every 100 ms until it has, since one cancel can be absorbed by library code (see
        `_raise_if_cancelled`); cleanup that must complete belongs under `asyncio.shield`.
        The term is already invalid (`Term.is_valid()` False) when the cancellation arrives.

        Runs until cancelled, which releases leadership gracefully (a standby takes over at once),
        or until `lead` returns, which also releases it.

        Args:
            lead: The leader-only work; it receives the term whose token fences its writes.

        Raises:
            ExceptionGroup: `lead` raised (wrapped by the task group); leadership was released first.
            RuntimeError: `run` is already running on this elector.
        """
        if self._running:
            raise RuntimeError("LeaderElector.run() is already running")
        self._running = True
        pubsub = self._redis.pubsub()
        try:
            while True:
                term = await self._campaign(pubsub)
                outcome = await self._hold(term, lead)
                if outcome is _Outcome.FINISHED:
                    return
                if outcome is _Outcome.RESIGNED:
                    # Stay out of the race for a while: the standbys woken by the release message
                    # take the lock meanwhile, as `release()` intends.
                    await asyncio.sleep(self._retry_s)
        finally:
            self._running = False
            await self._close(pubsub)

    async def release(self) -> None:
        """Step down now, if leading, and let a standby take over.

        Returns once `lead` has been cancelled and the lock released (or found gone). `run()` then
        stays out of the election for `retry_interval` before campaigning again.
        """
        if self._term is None:
            return
        self._resign.set()
        await self._idle.wait()

    def resign(self) -> None:
        """Ask to step down as `release()` does, without waiting: for the leader's own work, which
        `run()` cancels as a consequence (so it cannot await the release itself)."""
        if self._term is not None:
            self._resign.set()

    # --- standing by -------------------------------------------------------------------------

    async def _campaign(self, pubsub: PubSub) -> Term:
        """Try for the lock until it is ours and a term is recorded.

        A store error is retried every `retry_interval`; it is logged when failures start and then at
        most every minute, not once per attempt.
        """
        subscribed = False
        failures = 0
        logged_at = 0.0
        while True:
            _raise_if_cancelled()
            try:
                if not subscribed:
                    # Subscribe before looking at the lock, so a release after the look wakes us.
                    await self._subscribe(pubsub)
                    subscribed = True
                    _raise_if_cancelled()
                term = await self._try_acquire()
                if term is not None:
                    if failures:
                        log.info("leader campaign recovered", extra={"scope": self._scope, "failures": failures})
                    return term
                wait = await self._until_lock_expires()
                _raise_if_cancelled()
            except Exception as exc:
                if not (stores.is_fault(exc) or isinstance(exc, _TermRefused)):
                    raise
                metrics.store_error(exc)
                failures += 1
                now = time.monotonic()
                if failures == 1 or now - logged_at >= _STILL_FAILING_LOG_S:
                    logged_at = now
                    log.warning(
                        "leader campaign attempt failed; retrying",
                        extra={"scope": self._scope, "holder": self._holder, "error": repr(exc), "failures": failures},
                    )
                # A plain pause, deaf to release messages: the failed attempt may have published
                # one itself, and waking on it would turn retries into a busy loop.
                await asyncio.sleep(self._retry_s)
                continue
            if wait > 0:
                await self._wait_for_release(pubsub, wait)

    async def _subscribe(self, pubsub: PubSub) -> None:
        async with asyncio.timeout(self._call_timeout_s):
            if isinstance(self._redis, RedisCluster):
                # redis-py's cluster pub/sub reads the slot map without loading it first (a KeyError
                # on a client that has sent no command yet); loading it is a no-op once loaded.
                await self._redis.initialize()
            await pubsub.subscribe(self._keys.released)
            # The confirmation proves the server registered us (the command went on another
            # connection than the lock reads, so ordering is not otherwise given).
            while True:
                message = await pubsub.get_message(timeout=self._call_timeout_s)
                if message is not None and message["type"] == "subscribe":
                    return

    async def _try_acquire(self) -> Term | None:
        """One attempt: SET NX, then a term from PostgreSQL. None if another holder has the lock."""
        lease_id = f"{self._holder}:{uuid.uuid4().hex}"
        sent_at = time.monotonic()
        try:
            async with asyncio.timeout(self._call_timeout_s):
                acquired = await self._redis.set(self._keys.lock, lease_id, nx=True, px=self._ttl_ms)
        except BaseException:
            # The SET may have been applied although no answer came back: free the lock if so,
            # rather than leave every standby waiting out a whole TTL.
            await self._release_lock(lease_id)
            raise
        if not acquired:
            _raise_if_cancelled()
            return None
        # The lock is ours, so standbys do not burn terms; now take the term that fences our writes.
        try:
            _raise_if_cancelled()
            async with asyncio.timeout(self._db_timeout_s):
                record = await self._leadership.begin_term(self._scope, self._holder)
            _raise_if_cancelled()
        except BaseException:
            await self._release_lock(lease_id)
            raise
        if record is None:
            await self._release_lock(lease_id)
            raise _TermRefused(
                "a newer leader term is already recorded in leader_state; if this repeats, "
                "leader_term_seq is behind leader_state.term (restored backup?): "
                "SELECT setval('leader_term_seq', (SELECT max(term) FROM leader_state))"
            )
        term = Term(
            token=record.term,
            holder=self._holder,
            lease_id=lease_id,
            acquired_at=record.acquired_at,
            scope=self._scope,
        )
        term._renewed(sent_at, sent_at + self._valid_for_s)
        if not term.is_valid():
            # Recording took (or the process was paused for) most of the TTL: do not lead on it.
            await self._release_lock(lease_id)
            return None
        return term

    async def _until_lock_expires(self) -> float:
        """Seconds to wait before the next attempt: until the lock expires, at most retry_interval."""
        async with asyncio.timeout(self._call_timeout_s):
            pttl = int(await self._redis.pttl(self._keys.lock))
        if pttl == -2:  # gone since our SET NX: try again at once
            return 0.0
        if pttl < 0:  # a lock without expiry was set by hand; it blocks election until removed
            log.warning(
                "leader lock has no expiry; delete it to allow an election",
                extra={"scope": self._scope, "holder": self._holder, "key": self._keys.lock},
            )
            return self._retry_s
        return min(self._retry_s, pttl / 1000 + _EXPIRY_SLACK_S)

    async def _wait_for_release(self, pubsub: PubSub, wait: float) -> None:
        """Wait `wait` seconds, or less if a release is announced."""
        deadline = time.monotonic() + wait
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                async with asyncio.timeout(remaining + self._call_timeout_s):
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=remaining)
                _raise_if_cancelled()
            except Exception as exc:
                if not stores.is_fault(exc):
                    raise
                log.warning(
                    "leader release channel failed; polling the lock instead",
                    extra={"scope": self._scope, "holder": self._holder, "error": repr(exc)},
                )
                # A pause, not synchronisation: the lock is looked at again when it ends.
                await asyncio.sleep(max(0.0, deadline - time.monotonic()))
                return
            if message is not None and message["type"] == "message":
                return

    # --- leading -----------------------------------------------------------------------------

    async def _hold(self, term: Term, lead: Callable[[Term], Awaitable[None]]) -> _Outcome:
        """Lead under `term` until it ends; always ends the term and releases the lock."""
        fields = self._fields(term)
        self._term = term
        self._resign.clear()
        self._idle.clear()
        log.info("became leader", extra=fields)
        outcome = _Outcome.LOST
        try:
            async with asyncio.TaskGroup() as tasks:
                leading = tasks.create_task(self._lead(term, lead), name=f"leader-lead[{self._scope}:{term.token}]")
                keeping = tasks.create_task(self._keep(term), name=f"leader-renew[{self._scope}:{term.token}]")
                # Wait in the body, stop the tasks here and end the group by raising, rather than
                # let a child's exception end it: on Python 3.11 a child failing while the group is
                # already exiting leaves a cancel request on this task that nothing withdraws
                # (fixed in 3.12), and _stop() re-cancels a lead() that absorbed a cancel. A failing
                # lead() still ends the group (the group cancels this wait) and propagates.
                try:
                    done, _ = await asyncio.wait((leading, keeping), return_when=asyncio.FIRST_COMPLETED)
                except asyncio.CancelledError:
                    term._end()
                    await _stop(leading, keeping)
                    raise
                term._end()
                await _stop(leading, keeping)
                self._end_group(keeping.result() if keeping in done else None)
        except* _SteppedDown as group:
            stepped = [exc for exc in group.exceptions if isinstance(exc, _SteppedDown)]
            resigned = any(exc.resigned for exc in stepped)
            outcome = _Outcome.RESIGNED if resigned else _Outcome.LOST
            log.log(
                logging.INFO if resigned else logging.WARNING,
                "stepped down",
                extra={**fields, "reason": "; ".join(exc.reason for exc in stepped)},
            )
        except* _LeadFinished:
            outcome = _Outcome.FINISHED
            log.info("leader work finished; stepping down", extra=fields)
        finally:
            # In this order: no longer valid, leader work stopped (in the body, or by the group),
            # then the lock, so a standby can never start while our work still runs.
            term._end()
            self._term = None
            if await self._release_lock(term.lease_id):
                log.info("released leader lock", extra=fields)
            self._idle.set()
        # A cancellation of run() that arrived while the group was ending was absorbed by it (its
        # own exception wins), or by a Redis call; honour it now that the lock is released.
        _raise_if_cancelled()
        return outcome

    @staticmethod
    def _end_group(stepped_down: tuple[str, bool] | None) -> NoReturn:
        """Raise what ends the leader task group: why the term ended, or that lead() returned."""
        if stepped_down is not None:
            reason, resigned = stepped_down
            raise _SteppedDown(reason, resigned=resigned)
        raise _LeadFinished

    async def _lead(self, term: Term, lead: Callable[[Term], Awaitable[None]]) -> None:
        await lead(term)

    async def _keep(self, term: Term) -> tuple[str, bool]:
        """Renew the lock every renew_interval until the term must end.

        Returns:
            Why the term ended, and whether it was a requested release. The term is already
            ended (`is_valid()` False) when this returns.
        """
        while True:
            now = time.monotonic()
            wake = min(term._renewed_at + self._renew_s, term._valid_until)
            if wake > now:
                try:
                    async with asyncio.timeout(wake - now):
                        await self._resign.wait()
                except TimeoutError:
                    pass
                else:
                    return self._ended(term, "release requested", resigned=True)
            if not term.is_valid():
                return self._ended(term, "no successful renewal before the local deadline")
            sent_at = time.monotonic()
            # Never wait for Redis past the local deadline: step down even if it has not answered.
            budget = min(self._call_timeout_s, term._valid_until - sent_at)
            try:
                async with asyncio.timeout(budget):
                    renewed = await self._renew_lock(keys=[self._keys.lock], args=[term.lease_id, self._ttl_ms])
            except TimeoutError as exc:
                metrics.store_error(exc, "redis")
                return self._ended(term, f"renewal got no answer within {budget * 1000:.0f}ms")
            except Exception as exc:
                if not stores.is_fault(exc):
                    raise
                metrics.store_error(exc, "redis")
                return self._ended(term, f"renewal failed: {exc!r}")
            _raise_if_cancelled()
            if renewed != 1:
                return self._ended(term, "the lock expired or is held by another lease")
            term._renewed(sent_at, sent_at + self._valid_for_s)

    @staticmethod
    def _ended(term: Term, reason: str, *, resigned: bool = False) -> tuple[str, bool]:
        # End the term before anything else runs: is_valid() is False from here on, while lead()
        # is still being cancelled.
        term._end()
        return reason, resigned

    async def _release_lock(self, lease_id: str) -> bool:
        """Compare-and-delete the lock and announce it; True if it was ours. Never raises Redis errors."""
        try:
            async with asyncio.timeout(self._call_timeout_s):
                released = await self._release_lock_script(keys=[self._keys.lock], args=[lease_id, self._keys.released])
        except Exception as exc:
            if not stores.is_fault(exc):
                raise
            log.warning(
                "could not release the leader lock; it expires on its own",
                extra={"scope": self._scope, "holder": self._holder, "error": repr(exc)},
            )
            return False
        return bool(released == 1)

    async def _close(self, pubsub: PubSub) -> None:
        try:
            async with asyncio.timeout(self._call_timeout_s):
                await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        except Exception as exc:
            if not stores.is_fault(exc):
                raise
            log.debug("closing the leader pub/sub connection failed", extra={"error": repr(exc)})

    def _fields(self, term: Term) -> dict[str, Any]:
        return {"scope": self._scope, "holder": self._holder, "term": term.token, "lease_id": term.lease_id}


async def current_holder(redis: Redis, scope: str = "scheduler", *, call_timeout: float = 5.0) -> str | None:
    """Who holds the leader lock of `scope` now (the elector's `holder`), or None if nobody does.

    Reads the lock only: the lock's value is the lease id `<holder>:<random suffix>` (`_try_acquire`).

    Raises:
        redis.exceptions.RedisError, OSError, TimeoutError: no answer within `call_timeout` seconds.
    """
    async with asyncio.timeout(call_timeout):
        lease_id = await redis.get(LeaderKeys(scope).lock)
    return None if lease_id is None else scripts.text(lease_id).rsplit(":", 1)[0]
