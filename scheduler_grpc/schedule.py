"""Cron schedules in IANA time zones, with explicit daylight-saving policies.

The expression is parsed here, field by field, into explicit sets of values (`_compile`), and
walked over *local wall-clock* times (naive datetimes) by `_next_local`; no third-party cron
library decides what an expression means, so its meaning does not change with a dependency's
version. The accepted syntax is Vixie cron's, as Debian's cron, cronsim and Node's cron-parser
read it (fixtures from the last two are in tests/data/cron_oracle.json):

* 5 fields `minute hour day-of-month month day-of-week`, or 6 with the second first; the aliases
  `@yearly`/`@annually`, `@monthly`, `@weekly`, `@daily`/`@midnight`, `@hourly`.
* In every field: `*`, a value, a range `a-b` (`3-3` is just 3), a step `*/n`, `a-b/n` or `a/n`
  (`a/n` is `a-<field max>/n`), and comma lists of these. A range whose start is after its end
  wraps around the field (`22-2` is 22, 23, 0, 1, 2; `FRI-MON` is Friday to Monday).
* Months take `JAN`-`DEC`, days of the week `SUN`-`SAT`, in any case. The day of the week is 0-7,
  0 and 7 both Sunday: `1/2` and `1-7/2` are Monday, Wednesday, Friday and Sunday, `7/1` is Sunday.
* Day of month: `L` (the last day), `nW` (the weekday nearest day n, in the same month; no fire in
  a month without day n), `?` (as `*`). Day of week: `n#k` (the k-th such weekday, k 1-5), `?`.
* If the day-of-month or the day-of-week field starts with `*` or `?`, a day must match both;
  otherwise either (Vixie cron's rule: `0 0 1,15 * MON` fires on the 1st, the 15th and Mondays).

Local wall-clock slots are mapped to UTC instants here too, so DST behaviour is ours and documented:

* A slot inside a skipped local hour (spring forward) fires once at the first valid instant after
  the gap (`shift`, the default) or not at all (`skip`). Several skipped slots collapse into one fire.
* A slot inside a repeated local hour (fall back) fires once, on its first occurrence (`first`,
  the default) or on both occurrences (`both`). The dedupe is on the wall-clock slot (a walk of
  aware local times fires `30 1 * * *` twice on the fall-back night).

The scheduler and `PreviewSchedule` both use `fire_times`, so a preview is exactly what will fire.
Catch-up planning finds the end of a run of misfires with `last_fire_before` and counts it with
`count_fires`: both agree with `fire_times` but never walk every slot of a long outage.
"""

from __future__ import annotations

import bisect
import calendar
import enum
import functools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from scheduler_grpc.errors import InvalidArgument

log = logging.getLogger(__name__)

MAX_CRON_LENGTH = 200
_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


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


class CronSyntaxError(ValueError):
    """An expression `_compile` refuses; the message says which field and why."""


# (name, lowest, highest) of the six fields, seconds first. The day of the week runs to 7 (Sunday
# again), as in Vixie cron, so `1-7` and `1/2` reach Sunday; 7 is stored as 0.
_BOUNDS = (("second", 0, 59), ("minute", 0, 59), ("hour", 0, 23),
           ("day-of-month", 1, 31), ("month", 1, 12), ("day-of-week", 0, 7))  # fmt: skip
_SECOND, _MINUTE, _HOUR, _DOM, _MONTH, _DOW = range(6)
_NAMES = {  # English whatever the locale (`calendar`'s names follow LC_TIME)
    _MONTH: {
        name: number
        for number, name in enumerate(
            ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1
        )
    },
    _DOW: {name: number for number, name in enumerate(("Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"))},
}
_ITEM = re.compile(r"^(?:(?P<any>[*?])|(?P<start>[0-9A-Za-z]+)(?:-(?P<end>[0-9A-Za-z]+))?)(?:/(?P<step>[0-9]+))?$")
_NEAREST = re.compile(r"^(?P<day>[0-9]+)W$")
_NTH = re.compile(r"^(?P<day>[0-9A-Za-z]+)#(?P<nth>[0-9]+)$")
# The Gregorian calendar repeats every 400 years (146,097 days, a whole number of weeks): a
# schedule with no fire in 400 years and a month never fires.
_SEARCH_MONTHS = 400 * 12 + 1


