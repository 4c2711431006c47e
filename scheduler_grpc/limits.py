"""Limits (issue 22): named flow-control definitions, and the limit references a job carries.

Pure domain code: no I/O. A **limit** is a definition: a unique `name` (the job-name rule), a
`kind` (`concurrency`: at most `limit` units held at once per key; `rate`: `limit` units per
`period`, with `burst` extra units allowed at once) and optional per-key `overrides` of `limit`
and `burst`. A **limit ref** on a job names a limit, the key each run of the job takes (a key
template), and how many units a run takes.

A key template is either a constant (`billing-api`: every run takes the same key) or a path into
the run's payload, `payload.<field>[.<field>...]` (`payload.customer_id`): the value found there
(a string, an integer or a boolean, as text) is the key. Templates are checked when a job is
defined (`validate_refs`); they are resolved when a run is fired or triggered (`resolve_keys`),
and a payload that cannot give a key (a missing path, another type of value, a key too long) is
a `LimitKeyError` whose message the caller records as the reason the run failed.

This module defines and checks limits only; admitting runs under them is the queue's work.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Final

from scheduler_grpc.errors import InvalidArgument, SchedulerError
from scheduler_grpc.rules import NAME_RULE, is_name

MAX_LIMIT: Final = 1_000_000
"""The largest `limit` (units held at once, or units per period)."""
MAX_BURST: Final = 1_000_000
"""The largest `burst` of a rate limit."""
MIN_PERIOD: Final = timedelta(milliseconds=1)
"""The shortest period of a rate limit."""
MAX_PERIOD: Final = timedelta(days=1)
"""The longest period of a rate limit."""
MAX_OVERRIDES: Final = 1000
"""Per-key overrides a limit may carry."""
MAX_KEY_LENGTH: Final = 200
"""Characters of a key (a constant template, a resolved key, an override's key), at most."""
MAX_REFS: Final = 4
"""Limit refs a job may carry."""
MAX_UNITS: Final = MAX_LIMIT
"""Units one run may take of one limit (also at most the limit's `limit`: see `check_units`)."""
MAX_PATH_DEPTH: Final = 20
"""Fields in a payload path (a payload is nested at most 20 deep: `jobs.MAX_PAYLOAD_DEPTH`)."""
PAYLOAD_PREFIX: Final = "payload."
"""How a key template that is a path into the run's payload starts."""


class LimitKind(enum.StrEnum):
    """What a limit counts."""

    CONCURRENCY = "concurrency"  # units held at once per key
    RATE = "rate"  # units started per period per key (GCRA), with a burst


class LimitKeyError(SchedulerError):
    """A run's payload gives no key for one of its job's limit refs; the message says why (the
    caller fails the run with it)."""


@dataclass(frozen=True)
class Override:
    """A key's own `limit` (and `burst`, rate limits only) in place of the limit's."""

    limit: int
    burst: int = 0


@dataclass(frozen=True)
class LimitSpec:
    """Everything a user defines about a limit (create and update input).

    Attributes:
        name: Unique; jobs refer to the limit by it (cannot be changed once created).
        kind: Concurrency or rate.
        limit: Units held at once (concurrency), or units per `period` (rate), per key.
        period: The rate's period (rate limits only; None for concurrency).
        burst: Units a rate limit lets start at once beyond its steady rate (rate limits only).
        overrides: Key -> that key's own limit and burst.
    """

    name: str
    kind: LimitKind
    limit: int
    period: timedelta | None = None
    burst: int = 0
    overrides: dict[str, Override] = field(default_factory=dict)


@dataclass(frozen=True)
class Limit(LimitSpec):
    """A stored limit."""

    id: str = ""
    version: int = 1
    created_at: datetime | None = None
    updated_at: datetime | None = None

    @property
    def etag(self) -> str:
        """The version as an etag (the same weak form as a job's)."""
        return f'W/"{self.version}"'


@dataclass(frozen=True)
class KeyTemplate:
    """A parsed key template: a constant, or a path of payload fields.

    Attributes:
        text: The template as written (what is stored and shown).
        path: The payload fields to follow, outermost first; None for a constant.
    """

    text: str
    path: tuple[str, ...] | None

    @classmethod
    def parse(cls, text: str, field_name: str = "key") -> KeyTemplate:
        """The template `text` means.

        Raises:
            InvalidArgument: naming `field_name`: empty, too long, a NUL character, or a payload
                path with an empty field or too many fields.
        """
        if not isinstance(text, str) or not text:
            raise InvalidArgument(
                field_name, "required: a constant key, or payload.<field> to take it from the payload"
            )
        if len(text) > MAX_KEY_LENGTH:
            raise InvalidArgument(field_name, f"must be at most {MAX_KEY_LENGTH} characters")
        if "\x00" in text:
            raise InvalidArgument(field_name, "must not contain the NUL character (U+0000)")
        if text == "payload":
            raise InvalidArgument(field_name, "name a field of the payload: payload.<field>")
        if not text.startswith(PAYLOAD_PREFIX):
            return cls(text, None)
        path = tuple(text[len(PAYLOAD_PREFIX) :].split("."))
        if any(not part for part in path):
            raise InvalidArgument(field_name, f"{text!r}: a payload path has no empty field (payload.a.b)")
        if len(path) > MAX_PATH_DEPTH:
            raise InvalidArgument(field_name, f"a payload path has at most {MAX_PATH_DEPTH} fields")
        return cls(text, path)

    def resolve(self, payload: Mapping[str, Any]) -> str:
        """The key this template gives for a run with `payload`.

        Raises:
            LimitKeyError: the path is missing, leads through or to a value that is not an object
                (on the way) or a string, integer or boolean (at the end), or the key is empty,
                longer than `MAX_KEY_LENGTH` or holds a NUL character.
        """
        if self.path is None:
            return self.text
        value: Any = payload
        for depth, part in enumerate(self.path):
            if not isinstance(value, Mapping):
                where = PAYLOAD_PREFIX + ".".join(self.path[:depth]) if depth else "payload"
                raise LimitKeyError(f"{self.text}: {where} is {_kind_of(value)}, not an object")
            if part not in value:
                raise LimitKeyError(f"{self.text}: the payload has no such field")
            value = value[part]
        if isinstance(value, bool):
            key = "true" if value else "false"
        elif isinstance(value, int):
            key = str(value)
        elif isinstance(value, str):
            key = value
        else:
            raise LimitKeyError(f"{self.text}: the value is {_kind_of(value)}; a key is a string, integer or boolean")
        if not key:
            raise LimitKeyError(f"{self.text}: the value is an empty string; a key has at least one character")
        if len(key) > MAX_KEY_LENGTH:
            raise LimitKeyError(f"{self.text}: the value is {len(key)} characters; a key has at most {MAX_KEY_LENGTH}")
        if "\x00" in key:
            raise LimitKeyError(f"{self.text}: the value contains the NUL character (U+0000)")
        return key


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, float):
        return "a number with a fraction"
    return f"a {type(value).__name__}"


