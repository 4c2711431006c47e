"""Cron schedules in IANA time zones, with explicit daylight-saving policies.

croniter is used only to walk *local wall-clock* times (naive datetimes); this module maps each
wall-clock slot to UTC instants itself, so DST behaviour is ours and documented:

* A slot inside a skipped local hour (spring forward) fires once at the first valid instant after
  the gap (`shift`, the default) or not at all (`skip`). Several skipped slots collapse into one fire.
* A slot inside a repeated local hour (fall back) fires once, on its first occurrence (`first`,
  the default) or on both occurrences (`both`). The dedupe is on the wall-clock slot, which is what
  croniter alone gets wrong: it fires `30 1 * * *` twice on the fall-back night.

The scheduler and `PreviewSchedule` both use `fire_times`, so a preview is exactly what will fire.
Catch-up planning finds the end of a run of misfires with `last_fire_before` and counts it with
`count_fires`: both agree with `fire_times` but never walk every slot of a long outage.
"""

from __future__ import annotations

import copy
import enum
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadCronError, CroniterBadDateError, CroniterError, croniter

from scheduler_grpc.errors import InvalidArgument

MAX_CRON_LENGTH = 200
_ALIASES = frozenset({"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"})
_FIELD = re.compile(r"^[0-9A-Za-z*/,?LW#-]+$")


class GapPolicy(enum.StrEnum):
    SHIFT = "shift"
    SKIP = "skip"


class FoldPolicy(enum.StrEnum):
    FIRST = "first"
    BOTH = "both"


class DstEffect(enum.StrEnum):
    """How daylight-saving time changed a fire time, for previews and history."""

    NONE = "none"
    SHIFTED = "shifted"  # the local slot did not exist; fired at the end of the gap
    REPEATED = "repeated"  # the local slot happened twice; this is its second occurrence


@dataclass(frozen=True)
class CronSchedule:
    """A validated cron expression in a time zone, with DST policies.

    `seconds` is True for 6-field expressions, whose FIRST field is the second (as in Quartz and
    Spring): `*/5 * * * * *` fires every five seconds.
    """

    expression: str
    time_zone: str
    gap_policy: GapPolicy = GapPolicy.SHIFT
    fold_policy: FoldPolicy = FoldPolicy.FIRST

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.time_zone)

    @property
    def seconds(self) -> bool:
        return len(self.expression.split()) == 6


@dataclass(frozen=True)
class FireTime:
    """One instant a schedule fires at, and the local wall-clock slot it belongs to."""

    instant: datetime  # aware, UTC
    local_slot: datetime  # naive wall-clock time in the schedule's zone
    dst: DstEffect = DstEffect.NONE


def parse_time_zone(name: str, field: str = "time_zone") -> ZoneInfo:
    """Resolve an IANA zone name (tzdata ships with the package), or raise InvalidArgument."""
    if not name or len(name) > 64 or ".." in name or name.startswith("/"):
        raise InvalidArgument(field, f"unknown time zone {name!r}; use an IANA name such as Europe/Paris")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidArgument(field, f"unknown time zone {name!r}; use an IANA name such as Europe/Paris") from None