@dataclass(frozen=True)
class _Days:
    """Which days of a month match: the day-of-month and day-of-week fields, and how they combine."""

    dom: frozenset[int]  # 1-31
    last: bool  # `L`: the last day of the month
    nearest: int | None  # `nW`: the weekday nearest day n
    dow: frozenset[int]  # 0-6, 0 = Sunday
    nth: frozenset[tuple[int, int]]  # `d#k`: (weekday, k)
    both: bool  # a day must match both fields (one of them starts with `*` or `?`), else either


@dataclass(frozen=True)
class _Spec:
    """A compiled expression: the explicit values of every field."""

    seconds: tuple[int, ...]
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    months: frozenset[int]
    days: _Days


def _value(text: str, index: int) -> int:
    name, low, high = _BOUNDS[index]
    names = _NAMES.get(index, {})
    if text.isascii() and text.isdigit():
        number = int(text)
    elif text.capitalize() in names:
        number = names[text.capitalize()]
    else:
        known = f" or a name such as {next(iter(names)).upper()}" if names else ""
        raise CronSyntaxError(f"{name} field: {text!r} is not a number{known}")
    if not low <= number <= high:
        raise CronSyntaxError(f"{name} field: {number} is outside {low}-{high}")
    return number


def _item(text: str, index: int) -> list[int]:
    """The values of one comma-separated item of a numeric field, in stepping order."""
    name, low, high = _BOUNDS[index]
    match = _ITEM.match(text)
    if match is None:
        raise CronSyntaxError(f"{name} field: cannot read {text!r}")
    if match["any"] == "?" and index not in (_DOM, _DOW):
        raise CronSyntaxError(f"{name} field: '?' is only for day-of-month and day-of-week")
    step = 1 if match["step"] is None else int(match["step"])
    if step < 1:
        raise CronSyntaxError(f"{name} field: the step in {text!r} must be at least 1")
    if match["any"]:
        return list(range(low, high + 1))[::step]
    start = _value(match["start"], index)
    end = start  # a single value; `a/n` is `a-<max>/n`
    if match["end"] is not None:
        end = _value(match["end"], index)
    elif match["step"] is not None:
        end = high
    if index == _DOW and start > end:
        start %= 7  # `7-1` is Sunday to Monday; a range wrapping round the week uses 0-6
        high = 6
    if start <= end:
        return list(range(start, end + 1))[::step]
    # A range wrapping round the field: `22-2` is 22, 23, 0, 1, 2.
    values = [*range(start, high + 1), *range(low, end + 1)]
    return values[::step]


def _field(text: str, index: int) -> frozenset[int]:
    """The values of a numeric field (the day of the week with 7 read as 0)."""
    values = {value for item in _split(text, index) for value in _item(item, index)}
    return frozenset(value % 7 for value in values) if index == _DOW else frozenset(values)


def _split(text: str, index: int) -> list[str]:
    items = text.split(",")
    if not all(items):
        raise CronSyntaxError(f"{_BOUNDS[index][0]} field: empty item in {text!r}")
    return items


def _days(dom_text: str, dow_text: str) -> _Days:
    dom: set[int] = set()
    last, nearest = False, None
    for item in _split(dom_text, _DOM):
        upper = item.upper()
        if upper == "L":
            last = True
        elif (match := _NEAREST.match(upper)) is not None:
            if dom_text.count(",") or nearest is not None:
                raise CronSyntaxError(f"day-of-month field: 'W' only with a single day, not in a list ({dom_text!r})")
            nearest = _value(match["day"], _DOM)
        elif "L" in upper or "W" in upper:
            raise CronSyntaxError(f"day-of-month field: {item!r}: 'L' stands alone and 'W' follows one day (15W)")
        else:
            dom.update(_item(item, _DOM))
    dow: set[int] = set()
    nth: set[tuple[int, int]] = set()
    for item in _split(dow_text, _DOW):
        if (match := _NTH.match(item)) is not None:
            k = int(match["nth"])
            if not 1 <= k <= 5:
                raise CronSyntaxError(f"day-of-week field: {item!r}: the week after '#' must be 1-5")
            nth.add((_value(match["day"], _DOW) % 7, k))
        elif "#" in item or item.upper().endswith("L"):
            raise CronSyntaxError(f"day-of-week field: {item!r}: supported are values, ranges, steps and d#k")
        else:
            dow.update(value % 7 for value in _item(item, _DOW))
    both = dom_text.startswith(("*", "?")) or dow_text.startswith(("*", "?"))
    return _Days(frozenset(dom), last, nearest, frozenset(dow), frozenset(nth), both)


