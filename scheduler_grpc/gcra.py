"""Keyed flow control, the pure part: a run's limit keys, a limit definition as the queue stores it,
and the GCRA arithmetic that `lua/_limits.lua` mirrors operation for operation (a test runs both).

GCRA (the generic cell rate algorithm) keeps one number per key, its theoretical arrival time
(TAT). With a rate of `limit` units per `period` the emission interval is `T = period / limit`;
`burst` extra units may go at once, so the tolerance is `burst * T`. A request for `n` units at
`now` is admitted when `max(TAT, now) + n * T - now <= (burst + 1) * T`, and then
`TAT = max(TAT, now) + n * T`. So in any half-open window of length `W` at most
`W / T + burst + 1` units are admitted, strictly fewer: `(admitted - burst - 1) * period < W * limit`
(with `limit = 100` per second and `burst = 10`, at most 110 starts in any second), there is no
double burst at a window edge, and a refused request learns the exact wait (`retry_ms`): admitted
then, refused a millisecond earlier.

Exact integers throughout: times are milliseconds (Redis clock), and the TAT is kept as whole
milliseconds plus a remainder in 1/limit-ms steps (`tat_ms * limit + rem`), so `T = period_ms`
steps and nothing is rounded. Only the distance of the TAT from `now` is ever multiplied (at most
`(burst + 1) * period_ms`), so every value stays exact in Lua's doubles.

Requests are seen on the Redis clock's millisecond ticks. When `T` is not a whole number of
milliseconds and the burst is 0, a backlogged caller that comes back on the tick after its retry
time finds the TAT passed and starts from `now`: the rate then errs low (by under a millisecond per
unit), never high.

A request larger than the whole tolerance (`n > burst + 1`) could never pass the test above; it is
admitted when the key is idle (`TAT <= now`) instead, and pushes the TAT by its full cost, so the
long-run rate still holds and such a run never blocks its key for ever. The same holds for a
concurrency limit: a run asking for more units than the limit runs when its key holds none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Final, Literal

from scheduler_grpc.errors import InvalidArgument

__all__ = ["Decision", "LimitDefinition", "LimitKey", "decide", "encode_definition", "encode_group"]

MAX_GROUP_KEYS: Final = 16
"""Most limit keys one queue item may carry (the job model allows fewer)."""
_CONTROL: Final = re.compile(r"[\x00-\x1f]")
_MS: Final = timedelta(milliseconds=1)


@dataclass(frozen=True, slots=True)
class LimitKey:
    """One limit a queued run takes: `units` of limit `limit` under the resolved key `key`."""

    limit: str
    key: str
    units: int = 1


@dataclass(frozen=True, slots=True)
class LimitDefinition:
    """A limit as the queue's scripts read it (`{q:<name>}:limdef`).

    Attributes:
        name: The limit's name.
        kind: `concurrency` (at most `limit` units held at once per key) or `rate` (GCRA: `limit`
            units per `period`, `burst` extra at once).
        limit: Units (>= 0; 0 admits nothing).
        period: The rate's period (rate only, positive).
        burst: Extra units a rate admits at once (rate only, >= 0).
        overrides: Per key: (limit, burst) replacing the defaults for that key.
    """

    name: str
    kind: Literal["concurrency", "rate"]
    limit: int
    period: timedelta | None = None
    burst: int = 0
    overrides: Mapping[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    """What `decide` answers: admitted (and the new TAT), or refused and how long to wait."""

    admitted: bool
    tat_ms: int
    tat_rem: int
    retry_ms: int


def decide(  # noqa: PLR0917 (the Lua twin takes the same positional arguments)
    tat_ms: int, tat_rem: int, now_ms: int, limit: int, period_ms: int, burst: int, units: int
) -> Decision:
    """One GCRA admission of `units` at `now_ms` against the stored TAT `(tat_ms, tat_rem)`.

    A key never seen is `(0, 0)`. Admitted: the new TAT to store, `retry_ms` 0. Refused: the
    stored TAT unchanged and `retry_ms` >= 1, the exact wait after which the same request passes.
    `limit` and `period_ms` must be positive (a limit of 0 is refused before this is called).
    """
    rem = min(tat_rem, limit - 1)
    ahead = 0 if tat_ms < now_ms else (tat_ms - now_ms) * limit + rem
    cap = (burst + 1) * period_ms
    cost = units * period_ms
    after = ahead + cost
    if after <= cap or ahead == 0:
        return Decision(True, now_ms + after // limit, after % limit, 0)
    slack = max(0, cap - cost)
    return Decision(False, tat_ms, tat_rem, -(-(ahead - slack) // limit))


def check_limit_key(value: object, field_name: str) -> LimitKey:
    """`value` if it is a valid `LimitKey`, else InvalidArgument naming `field_name`."""
    if not isinstance(value, LimitKey):
        raise InvalidArgument(field_name, "must be a LimitKey")
    if not isinstance(value.limit, str) or not value.limit or _CONTROL.search(value.limit):
        raise InvalidArgument(f"{field_name}.limit", "must be a non-empty name without control characters")
    if not isinstance(value.key, str) or "\x00" in value.key:
        raise InvalidArgument(f"{field_name}.key", "must be a string without NUL characters")
    units = value.units
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise InvalidArgument(f"{field_name}.units", "must be an integer of at least 1")
    return value


def encode_group(limits: Iterable[LimitKey], field_name: str = "limits") -> str:
    """The canonical group of a run's limit keys: sorted, one entry per (limit, key) with their
    units summed, as compact JSON `[[limit, key, units], ...]`; '' for none.

    Every run with the same limit keys has the same group string (the scripts never re-encode it).
    """
    units: dict[tuple[str, str], int] = {}
    for index, value in enumerate(limits):
        item = check_limit_key(value, f"{field_name}[{index}]")
        units[(item.limit, item.key)] = units.get((item.limit, item.key), 0) + item.units
    if not units:
        return ""
    if len(units) > MAX_GROUP_KEYS:
        raise InvalidArgument(field_name, f"at most {MAX_GROUP_KEYS} limit keys")
    entries = [[limit, key, n] for (limit, key), n in sorted(units.items())]
    return json.dumps(entries, separators=(",", ":"), ensure_ascii=False)


def encode_definition(definition: LimitDefinition, field_name: str = "definitions") -> tuple[str, str]:
    """`(name, encoded)` as stored in `{q}:limdef`, validated (InvalidArgument names the field)."""
    d = definition
    if not isinstance(d, LimitDefinition):
        raise InvalidArgument(field_name, "must be a LimitDefinition")
    if not isinstance(d.name, str) or not d.name or _CONTROL.search(d.name):
        raise InvalidArgument(f"{field_name}.name", "must be a non-empty name without control characters")
    if d.kind not in ("concurrency", "rate"):
        raise InvalidArgument(f"{field_name}.kind", "must be 'concurrency' or 'rate'")
    _check_count(d.limit, f"{field_name}.limit")
    _check_count(d.burst, f"{field_name}.burst")
    period_ms = 0
    if d.kind == "rate":
        if not isinstance(d.period, timedelta) or d.period < _MS:
            raise InvalidArgument(f"{field_name}.period", "a rate needs a period of at least 1 ms")
        period_ms = -(-d.period // _MS)
    overrides: dict[str, list[int]] = {}
    for key, pair in d.overrides.items():
        if not isinstance(key, str) or "\x00" in key or not isinstance(pair, tuple) or len(pair) != 2:
            raise InvalidArgument(f"{field_name}.overrides", "maps a key to (limit, burst)")
        _check_count(pair[0], f"{field_name}.overrides[{key!r}].limit")
        _check_count(pair[1], f"{field_name}.overrides[{key!r}].burst")
        overrides[key] = [pair[0], pair[1]]
    body = {"k": "c" if d.kind == "concurrency" else "r", "l": d.limit, "p": period_ms, "b": d.burst, "o": overrides}
    return d.name, json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def _check_count(value: object, field_name: str) -> None:
    # Below 2**40: every product the scripts form stays an exact integer in a double.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**40:
        raise InvalidArgument(field_name, "must be an integer from 0 to 2**40 - 1")
