"""Bounds on what jobs produce, measured in the unit it is stored in. Pure: no I/O.

A handler's result, a flow run's resolved payload and a job's payload are stored as PostgreSQL
`jsonb` under `CHECK (octet_length(value::text) <= 65536)`; an error is stored as `text` under
`CHECK (char_length(error) <= 8192)`. A value over such a bound, or one PostgreSQL or orjson cannot
take (a NUL character, a lone surrogate, an integer outside 64 bits, a type JSON does not have),
must fail the item that carried it where it is produced, never the role that tries to store it.

`measure` computes a JSON value's size exactly as PostgreSQL stores it, `octet_length(v::jsonb::text)`
(jsonb's text form separates with ": " and ", ", writes numbers as its `numeric` prints them and
strings as UTF-8 with its escapes), and its nesting depth, by an iterative walk: no value is too
deep for it to look at.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Final

import orjson

from scheduler_grpc.jobs import MAX_PAYLOAD_DEPTH

MAX_STORED_BYTES: Final = 64 * 1024
"""A payload or result as stored: `octet_length(value::jsonb::text)` (the columns' CHECK)."""
MAX_DEPTH: Final = MAX_PAYLOAD_DEPTH
"""Objects and arrays nested in a result or resolved payload, at most: what the API accepts in a
payload, so a result can become a downstream's payload (`$from`) and every client can receive it
(protobuf's Struct stops decoding at about 33 levels)."""
MAX_ERROR_CHARS: Final = 8192
"""An error as stored: `char_length(error)` (the column's CHECK); events carry the same text."""
MEASURE_AT_MOST: Final = 16 * MAX_STORED_BYTES
"""The bounding functions stop measuring past this size (a value that large is simply "more than")."""

_INT_MIN: Final = -(2**63)  # orjson encodes integers of 64 bits, signed or not
_INT_MAX: Final = 2**64 - 1
_NUMBER: Final = re.compile(r"(-?)(\d+)(?:\.(\d+))?(?:e([+-]?\d+))?")
_UNSTORABLE_CHARS: Final = re.compile("[\x00\ud800-\udfff]")
_CUT_NOTE: Final = " … [{cut:,} of {total:,} characters cut] … "
_KEPT_TAIL: Final = 256  # the end of an error often says most (a retry budget spent, the last frame)


class Unstorable(ValueError):
    """A value over a bound, or one PostgreSQL or orjson cannot store; the message says which."""


class _Oversized(Unstorable):
    """`measure` stopped: the value is larger than its `max_size`."""


@dataclass(frozen=True)
class Measure:
    """A JSON value as PostgreSQL stores it: its `octet_length(v::jsonb::text)` and its depth
    (objects and arrays nested: 0 for a scalar, 1 for `{}` or `[1]`)."""

    size: int
    depth: int


def _string_size(value: str) -> int:
    if "\x00" in value:  # jsonb refuses \u0000 (unsupported Unicode escape sequence)
        raise Unstorable("a string holds the NUL character (U+0000), which PostgreSQL cannot store")
    try:
        # orjson escapes exactly what jsonb's text form escapes (`"`, `\`, U+0000-U+001F; the
        # same short forms), so the lengths agree; it refuses lone surrogates, as UTF-8 does.
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError:
        raise Unstorable("a string holds a lone surrogate (not valid UTF-8)") from None


def _number_size(literal: str) -> int:
    """The length of `numeric`'s text for a JSON number literal (how jsonb stores and prints it):
    plain notation, as many fraction digits as the literal's scale, no sign on zero."""
    match = _NUMBER.fullmatch(literal)
    assert match is not None, literal  # orjson writes only such literals
    sign, whole, fraction, exponent = match.group(1), match.group(2), match.group(3) or "", match.group(4)
    shift = int(exponent) if exponent else 0
    scale = max(0, len(fraction) - shift)
    digits = whole + fraction
    first = next((index for index, digit in enumerate(digits) if digit != "0"), None)
    if first is None:
        return 1 + (1 + scale if scale else 0)  # zero: "0" or "0.000", never "-0"
    point = len(whole) + shift  # where the decimal point falls in `digits`
    whole_digits = point - first if point > first else 1
    return len(sign) + whole_digits + (1 + scale if scale else 0)


def _scalar_size(value: Any) -> int:
    if value is None:
        return 4
    if value is True:
        return 4
    if value is False:
        return 5
    if isinstance(value, str):
        return _string_size(value)
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise Unstorable("an integer is outside 64 bits (orjson encodes -2**63 to 2**64-1)")
        return len(str(int(value)))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Unstorable(f"{value} is not a JSON number")
        return _number_size(orjson.dumps(value).decode())
    raise Unstorable(f"a {type(value).__name__} is not a JSON value")


def measure(value: Any, *, max_depth: int | None = None, max_size: int | None = None) -> Measure:
    """The size and depth of `value` as PostgreSQL stores it (see the module docstring).

    A value is JSON: None, bool, int, float, str, list or tuple, dict with string keys. Iterative:
    any depth is measured without recursion.

    Args:
        max_depth: Stop at the first container nested deeper (then `Unstorable`); None: no limit
            (`value` must then be a tree: a container holding itself would be walked for ever).
        max_size: Stop once the size exceeds it (then `Unstorable`); None: no limit.

    Raises:
        Unstorable: what PostgreSQL or orjson refuses (NUL, lone surrogates, integers outside
            64 bits, NaN and infinities, other types, keys that are not strings), or a limit passed.
    """
    size = 0
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):  # what orjson encodes (and subclasses): not any Mapping
            items: Any = item.items()
            keyed = True
        elif isinstance(item, list | tuple):
            items = item
            keyed = False
        else:
            size += _scalar_size(item)
            if max_size is not None and size > max_size:
                raise _Oversized(f"more than {max_size:,} bytes as stored")
            continue
        level += 1
        if max_depth is not None and level > max_depth:
            raise Unstorable(f"nested deeper than {max_depth} objects or arrays")
        deepest = max(deepest, level)
        count = len(item)
        size += 2 + 2 * max(count - 1, 0)  # brackets and ", " between entries
        if keyed:
            for key, child in items:
                if not isinstance(key, str):
                    raise Unstorable(f"an object key is a {type(key).__name__}, not a string")
                size += _string_size(key) + 2  # the key and ": "
                stack.append((child, level))
        else:
            stack.extend((child, level) for child in items)
        if max_size is not None and size > max_size:
            raise _Oversized(f"more than {max_size:,} bytes as stored")
    return Measure(size, deepest)


