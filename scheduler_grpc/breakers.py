"""Circuit breakers per handler and per webhook host (aiobreaker, with a rolling failure window).

A process keeps at most `MAX_BREAKERS` of them (least recently used first out).

aiobreaker counts *consecutive* failures. We want "open at >= 50 % failures over the last >= 5
calls", so the breaker's state storage (its documented extension point) keeps a rolling window of
outcomes and reports the trip condition through the counter aiobreaker checks. Half-open after the
reset timeout: the next calls are trials; a failure re-opens, a success closes and clears the window.

Work for an open breaker is not a failure: the worker puts it back with the breaker's remaining
open time as delay, without spending an attempt.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from aiobreaker import CircuitBreaker, CircuitBreakerError, CircuitBreakerListener, CircuitBreakerState
from aiobreaker.storage.memory import CircuitMemoryStorage

T = TypeVar("T")


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


_STATES = {
    CircuitBreakerState.CLOSED: BreakerState.CLOSED,
    CircuitBreakerState.OPEN: BreakerState.OPEN,
    CircuitBreakerState.HALF_OPEN: BreakerState.HALF_OPEN,
}


@dataclass(frozen=True)
class BreakerPolicy:
    """When breakers open and for how long (all configurable)."""

    window: int = 10  # outcomes remembered
    min_calls: int = 5  # fewer outcomes than this never open the breaker
    failure_ratio: float = 0.5  # open when failures / outcomes reaches this
    reset_timeout: timedelta = timedelta(seconds=30)  # open -> half-open


class _RollingWindowStorage(CircuitMemoryStorage):  # type: ignore[misc]
    """aiobreaker storage whose `counter` is 1 exactly when the rolling window says "trip"."""

    def __init__(self, policy: BreakerPolicy) -> None:
        super().__init__(CircuitBreakerState.CLOSED)
        self._state: CircuitBreakerState = CircuitBreakerState.CLOSED
        self._policy = policy
        self._outcomes: deque[bool] = deque(maxlen=policy.window)  # True = success
        self._ignore_next_reset = False

    @property
    def state(self) -> CircuitBreakerState:
        return self._state

    @state.setter
    def state(self, state: CircuitBreakerState) -> None:
        if state is CircuitBreakerState.CLOSED and self._state is not CircuitBreakerState.CLOSED:
            # A fresh start; aiobreaker's closed state resets the counter right after: not a call.
            self._outcomes.clear()
            self._ignore_next_reset = True
        self._state = state

    def increment_counter(self) -> None:
        self._outcomes.append(False)

    def reset_counter(self) -> None:
        # aiobreaker calls this on every success (and once when the circuit closes).
        if self._ignore_next_reset:
            self._ignore_next_reset = False
            return
        self._outcomes.append(True)

    @property
    def counter(self) -> int:
        calls = len(self._outcomes)
        failures = calls - sum(self._outcomes)
        tripped = calls >= self._policy.min_calls and failures >= self._policy.failure_ratio * calls
        return 1 if tripped else 0

    @property
    def calls(self) -> int:
        return len(self._outcomes)

    @property
    def failures(self) -> int:
        return len(self._outcomes) - sum(self._outcomes)


class _CallFailed(Exception):
    """Carries a failed outcome through aiobreaker so it is counted, without losing the value."""

    def __init__(self, outcome: Any) -> None:
        super().__init__("call failed")
        self.outcome = outcome


class BreakerOpen(Exception):
    """The breaker refused the call; retry after `retry_after`."""

    def __init__(self, key: str, retry_after: timedelta) -> None:
        super().__init__(f"circuit breaker {key!r} is open")
        self.key = key
        self.retry_after = retry_after


class _Transitions(CircuitBreakerListener):  # type: ignore[misc]
    def __init__(self, on_change: Callable[[str, BreakerState, BreakerState], None], key: str) -> None:
        self._on_change = on_change
        self._key = key

    def state_change(self, breaker: CircuitBreaker, old: Any, new: Any) -> None:
        if old is not None:
            self._on_change(self._key, _STATES[old.state], _STATES[new.state])


class Breaker:
    """One circuit breaker (a handler, or a webhook target host)."""

    def __init__(
        self, key: str, policy: BreakerPolicy, on_change: Callable[[str, BreakerState, BreakerState], None]
    ) -> None:
        self.key = key
        self._policy = policy
        self._storage = _RollingWindowStorage(policy)
        self._breaker = CircuitBreaker(
            fail_max=1,
            timeout_duration=policy.reset_timeout,
            state_storage=self._storage,
            listeners=[_Transitions(on_change, key)],
            name=key,
        )

    @property
    def state(self) -> BreakerState:
        state = _STATES[self._breaker.current_state]
        if state is BreakerState.OPEN and self.retry_after() == timedelta(0):
            return BreakerState.HALF_OPEN  # the next call will be a trial
        return state

    def retry_after(self) -> timedelta:
        """Time until an open breaker lets a trial call through (zero when not open)."""
        if self._breaker.current_state is not CircuitBreakerState.OPEN:
            return timedelta(0)
        opened_at: datetime | None = self._storage.opened_at
        if opened_at is None:
            return timedelta(0)
        # aiobreaker stamps opened_at with utcnow(); compare in the same (naive UTC) terms.
        remaining = opened_at + self._policy.reset_timeout - datetime.now(UTC).replace(tzinfo=None)
        return max(remaining, timedelta(0))

    @property
    def failures(self) -> int:
        return self._storage.failures

    @property
    def calls(self) -> int:
        return self._storage.calls

    async def call(self, run: Callable[[], Awaitable[T]], failed: Callable[[T], bool]) -> T:
        """Run `run()` through the breaker; `failed(result)` says whether its result counts as a failure.

        Raises:
            BreakerOpen: the breaker is open; `run` was not called.
        """

        async def guarded() -> T:
            result = await run()
            if failed(result):
                raise _CallFailed(result)
            return result

        try:
            result: T = await self._breaker.call_async(guarded)
        except _CallFailed as failure:
            return failure.outcome  # type: ignore[no-any-return]
        except CircuitBreakerError as exc:
            if isinstance(exc.__cause__, _CallFailed):  # this very failure tripped the breaker
                return exc.__cause__.outcome  # type: ignore[no-any-return]
            raise BreakerOpen(self.key, self.retry_after() or timedelta(seconds=1)) from None
        return result


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
        return breaker.retry_after() if breaker is not None else timedelta(0)

    def states(self) -> dict[str, BreakerState]:
        return {key: breaker.state for key, breaker in self._breakers.items()}