@dataclass(frozen=True)
class LimitRef:
    """A job's use of a limit: the limit's name, the key template, the units each run takes."""

    limit: str
    key: str
    units: int = 1

    @property
    def template(self) -> KeyTemplate:
        """The parsed key template (the ref is validated: it parses)."""
        return KeyTemplate.parse(self.key)


def _enum(kind: type[enum.StrEnum], value: object, field_name: str) -> Any:
    try:
        return kind(str(value))
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in kind)
        raise InvalidArgument(field_name, f"expected one of {allowed}, got {value!r}") from None


def _whole(value: object, low: int, high: int, field_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgument(field_name, f"must be a whole number between {low} and {high}")
    return value


def check_name(name: str, field_name: str = "name") -> str:
    """`name` stripped, if it is a valid limit name.

    Raises:
        InvalidArgument: naming `field_name`.
    """
    if not isinstance(name, str) or not name.strip():
        raise InvalidArgument(field_name, "must not be empty")
    name = name.strip()
    if not is_name(name):
        raise InvalidArgument(field_name, NAME_RULE)
    return name


def override_field(key: str) -> str:
    """How an error names the override of `key` (`overrides["acme"]`; a long key cut short)."""
    return f"overrides[{key[:40]!r}]"


def check_override_key(key: str, field_name: str) -> str:
    """`key` if it can be a resolved key (so an override of it can ever apply).

    Raises:
        InvalidArgument: naming `field_name`.
    """
    if not isinstance(key, str) or not key:
        raise InvalidArgument(field_name, "an override's key must not be empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidArgument(field_name, f"an override's key has at most {MAX_KEY_LENGTH} characters")
    if "\x00" in key:
        raise InvalidArgument(field_name, "an override's key must not contain the NUL character (U+0000)")
    return key


def check_override(kind: LimitKind, override: Override, field_name: str) -> Override:
    """`override` if it fits a limit of `kind`.

    Raises:
        InvalidArgument: naming `field_name`.limit or .burst.
    """
    limit = _whole(override.limit, 1, MAX_LIMIT, f"{field_name}.limit")
    if kind is LimitKind.RATE:
        burst = _whole(override.burst, 0, MAX_BURST, f"{field_name}.burst")
    elif override.burst:
        raise InvalidArgument(f"{field_name}.burst", "only a rate limit has a burst")
    else:
        burst = 0
    return Override(limit, burst)


def validate_limit(spec: LimitSpec) -> LimitSpec:
    """Check every field of `spec` and return it normalised (the name stripped).

    Raises:
        InvalidArgument: naming the first offending field (`name`, `kind`, `limit`, `period`,
            `burst`, `overrides`, `overrides[<key>].limit`, ...); nothing has been stored.
    """
    name = check_name(spec.name)
    kind = _enum(LimitKind, spec.kind, "kind")
    limit = _whole(spec.limit, 1, MAX_LIMIT, "limit")
    period = spec.period
    burst = spec.burst
    if kind is LimitKind.RATE:
        if period is None:
            raise InvalidArgument("period", "required for a rate limit (units per period)")
        if period <= timedelta(0):
            raise InvalidArgument("period", "must be positive")
        if not MIN_PERIOD <= period <= MAX_PERIOD:
            raise InvalidArgument("period", "must be between 1 ms and 24 h")
        burst = _whole(burst, 0, MAX_BURST, "burst")
    else:
        if period is not None:
            raise InvalidArgument("period", "only a rate limit has a period; leave it unset for a concurrency limit")
        if burst:
            raise InvalidArgument("burst", "only a rate limit has a burst; leave it 0 for a concurrency limit")
    if len(spec.overrides) > MAX_OVERRIDES:
        raise InvalidArgument("overrides", f"at most {MAX_OVERRIDES} per-key overrides")
    overrides = {
        check_override_key(key, override_field(key)): check_override(kind, value, override_field(key))
        for key, value in spec.overrides.items()
    }
    return replace(spec, name=name, kind=kind, limit=limit, period=period, burst=burst, overrides=overrides)


def validate_refs(refs: Sequence[LimitRef], field_name: str = "limits") -> tuple[LimitRef, ...]:
    """Check a job's limit refs on their own (not whether the limits exist: see `check_units`).

    Raises:
        InvalidArgument: naming `limits` (too many) or `limits[i].limit` (a bad name, a limit
            named twice), `limits[i].key` (a bad template) or `limits[i].units`.
    """
    if len(refs) > MAX_REFS:
        raise InvalidArgument(field_name, f"at most {MAX_REFS} limits per job")
    seen: set[str] = set()
    checked = []
    for index, ref in enumerate(refs):
        at = f"{field_name}[{index}]"
        name = check_name(ref.limit, f"{at}.limit")
        if name in seen:
            raise InvalidArgument(f"{at}.limit", f"limit {name!r} is named twice; a job takes each limit once")
        seen.add(name)
        template = KeyTemplate.parse(ref.key, f"{at}.key")
        units = _whole(ref.units, 1, MAX_UNITS, f"{at}.units")
        checked.append(LimitRef(name, template.text, units))
    return tuple(checked)


def check_units(refs: Sequence[LimitRef], limits: Mapping[str, LimitSpec], field_name: str = "limits") -> None:
    """Require every ref to name a limit of `limits` and to take no more units than it allows
    (a run asking for more could never start).

    Raises:
        InvalidArgument: naming `limits[i].limit` (no such limit) or `limits[i].units`.
    """
    for index, ref in enumerate(refs):
        spec = limits.get(ref.limit)
        if spec is None:
            raise InvalidArgument(f"{field_name}[{index}].limit", f"no limit named {ref.limit!r}")
        allowed = spec.limit + (spec.burst if spec.kind is LimitKind.RATE else 0)
        if ref.units > allowed:
            raise InvalidArgument(
                f"{field_name}[{index}].units",
                f"{ref.units} units, but limit {ref.limit!r} admits at most {allowed} at once",
            )


def resolve_keys(refs: Sequence[LimitRef], payload: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """The `(limit, key, units)` a run with `payload` takes, one per ref, in the refs' order.

    Raises:
        LimitKeyError: a ref's key cannot be resolved; the message names the ref's limit and
            template and says why (the run is to fail with it).
    """
    resolved = []
    for ref in refs:
        try:
            key = KeyTemplate.parse(ref.key).resolve(payload)
        except InvalidArgument as exc:  # a template stored before a rule changed
            raise LimitKeyError(f"limit {ref.limit!r}: key template {exc.message}") from None
        except LimitKeyError as exc:
            raise LimitKeyError(f"limit {ref.limit!r}: key {exc}") from None
        resolved.append((ref.limit, key, ref.units))
    return resolved


def refs_to_json(refs: Sequence[LimitRef]) -> list[dict[str, Any]]:
    """Refs as stored in `jobs.limits`."""
    return [{"limit": ref.limit, "key": ref.key, "units": ref.units} for ref in refs]


def refs_from_json(value: Any) -> tuple[LimitRef, ...]:
    """Refs as read from `jobs.limits` (written by `refs_to_json`)."""
    return tuple(LimitRef(item["limit"], item["key"], int(item.get("units", 1))) for item in value or ())


def overrides_to_json(overrides: Mapping[str, Override]) -> dict[str, dict[str, int]]:
    """Overrides as stored in `limits.overrides`."""
    return {key: {"limit": value.limit, "burst": value.burst} for key, value in overrides.items()}


def overrides_from_json(value: Any) -> dict[str, Override]:
    """Overrides as read from `limits.overrides`."""
    return {key: Override(int(item["limit"]), int(item.get("burst", 0))) for key, item in (value or {}).items()}