@functools.lru_cache(maxsize=4096)
def _compile(expression: str) -> _Spec:
    """Parse a normalised (single-spaced) expression into explicit field values.

    Raises:
        CronSyntaxError: naming the field at fault.
    """
    fields = _ALIASES.get(expression, expression).split()
    if len(fields) == 5:
        fields.insert(0, "0")
    if len(fields) != 6:
        raise CronSyntaxError(
            f"expected 5 fields (minute hour day month weekday) or 6 with seconds first, got {len(fields)}"
        )
    second, minute, hour, dom, month, dow = fields
    return _Spec(
        tuple(sorted(_field(second, _SECOND))),
        tuple(sorted(_field(minute, _MINUTE))),
        tuple(sorted(_field(hour, _HOUR))),
        _field(month, _MONTH),
        _days(dom, dow),
    )


@functools.lru_cache(maxsize=8192)
def _month_days(days: _Days, year: int, month: int) -> tuple[int, ...]:
    """The days of `month` that `days` matches, in order."""
    first_weekday, length = calendar.monthrange(year, month)
    first = (first_weekday + 1) % 7  # cron numbering: 0 = Sunday

    def weekday(day: int) -> int:
        return (first + day - 1) % 7

    by_dom = {day for day in days.dom if day <= length}
    if days.last:
        by_dom.add(length)
    if days.nearest is not None and days.nearest <= length:
        day = days.nearest
        if weekday(day) == 6:  # Saturday: the Friday before, or Monday if the 1st
            day = day - 1 if day > 1 else day + 2
        elif weekday(day) == 0:  # Sunday: the Monday after, or Friday if the last day
            day = day + 1 if day < length else day - 2
        by_dom.add(day)
    by_dow = {day for day in range(1, length + 1) if weekday(day) in days.dow}
    for wanted, k in days.nth:
        day = 1 + (wanted - first) % 7 + 7 * (k - 1)
        if day <= length:
            by_dow.add(day)
    return tuple(sorted(by_dom & by_dow if days.both else by_dom | by_dow))


def _first_time(spec: _Spec, hour: int, minute: int, second: int) -> tuple[int, int, int] | None:
    """The first (hour, minute, second) of `spec` at or after the given time of day, if any."""
    for h in spec.hours[bisect.bisect_left(spec.hours, hour) :]:
        if h > hour:
            return h, spec.minutes[0], spec.seconds[0]
        for m in spec.minutes[bisect.bisect_left(spec.minutes, minute) :]:
            if m > minute:
                return h, m, spec.seconds[0]
            index = bisect.bisect_left(spec.seconds, second)
            if index < len(spec.seconds):
                return h, m, spec.seconds[index]
    return None


def _next_local(spec: _Spec, after: datetime) -> datetime | None:
    """The first wall-clock time `spec` names strictly after `after` (naive), or None if none ever."""
    start = after.replace(microsecond=0) + timedelta(seconds=1)
    year, month, day = start.year, start.month, start.day
    clock = (start.hour, start.minute, start.second)
    for _ in range(_SEARCH_MONTHS):
        if month in spec.months:
            days = _month_days(spec.days, year, month)
            for candidate in days[bisect.bisect_left(days, day) :]:
                time = _first_time(spec, *clock) if candidate == day else _first_time(spec, 0, 0, 0)
                if time is not None:
                    return datetime(year, month, candidate, *time)
        year, month = (year + 1, 1) if month == 12 else (year, month + 1)
        day, clock = 1, (0, 0, 0)
        if year > datetime.max.year:
            return None
    return None


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

    Expressions that never fire (`0 0 31 2 *`) are refused too.

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
    if expression.startswith("@") and expression not in _ALIASES:
        raise InvalidArgument(field, f"unknown alias {expression!r}; known: {', '.join(sorted(_ALIASES))}")
    try:
        _compile(expression)
    except CronSyntaxError as exc:
        raise InvalidArgument(field, f"invalid cron expression {expression!r}: {exc}") from None
    schedule = CronSchedule(expression, time_zone, gap, fold)
    if next_fire_time(schedule, datetime.now(UTC)) is None:
        raise InvalidArgument(field, f"{expression!r} never fires")
    return schedule


