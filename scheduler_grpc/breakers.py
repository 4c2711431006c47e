"""Circuit breakers per handler and per webhook host, with a rolling failure window.

A process keeps at most `MAX_BREAKERS` of them (least recently used first out).

A breaker opens at >= `failure_ratio` failures over the last `window` outcomes once it has seen at
least `min_calls` of them (not after a run of *consecutive* failures). Open, it refuses work for
`reset_timeout`; then it is half-open: the next calls are trials; a failure re-opens it, a success
closes it and clears the window.

The worker asks a breaker synchronously, around its own await of the handler: `admit()` before,
`record(failed)` after (no wrapper coroutine, no exception per failed outcome: this is on the path
of every execution). `call()` wraps both around an awaitable for other callers.

Work for an open breaker is not a failure: the worker puts it back with the breaker's remaining
open time as delay, without spending an attempt.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

T = TypeVar("T")
_NO_WAIT = timedelta(0)


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerPolicy:
    """When breakers open and for how long (all configurable)."""

    window: int = 10  # outcomes remembered
    min_calls: int = 5  # fewer outcomes than this never open the breaker
    failure_ratio: float = 0.5  # open when failures / outcomes reaches this
    reset_timeout: timedelta = timedelta(seconds=30)  # open -> half-open


class BreakerOpen(Exception):
    """The breaker refused the call; retry after `retry_after`."""

    def __init__(self, key: str, retry_after: timedelta) -> None:
        super().__init__(f"circuit breaker {key!r} is open")
        self.key = key
        self.retry_after = retry_after


class Breaker:
    """One circuit breaker (a handler, or a webhook target host).

    `on_change(key, old, new)` is called on every transition (closed -> open, open -> half-open,
    half-open -> open or closed).
    """

    def __init__(
        self, key: str, policy: BreakerPolicy, on_change: Callable[[str, BreakerState, BreakerState], None]
    ) -> None:
        self.key = key
        self._policy = policy
        self._on_change = on_change
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0  # time.monotonic() when it last opened
        self._outcomes: deque[bool] = deque(maxlen=policy.window)  # True = failed
        self._failures = 0  # of `_outcomes`, kept as they come and go

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self.retry_after() == _NO_WAIT:
            return BreakerState.HALF_OPEN  # the next call will be a trial
        return self._state

    def retry_after(self) -> timedelta:
        """Time until an open breaker lets a trial call through (zero when not open)."""
        if self._state is not BreakerState.OPEN:
            return _NO_WAIT
        remaining = self._opened_at + self._policy.reset_timeout.total_seconds() - time.monotonic()
        return timedelta(seconds=remaining) if remaining > 0 else _NO_WAIT

    @property
    def failures(self) -> int:
        return self._failures

    @property
    def calls(self) -> int:
        return len(self._outcomes)

    def admit(self) -> None:
        """Before a call: let it through, or refuse it. An open breaker whose reset timeout has
        passed turns half-open and lets the call through as a trial.

        Raises:
            BreakerOpen: the breaker is open; do not make the call.
        """
        if self._state is BreakerState.OPEN:
            wait = self.retry_after()
            if wait:
                raise BreakerOpen(self.key, wait)
            self._move(BreakerState.HALF_OPEN)

    def record(self, failed: bool) -> None:
        """After an admitted call: count its outcome, and open or close the breaker on it."""
        if self._state is BreakerState.HALF_OPEN:  # a trial decides
            if failed:
                self._open()
            else:
                self._outcomes.clear()
                self._failures = 0
                self._move(BreakerState.CLOSED)
        elif self._state is BreakerState.CLOSED:
            outcomes = self._outcomes
            if len(outcomes) == outcomes.maxlen and outcomes[0]:
                self._failures -= 1  # the oldest outcome, a failure, leaves the window
            outcomes.append(failed)
            if failed:
                self._failures += 1
                policy = self._policy
                calls = len(outcomes)
                if calls >= policy.min_calls and self._failures >= policy.failure_ratio * calls:
                    self._open()
        # Open: a call admitted before the breaker opened, ending late, changes nothing.

    async def call(self, run: Callable[[], Awaitable[T]], failed: Callable[[T], bool]) -> T:
        """Run `run()` through the breaker; `failed(result)` says whether its result counts as a failure.
        An exception from `run()` counts as a failure and propagates.

        Raises:
            BreakerOpen: the breaker is open; `run` was not called.
        """
        self.admit()
        try:
            result = await run()
        except Exception:
            self.record(True)
            raise
        self.record(failed(result))
        return result

    def _open(self) -> None:
        self._opened_at = time.monotonic()
        self._move(BreakerState.OPEN)

    def _move(self, new: BreakerState) -> None:
        old, self._state = self._state, new
        self._on_change(self.key, old, new)


MAX_BREAKERS = 1000
"""Breakers one process keeps (webhook breakers are per host, so their number is the user's)."""


class Breakers:
    """The breakers of one worker process, created on first use, at most `max_breakers` of them.

    Beyond the bound the least recently used breaker is forgotten: a host not called for that long
    starts again closed, which costs at most `min_calls` failing calls before it opens again.
    """

    def __init__(
        self,
        policy: BreakerPolicy | None = None,
        on_change: Callable[[str, BreakerState, BreakerState], None] | None = None,
        *,
        max_breakers: int = MAX_BREAKERS,
    ) -> None:
        self.policy = policy or BreakerPolicy()
        self._on_change = on_change or (lambda key, old, new: None)
        self._breakers: OrderedDict[str, Breaker] = OrderedDict()
        self._max = max(1, max_breakers)

    def get(self, key: str) -> Breaker:
        breaker = self._breakers.get(key)
        if breaker is None:
            breaker = self._breakers[key] = Breaker(key, self.policy, self._on_change)
            while len(self._breakers) > self._max:
                self._breakers.popitem(last=False)
        else:
            self._breakers.move_to_end(key)
        return breaker

    def blocked_for(self, key: str) -> timedelta:
        """How long work for `key` must wait (zero: go ahead). Unknown keys are closed."""
        breaker = self._breakers.get(key)
        return breaker.retry_after() if breaker is not None else _NO_WAIT

    def states(self) -> dict[str, BreakerState]:
        return {key: breaker.state for key, breaker in self._breakers.items()}