def parse_cron(
    expression: str,
    time_zone: str = "UTC",
    gap_policy: GapPolicy | str = GapPolicy.SHIFT,
    fold_policy: FoldPolicy | str = FoldPolicy.FIRST,
    *,
    field: str = "cron",
) -> CronSchedule:
    """Validate a cron expression and build a schedule.

    croniter accepts 7 fields (seconds + year) and expressions that never fire (`0 0 31 2 *`,
    found only when iterated); both are refused here: the fields are counted, and one next fire
    time is computed.

    Raises:
        InvalidArgument: naming `field` (or `time_zone`, `dst_gap_policy`, `dst_fold_policy`).
    """
    expression = " ".join(expression.split())
    if not expression:
        raise InvalidArgument(field, "must not be empty")
    if len(expression) > MAX_CRON_LENGTH:
        raise InvalidArgument(field, f"must be at most {MAX_CRON_LENGTH} characters")
    parse_time_zone(time_zone)
    try:
        gap = GapPolicy(gap_policy)
    except ValueError:
        raise InvalidArgument("dst_gap_policy", "expected 'shift' or 'skip'") from None
    try:
        fold = FoldPolicy(fold_policy)
    except ValueError:
        raise InvalidArgument("dst_fold_policy", "expected 'first' or 'both'") from None
    fields = expression.split()
    if expression.startswith("@"):
        if expression not in _ALIASES:
            raise InvalidArgument(field, f"unknown alias {expression!r}; known: {', '.join(sorted(_ALIASES))}")
    elif len(fields) not in (5, 6):
        raise InvalidArgument(
            field,
            f"expected 5 fields (minute hour day month weekday) or 6 with seconds first, got {len(fields)}",
        )
    elif not all(_FIELD.match(part) for part in fields):
        raise InvalidArgument(field, f"invalid characters in {expression!r}")
    schedule = CronSchedule(expression, time_zone, gap, fold)
    try:
        _walk(schedule, datetime(2000, 1, 1))
        next(fire_times(schedule, datetime.now(UTC)))
    except (CroniterBadCronError, CroniterError, ValueError, KeyError) as exc:
        raise InvalidArgument(field, f"invalid cron expression {expression!r}: {exc}") from None
    except (CroniterBadDateError, StopIteration):
        raise InvalidArgument(field, f"{expression!r} never fires") from None
    return schedule


def _walk(schedule: CronSchedule, start_local: datetime) -> croniter:
    # Parsing the expression costs more than a few steps of the walk, and catch-up planning starts
    # several walks per job: copy a parsed walker (croniter copies its fields before each step).
    walker = copy.copy(_parsed(schedule.expression, schedule.seconds))
    walker.set_current(start_local, force=True)
    return walker


@functools.lru_cache(maxsize=4096)
def _parsed(expression: str, seconds: bool) -> croniter:
    return croniter(expression, datetime(2000, 1, 1), second_at_beginning=seconds)


def _instant(local: datetime, zone: ZoneInfo, fold: int) -> datetime:
    return local.replace(tzinfo=zone, fold=fold).astimezone(UTC)


def _exists(local: datetime, zone: ZoneInfo) -> bool:
    return _instant(local, zone, 0).astimezone(zone).replace(tzinfo=None) == local


def _gap_end(local: datetime, zone: ZoneInfo) -> datetime:
    """The transition instant ending the gap that swallows the non-existent wall time `local`."""
    # Interpreted with the offset after the jump, `local` lands before the transition; with the
    # offset before the jump, after it. Bisect on whole seconds (zone transitions are whole seconds).
    low = int(_instant(local, zone, 1).timestamp())
    high = int(_instant(local, zone, 0).timestamp())
    while high - low > 1:
        middle = (low + high) // 2
        if datetime.fromtimestamp(middle, zone).replace(tzinfo=None) > local:
            high = middle
        else:
            low = middle
    return datetime.fromtimestamp(high, UTC)


def fire_times(schedule: CronSchedule, after: datetime) -> Iterator[FireTime]:
    """Yield the fire times strictly after `after` (aware), in increasing order, forever.

    A schedule that never fires again ends the iterator (croniter gives up after a search limit).
    """
    zone = schedule.zone
    after = after.astimezone(UTC)
    start = after.astimezone(zone).replace(tzinfo=None)
    # Inside a repeated hour, slots earlier on the wall clock may still have a later second
    # occurrence: start the walk one DST delta earlier and let the `> after` filter sort it out.
    first, second = _instant(start, zone, 0), _instant(start, zone, 1)
    if second != first:
        start -= second - first
    walker = _walk(schedule, start - timedelta(seconds=1))
    deferred: list[FireTime] = []  # second occurrences, due after every first one of the same fold
    last: datetime | None = None
    while True:
        try:
            local = walker.get_next(datetime)
        except CroniterBadDateError:
            return
        candidates: list[FireTime] = []
        fold0, fold1 = _instant(local, zone, 0), _instant(local, zone, 1)
        if not _exists(local, zone):
            if schedule.gap_policy is GapPolicy.SHIFT:
                candidates.append(FireTime(_gap_end(local, zone), local, DstEffect.SHIFTED))
        elif fold0 != fold1:
            candidates.append(FireTime(fold0, local))
            if schedule.fold_policy is FoldPolicy.BOTH:
                deferred.append(FireTime(fold1, local, DstEffect.REPEATED))
        else:
            # Past the repeated hour: its second occurrences all come before this slot.
            candidates = [*deferred, FireTime(fold0, local)]
            deferred = []
        for fire in candidates:
            if fire.instant > after and (last is None or fire.instant > last):
                last = fire.instant
                yield fire


