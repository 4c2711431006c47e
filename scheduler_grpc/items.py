"""The data of a run's queue item: its breaker key and its slot.

A worker leaves work of an open breaker in the queue without claiming it, so the item carries the
run's breaker key (`handlers.breaker_key`). It also carries the run's slot (`scheduled_for`, the
partition key of `job_executions`): with it the worker's claim, completion and hand-backs read one
partition by (id, slot) instead of every partition's index by id. Redis keeps the data opaque, with
the item, through leases, retries, recoveries and the dead-letter queue.

Layout: `<breaker key>\\x1f<slot: integer microseconds since the Unix epoch, UTC>`. An item made
before slots travelled with it holds the breaker key alone: its slot is unknown (None) and the
statements find its rows by id alone (correct, slower).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

_SEPARATOR = "\x1f"  # ASCII unit separator: in no handler name nor host
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def item_data(breaker_key: str, slot: datetime | None) -> str:
    """The data of a run's item: its breaker key and, when known, its slot."""
    if slot is None:
        return breaker_key
    delta = slot - _EPOCH
    micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return f"{breaker_key}{_SEPARATOR}{micros}"


def item_breaker_key(data: bytes | str) -> str:
    """The breaker key an item's data names."""
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    return text.partition(_SEPARATOR)[0]


def item_slot(data: bytes | str) -> datetime | None:
    """The slot an item's data carries; None for an item made without one (or malformed)."""
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    _, separator, micros = text.partition(_SEPARATOR)
    if not separator:
        return None
    try:
        return _EPOCH + timedelta(microseconds=int(micros))
    except (ValueError, OverflowError):
        return None