def _spec(schedule: CronSchedule) -> _Spec | None:
    """The compiled expression, or None (logged once) for one stored by a version that accepted it."""
    try:
        return _compile(schedule.expression)
    except CronSyntaxError as exc:
        _refused_once(schedule.expression, str(exc))
        return None


@functools.lru_cache(maxsize=256)
def _refused_once(expression: str, reason: str) -> None:
    # An expression validated by an earlier version (another cron library) that this one refuses:
    # the schedule does not fire rather than stop the role that walks it.
    log.error("cron expression %r is no longer accepted (%s); it will not fire until edited", expression, reason)


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

    A schedule that never fires again ends the iterator.
    """
    spec = _spec(schedule)
    if spec is None:
        return
    zone = schedule.zone
    after = after.astimezone(UTC)
    start = after.astimezone(zone).replace(tzinfo=None)
    # Inside a repeated hour, slots earlier on the wall clock may still have a later second
    # occurrence: start the walk one DST delta earlier and let the `> after` filter sort it out.
    first, second = _instant(start, zone, 0), _instant(start, zone, 1)
    if second != first:
        start -= second - first
    local = start - timedelta(seconds=1)
    deferred: list[FireTime] = []  # second occurrences, due after every first one of the same fold
    last: datetime | None = None
    while True:
        following = _next_local(spec, local)
        if following is None:
            return
        local = following
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
    and a slot cost one walk between them, not one each. Calling it again from the
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
    at all. Otherwise: look back from `bound` in doubling windows (1 s, 2 s, 4 s, ...: one walk
    step each) for the first one that holds a fire time, walk forward inside it at most
    `_WALK_BEFORE_BISECTING` steps, and if the window holds more (a burst of slots after a long
    quiet stretch, such as `* * 0 * * *`) bisect it. O(log(bound - first)) walk steps in
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
    spec = _spec(schedule)
    if spec is None or spec.months != frozenset(range(1, 13)) or not _every_day(spec.days):
        return None
    fields = (spec.seconds, spec.minutes, spec.hours)
    for index, ((unit, cycle), values) in enumerate(zip(_UNITS, fields, strict=True)):
        if len(values) == 1:
            continue  # fixed: the period is set by a larger field
        step = _even_step(values, cycle)
        if step is None or any(
            len(larger) != cycle_ for (_, cycle_), larger in zip(_UNITS[index + 1 :], fields[index + 1 :], strict=True)
        ):
            return None
        return timedelta(seconds=unit * step)
    return timedelta(days=1)


def _every_day(days: _Days) -> bool:
    """Whether the day fields match every day of every month."""
    by_dom = days.dom == frozenset(range(1, 32))
    by_dow = days.dow == frozenset(range(7))
    return (by_dom and by_dow) if days.both else (by_dom or by_dow)


@functools.lru_cache(maxsize=4096)
def _anchor(schedule: CronSchedule) -> datetime:
    """A fire time of a fixed-period schedule: every other one is a whole number of periods away."""
    fire = next_fire_time(schedule, datetime(2000, 1, 1, tzinfo=UTC))
    assert fire is not None  # a fixed-period schedule fires forever
    return fire.instant


def _even_step(values: tuple[int, ...], cycle: int) -> int | None:
    """`k` when `values` is exactly 0, k, 2k, ... through a whole cycle (k dividing it); else None."""
    step = values[1] - values[0]
    if cycle % step or values != tuple(range(0, cycle, step)):
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