def next_fire_time(schedule: CronSchedule, after: datetime) -> FireTime | None:
    """The first fire time strictly after `after`, or None if the schedule never fires again."""
    return next(fire_times(schedule, after), None)


def next_instant(schedule: CronSchedule, after: datetime) -> datetime | None:
    """The first fire instant strictly after `after`, or None if the schedule never fires again.

    What `next_fire_time` answers, but cheap enough to call per job per slot on the leader's
    fire path: a fixed-period schedule (see `fixed_period`) is pure arithmetic, and any other is
    walked once per (schedule, instant) and remembered, so the thousand jobs sharing `* * 9 * * *`
    and a slot cost one croniter walk between them, not one each. Calling it again from the
    instant it returned continues the walk exactly (`fire_times` yields from any start what a
    walk from an earlier start yields after it).
    """
    grid = _grid(schedule)
    if grid is not None:  # the slots are anchor + k * period
        period, anchor = grid
        return anchor + ((after - anchor) // period + 1) * period
    return _next_instant_walked(schedule, after.astimezone(UTC))


@functools.lru_cache(maxsize=4096)
def _grid(schedule: CronSchedule) -> tuple[timedelta, datetime] | None:
    """(period, a fire instant) of a fixed-period schedule, else None: one cache lookup per slot."""
    period = fixed_period(schedule)
    return None if period is None else (period, _anchor(schedule))


@functools.lru_cache(maxsize=65536)
def _next_instant_walked(schedule: CronSchedule, after: datetime) -> datetime | None:
    fire = next_fire_time(schedule, after)
    return fire.instant if fire is not None else None


def instants(schedule: CronSchedule, after: datetime) -> Iterator[datetime]:
    """The fire instants strictly after `after`, in increasing order (`next_instant` repeated)."""
    while (following := next_instant(schedule, after)) is not None:
        yield following
        after = following


def last_fire_before(schedule: CronSchedule, first: datetime, bound: datetime) -> datetime:
    """The last fire time in `[first, bound)`, where `first` is a fire time earlier than `bound`.

    Never walks every slot in between. A fixed-period schedule (see `fixed_period`) needs no walk
    at all. Otherwise: look back from `bound` in doubling windows (1 s, 2 s, 4 s, ...: one croniter
    step each) for the first one that holds a fire time, walk forward inside it at most
    `_WALK_BEFORE_BISECTING` steps, and if the window holds more (a burst of slots after a long
    quiet stretch, such as `* * 0 * * *`) bisect it. O(log(bound - first)) croniter steps in
    all. It relies on `fire_times` yielding from any start exactly what a walk from an earlier
    start yields after it (DST policies included).
    """
    if first >= bound:
        raise ValueError("first must be earlier than bound")
    period = fixed_period(schedule)
    if period is not None:  # the slots are anchor + k * period
        anchor = _anchor(schedule)
        return max(first, anchor + (bound - anchor - timedelta(microseconds=1)) // period * period)

    def next_before_bound(after: datetime) -> datetime | None:
        """The first fire time after `after`, if it is earlier than `bound`."""
        fire = next_fire_time(schedule, after)
        return fire.instant if fire is not None and fire.instant < bound else None

    # Invariants: `low` is `first` or a fire time earlier than `bound`, and no fire time lies in
    # (high, bound); so the answer is in [low, high].
    low, high, reach = first, bound, timedelta(seconds=1)
    while bound - reach > first:
        start = bound - reach
        found = next_before_bound(start)
        if found is not None:
            low = found
            break
        high = start
        reach *= 2
    for _ in range(_WALK_BEFORE_BISECTING):
        found = next_before_bound(low)
        if found is None:
            return low
        low = found
    while (found := next_before_bound(low)) is not None:
        middle = low + (high - low) // 2  # floor: every round moves low up or high down
        further = next_before_bound(middle)
        if further is None:
            high = middle
        else:
            low = max(found, further)
    return low


_WALK_BEFORE_BISECTING = 16


# Time zones whose UTC offset never changes: a fixed-period wall-clock schedule is fixed-period in
# UTC there too (elsewhere a DST change can drop or repeat slots).
_FIXED_ZONES = frozenset({"UTC", "Etc/UTC", "Etc/UCT", "UCT", "GMT", "Etc/GMT", "Etc/Universal", "Universal",
                          "Etc/Zulu", "Zulu", "Etc/Greenwich", "Greenwich", "GMT0", "Etc/GMT0"})  # fmt: skip
_FIXED_ZONE = re.compile(r"^Etc/GMT[+-]\d{1,2}$")
# (seconds per step, values per cycle) of the second, minute and hour fields.
_UNITS = ((1, 60), (60, 60), (3600, 24))


@functools.lru_cache(maxsize=4096)
def fixed_period(schedule: CronSchedule) -> timedelta | None:
    """The period between consecutive fire instants, if it is the same everywhere; else None.

    True of schedules like `*/5 * * * * *`, `30 */5 * * * *`, `*/15 * * * *`, `@hourly` or
    `0 3 * * *` (a field stepping evenly through its whole cycle, every smaller field fixed, every
    larger one `*`) in a time zone whose offset never changes (UTC, `Etc/GMT+N`).
    """
    if schedule.time_zone not in _FIXED_ZONES and not _FIXED_ZONE.match(schedule.time_zone):
        return None
    expanded = _walk(schedule, datetime(2000, 1, 1)).expanded
    minute, hour, day, month, weekday = expanded[:5]
    if any(field != ["*"] for field in (day, month, weekday)):
        return None
    fields = [expanded[5] if schedule.seconds else [0], minute, hour]
    for index, ((unit, cycle), values) in enumerate(zip(_UNITS, fields, strict=True)):
        if len(values) == 1 and values != ["*"]:
            continue  # fixed: the period is set by a larger field
        step = 1 if values == ["*"] else _even_step(values, cycle)
        if step is None or any(field != ["*"] for field in fields[index + 1 :]):
            return None
        return timedelta(seconds=unit * step)
    return timedelta(days=1)


@functools.lru_cache(maxsize=4096)
def _anchor(schedule: CronSchedule) -> datetime:
    """A fire time of a fixed-period schedule: every other one is a whole number of periods away."""
    fire = next_fire_time(schedule, datetime(2000, 1, 1, tzinfo=UTC))
    assert fire is not None  # a fixed-period schedule fires forever
    return fire.instant


def _even_step(values: list[object], cycle: int) -> int | None:
    """`k` when `values` is exactly 0, k, 2k, ... through a whole cycle (k dividing it); else None."""
    if not all(isinstance(value, int) for value in values) or len(values) < 2:
        return None
    step = int(str(values[1])) - int(str(values[0]))
    if step <= 0 or cycle % step or values != list(range(0, cycle, step)):
        return None
    return step


def count_fires(schedule: CronSchedule, first: datetime, last: datetime, *, walk_limit: int) -> int | None:
    """How many fire times lie in `[first, last]` (both fire times), or None if not cheaply known.

    Arithmetic for a fixed-period schedule (see `fixed_period`); otherwise by walking, if the
    range holds at most `walk_limit` fire times. Elsewhere (a long range of a schedule in a DST
    zone, or an irregular one) the answer is None rather than a walk over every slot.
    """
    if last < first:
        return 0
    period = fixed_period(schedule)
    if period is not None:  # `first` and every slot of the grid in (first, last]
        anchor = _anchor(schedule)
        return 1 + (last - anchor) // period - (first - anchor) // period
    count = 1
    for fire in fire_times(schedule, first):
        if fire.instant > last:
            return count
        count += 1
        if count > walk_limit:
            return None
    return count