def locate_unstorable(value: Any) -> str:
    """Where in `value` the first element PostgreSQL or orjson refuses is, as a field path suffix
    (`.argv[1]`, `["odd key"]`, or "" for `value` itself): for naming the field in an error.

    Walks with paths, so it is slower than `measure`: call it only once `measure` has refused `value`.
    """
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                if not isinstance(key, str):
                    return path
                try:
                    _string_size(key)
                except Unstorable:
                    return path
                name = f".{key}" if key.isidentifier() else f"[{orjson.dumps(key).decode()}]"
                stack.append((child, path + name))
        elif isinstance(item, list | tuple):
            stack.extend((child, f"{path}[{index}]") for index, child in reversed(list(enumerate(item))))
        else:
            try:
                _scalar_size(item)
            except Unstorable:
                return path
    return ""


def depth(value: Any, *, stop_above: int | None = None) -> int:
    """How many objects and arrays are nested in `value` (0 for a scalar), by an iterative walk;
    once past `stop_above`, that depth plus one (a cheap "too deep")."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        level += 1
        deepest = max(deepest, level)
        if stop_above is not None and deepest > stop_above:
            return deepest
        stack.extend((child, level) for child in children)
    return deepest


def stored_size(value: Any) -> int:
    """`octet_length(value::jsonb::text)` as PostgreSQL computes it.

    Raises:
        Unstorable: `value` is not a JSON value PostgreSQL can store (see `measure`).
    """
    return measure(value).size


@dataclass(frozen=True)
class _Wording:
    size: str  # "{size}" and "{limit}" filled in
    other: str  # followed by the reason


_RESULT: Final = _Wording("result is {size} bytes as stored; at most {limit}", "result is not storable: ")
_RESOLVED: Final = _Wording(
    "payload resolved to {size} bytes; at most {limit}", "payload resolved to a value that is not storable: "
)


def _bound(value: Any, wording: _Wording) -> None:
    limit = f"{MAX_STORED_BYTES:,}"
    try:
        found = measure(value, max_depth=MAX_DEPTH, max_size=MEASURE_AT_MOST)
    except Unstorable as exc:
        if isinstance(exc, _Oversized):
            raise Unstorable(wording.size.format(size=f"more than {MEASURE_AT_MOST:,}", limit=limit)) from None
        raise Unstorable(f"{wording.other}{exc}") from None
    if found.size > MAX_STORED_BYTES:
        raise Unstorable(wording.size.format(size=f"{found.size:,}", limit=limit))


def bound_result(value: Any) -> Any:
    """`value` (a handler's result) if PostgreSQL can store it; else `Unstorable` saying why, e.g.
    "result is 70,123 bytes as stored; at most 65,536" or "result is not storable: nested deeper
    than 20 objects or arrays" (that attempt fails with it)."""
    if value is not None:
        _bound(value, _RESULT)
    return value


def bound_resolved_payload(value: Any) -> None:
    """Require a flow run's resolved payload (`$from`) that PostgreSQL can store.

    Raises:
        Unstorable: saying why, e.g. "payload resolved to 80,012 bytes; at most 65,536".
    """
    _bound(value, _RESOLVED)


def bound_error(text: str) -> str:
    """Error text as its column stores it: at most MAX_ERROR_CHARS characters (the middle cut out,
    saying so, so both its start and its end survive), and the characters PostgreSQL's text refuses
    (NUL, lone surrogates) replaced by U+FFFD."""
    text = _UNSTORABLE_CHARS.sub("\ufffd", text)
    if len(text) <= MAX_ERROR_CHARS:
        return text
    # The note's length depends on the count it names: size it for the largest count first.
    kept = MAX_ERROR_CHARS - len(_CUT_NOTE.format(cut=len(text), total=len(text)))
    note = _CUT_NOTE.format(cut=len(text) - kept, total=len(text))
    return text[: kept - _KEPT_TAIL] + note + text[len(text) - _KEPT_TAIL :]
