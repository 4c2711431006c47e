"""Execution events: every lifecycle transition is appended to one capped Redis Stream.

Writers add an event right after the change it describes (a separate Redis call, not the same
script), except CREATED, which is added just before the run is enqueued
(`dispatch.dispatch_new_runs`), so a run's CREATED precedes its STARTED. An event is lost if its
writer dies in between (the change itself stays recorded in PostgreSQL); a publish the client
resends after a lost reply does not append twice (see `resend`). gRPC servers read the stream (one
reader per process) and fan it out to subscribers, who resume from the last stream id they saw.
The stream is capped (approximately, `MAXLEN ~`) so it cannot grow without bound.

Entries are typed and forward compatible. An event is one stream field `e`: a JSON array whose
first nine positions are fixed (`encode_fields`). A newer writer may append positions, add stream
fields or add event types; a reader ignores positions and fields it does not know, and skips (counts
in `scheduler_events_skipped_total`, logs once) an entry it cannot decode at all: an unknown type,
missing or mistyped positions, or anything else written into the stream. A reader always moves past
an entry, understood or not: one bad entry never stops the events after it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import enum
import logging
import re
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import orjson
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from scheduler_grpc import metrics, resend, scripts
from scheduler_grpc.errors import FailedPrecondition, InvalidArgument, SchedulerError, Unavailable
from scheduler_grpc.keys import EventKeys
from scheduler_grpc.script_calls import ScriptCall
from scheduler_grpc.scripts import text as _text

STREAM_MAX_LENGTH = 100_000
CATCH_UP_PAGE = 500
_KEYS = EventKeys()
_STREAM_ID = re.compile(r"(\d{1,20})-(\d{1,20})")
_MIN_BACKOFF = 0.05
_MAX_BACKOFF = 2.0
_FIXED_POSITIONS = 9  # positions of `encode_fields`; a newer writer may append more
_log = logging.getLogger(__name__)


class EventType(enum.StrEnum):
    CREATED = "created"
    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    RETRYING = "retrying"
    DEAD = "dead"
    CANCELLED = "cancelled"
    ABANDONED = "abandoned"
    INTERRUPTED = "interrupted"
    SKIPPED = "skipped"
    MISSED = "missed"
    UPSTREAM_FAILED = "upstream_failed"  # a flow run recorded a job not run: its upstreams failed


class UndecodableEvent(ValueError):
    """A stream entry this reader does not understand (skipped, never retried).

    Attributes:
        cursor: The entry's stream id.
        reason: `unknown_type` (an event type of a newer writer) or `malformed` (anything else).
    """

    def __init__(self, cursor: str, reason: str, problem: str) -> None:
        super().__init__(f"stream entry {cursor} is not an event this reader understands: {problem}")
        self.cursor = cursor
        self.reason = reason


def _malformed(cursor: str, problem: str) -> UndecodableEvent:
    return UndecodableEvent(cursor, "malformed", problem)


@dataclass(frozen=True)
class ExecutionEvent:
    """One transition of one execution."""

    type: EventType
    execution_id: str
    run_id: str
    job_id: str
    attempt: int
    handler: str = ""
    worker_id: str = ""
    error: str = ""
    time: datetime | None = None
    cursor: str = ""  # the stream id, set when read back

    def encode(self) -> bytes:
        """The event as one stream field: compact JSON, in a fixed field order."""
        return encode_fields(
            self.type, self.execution_id, self.run_id, self.job_id, self.attempt, handler=self.handler,
            worker_id=self.worker_id, error=self.error, time=(self.time or datetime.now(UTC)).isoformat(),
        )  # fmt: skip

    @classmethod
    def from_fields(cls, cursor: str, fields: Mapping[Any, Any]) -> ExecutionEvent:
        """Decode a stream entry written by `publish` (or by a newer writer: positions after the
        ninth and stream fields other than `e` are ignored).

        Raises:
            UndecodableEvent: no `e` field, not a JSON array of at least nine positions, a position
                of the wrong type, a time that is not ISO 8601, or an unknown type.
        """
        encoded = fields.get(b"e") or fields.get("e")
        if not isinstance(encoded, bytes | str):
            raise _malformed(cursor, "no field `e`")
        try:
            values = orjson.loads(encoded)
        except orjson.JSONDecodeError:
            raise _malformed(cursor, "`e` is not JSON") from None
        if not isinstance(values, list) or len(values) < _FIXED_POSITIONS:
            raise _malformed(cursor, f"`e` is not an array of at least {_FIXED_POSITIONS} positions")
        kind, execution_id, run_id, job_id, attempt, handler, worker_id, error, time = values[:_FIXED_POSITIONS]
        texts = (kind, execution_id, run_id, job_id, handler, worker_id, error, time)
        if not all(isinstance(text, str) for text in texts) or type(attempt) is not int:
            raise _malformed(cursor, "a position of the wrong type")
        try:
            event_type = EventType(kind)
        except ValueError:
            raise UndecodableEvent(cursor, "unknown_type", f"unknown event type {kind[:40]!r}") from None
        try:
            at = datetime.fromisoformat(time)
        except ValueError:
            raise _malformed(cursor, "the time is not ISO 8601") from None
        return cls(
            type=event_type,
            execution_id=execution_id,
            run_id=run_id,
            job_id=job_id,
            attempt=attempt,
            handler=handler,
            worker_id=worker_id,
            error=error,
            time=at,
            cursor=cursor,
        )


def encode_fields(
    kind: EventType,
    execution_id: str,
    run_id: str,
    job_id: str,
    attempt: int,
    *,
    handler: str,
    worker_id: str,
    error: str,
    time: str,
) -> bytes:
    """`ExecutionEvent(...).encode()` without building the event: for writers on a hot path (the
    worker), which also format `time` (ISO 8601) once per batch."""
    # `kind` as it is: orjson writes a str enum as its value (without the `.value` lookup).
    return orjson.dumps((kind, execution_id, run_id, job_id, attempt, handler, worker_id, error[:500], time))


# Under the resend guard: a publish resent by the client's auto-retry must not append twice.
_ADD_SOURCE = resend.guarded(scripts.source("events_add"))
PUBLISH_TIMEOUT_S: Final = 5.0  # bound on one publish (the client has no socket timeout)
_add_script: AsyncScript | None = None


async def publish(redis: Redis, events: Iterable[ExecutionEvent]) -> list[str]:
    """Append events in one script call (bounded: the client has no socket timeout); returns their ids."""
    return await publish_encoded(redis, [event.encode() for event in events])


async def publish_encoded(redis: Redis, encoded: Sequence[bytes], *, ids: bool = True) -> list[str]:
    """`publish` of events already encoded (`ExecutionEvent.encode`, `encode_fields`); with
    `ids=False` the stream ids are not decoded and `[]` is returned (a writer that does not use them)."""
    if not encoded:
        return []
    call = add_call(redis, encoded)
    async with asyncio.timeout(PUBLISH_TIMEOUT_S):
        reply = await call.script(keys=call.keys, args=call.args, client=redis)
    return [_text(entry_id) for entry_id in reply] if ids else []


def add_call(redis: Redis, encoded: Sequence[bytes]) -> ScriptCall:
    """The script call of `publish_encoded` (safe to resend), for a writer that sends it along with
    other calls in one round trip (`script_calls.run_together`); it replies with the stream ids."""
    global _add_script
    if _add_script is None:
        _add_script = redis.register_script(_ADD_SOURCE)  # EVALSHA, loaded on NOSCRIPT; any client
    keys = [_KEYS.stream, _KEYS.request(resend.request_id())]
    return ScriptCall(_add_script, keys, [STREAM_MAX_LENGTH, *encoded, resend.remember_ms()])


async def read_after(redis: Redis, cursor: str = "0-0", count: int = 1000) -> list[ExecutionEvent]:
    """Events after `cursor` (a stream id), oldest first (tests, resumption): of the next `count`
    entries, those this reader understands."""
    reply = await redis.xrange(_KEYS.stream, min=f"({cursor}" if cursor != "0-0" else "-", count=count)
    return _decode_entries(reply).events


class _Skips:
    """Counts the entries readers skipped; logs the first one of each reason (later ones are only
    counted: a flood of them must not flood the log)."""

    def __init__(self) -> None:
        self.logged: set[str] = set()

    def skipped(self, error: UndecodableEvent) -> None:
        metrics.EVENTS_SKIPPED.labels(error.reason).inc()
        if error.reason not in self.logged:
            self.logged.add(error.reason)
            _log.warning("%s; skipped (further such entries are only counted)", error, extra={"cursor": error.cursor})


_SKIPS = _Skips()


@dataclass(frozen=True)
class _Page:
    """Decoded stream entries: the events understood, how many entries were read, the last one's id."""

    events: list[ExecutionEvent]
    entries: int
    last: str


def _decode_entries(reply: Any) -> _Page:
    """Decode `[(id, {field: value}), ...]`, skipping (and counting) entries not understood."""
    decoded: list[ExecutionEvent] = []
    entries = 0
    last = ""
    for entry_id, fields in reply or []:
        entries += 1
        last = _text(entry_id)
        try:
            decoded.append(ExecutionEvent.from_fields(last, fields or {}))
        except UndecodableEvent as error:
            _SKIPS.skipped(error)
    return _Page(decoded, entries, last)


async def trim_before(redis: Redis, older_than: datetime) -> int:
    """Drop events older than `older_than` (system.cleanup); stream ids start with ms since the epoch."""
    minimum = f"{int(older_than.timestamp() * 1000)}-0"
    trimmed: int = await redis.xtrim(_KEYS.stream, minid=minimum, approximate=False)
    return trimmed


class RedisEventBus:
    """The event stream of one Redis client as an object (`ports.EventBus`): `publish`,
    `publish_encoded`, `read_after` and `trim_before` over `redis`."""

    __slots__ = ("redis",)

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def publish(self, events: Iterable[ExecutionEvent]) -> list[str]:
        return await publish(self.redis, events)

    async def publish_encoded(self, encoded: Sequence[bytes], *, ids: bool = True) -> list[str]:
        return await publish_encoded(self.redis, encoded, ids=ids)

    async def read_after(self, cursor: str = "0-0", count: int = 1000) -> list[ExecutionEvent]:
        return await read_after(self.redis, cursor, count)

    async def trim_before(self, older_than: datetime) -> int:
        return await trim_before(self.redis, older_than)


# -- fan-out to subscribers (the gRPC server's WatchExecutions) -----------------------------------


class SubscriberTooSlow(SchedulerError):
    """A subscriber fell further behind than its buffer; it can resume from `cursor`."""

    def __init__(self, cursor: str) -> None:
        super().__init__(f"too slow; resume from cursor {cursor}")
        self.cursor = cursor


class CursorExpired(FailedPrecondition):
    """The events after a cursor were trimmed from the stream: resuming would silently skip some."""

    def __init__(self, cursor: str, first: str) -> None:
        super().__init__(
            f"cursor: events after {cursor} are no longer kept (the stream now starts at {first}); "
            "read the history with ListExecutions, then watch without a cursor"
        )
        self.cursor = cursor


class FanoutClosed(SchedulerError):
    """The fan-out stopped (the server is shutting down); resume from `cursor` elsewhere or later."""

    def __init__(self, cursor: str) -> None:
        super().__init__(f"the server is shutting down; resume from cursor {cursor}")
        self.cursor = cursor


def stream_id(cursor: str) -> tuple[int, int]:
    """A stream id as a comparable pair (`1700000000000-3` -> (1700000000000, 3)).

    Raises:
        InvalidArgument: not a stream id (field `cursor`).
    """
    match = _STREAM_ID.fullmatch(cursor)
    if match is None:
        raise InvalidArgument("cursor", f"{cursor[:40]!r} is not a cursor from an event")
    return int(match.group(1)), int(match.group(2))


def _format_id(value: tuple[int, int]) -> str:
    return f"{value[0]}-{value[1]}"


@dataclass(frozen=True)
class EventFilter:
    """Which events a subscriber wants; an empty criterion matches everything."""

    job_ids: frozenset[str] = frozenset()
    types: frozenset[EventType] = frozenset()
    handler: str = ""

    def matches(self, event: ExecutionEvent) -> bool:
        return (
            (not self.job_ids or event.job_id in self.job_ids)
            and (not self.types or event.type in self.types)
            and (not self.handler or event.handler == self.handler)
        )


@dataclass(frozen=True, slots=True)
class _Chunk:
    """Events of one read that one filter admits, with their stream ids (in stream order)."""

    ids: list[tuple[int, int]]
    events: list[ExecutionEvent]


class Subscription:
    """One subscriber's view of the stream: a catch-up from its cursor, then the live feed.

    Iterate it (`async for event in subscription`), or take what is ready in batches
    (`subscription.batches(limit)`). Live events wait in a bounded buffer that the fan-out fills
    (never waiting for the subscriber); when it is full the subscription ends with
    `SubscriberTooSlow`. Events are never delivered twice: everything at or before the last id seen
    (delivered or filtered out) is skipped.
    """

    def __init__(self, fanout: EventFanout, event_filter: EventFilter, cursor: str | None, buffer: int) -> None:
        self._fanout = fanout
        self.filter = event_filter
        self._cursor = cursor
        self._buffer: deque[_Chunk] = deque()
        self._buffered = 0  # events in `_buffer`
        self._limit = buffer
        self._wake = asyncio.Event()
        self._overflowed = False
        self._closed = False
        self._last: tuple[int, int] = (0, 0)
        self._awaiting_start = False

    @property
    def cursor(self) -> str:
        """Where a resumed subscription would continue: the last stream id this one has seen."""
        return _format_id(self._last)

    @property
    def overflowed(self) -> bool:
        """Whether the fan-out dropped this subscription for falling behind (it ends with
        `SubscriberTooSlow` once what it was handed is delivered)."""
        return self._overflowed

    def _offer(self, chunk: _Chunk) -> bool:
        """Buffer live events this subscription's filter admits (called by the reader, which never
        waits here; `chunk` is shared with every subscriber of the same filter, never modified);
        False when the subscriber overflowed."""
        if chunk.ids[0] <= self._last:  # a catch-up gave some already
            if chunk.ids[-1] <= self._last:
                return True
            start = bisect.bisect_right(chunk.ids, self._last)
            chunk = _Chunk(chunk.ids[start:], chunk.events[start:])
        if self._buffered + len(chunk.ids) > self._limit:
            self._overflowed = True
            self._buffer.clear()  # it ends now: free what it would never read
            self._buffered = 0
            self._wake.set()
            return False
        self._buffer.append(chunk)
        self._buffered += len(chunk.ids)
        self._wake.set()
        return True

    def _close(self) -> None:
        self._closed = True
        self._wake.set()

    def __aiter__(self) -> AsyncIterator[ExecutionEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[ExecutionEvent]:
        # `cursor` moves a batch at a time, but the iteration ends (with it in the error) only
        # after the batch's last event.
        async for batch in self.batches(self._limit):
            for event in batch:
                yield event

    async def batches(self, limit: int) -> AsyncIterator[list[ExecutionEvent]]:
        """The events in order, as lists of at most `limit` (>= 1): each list holds what was ready
        when it was taken (never empty; it may be shared with other subscribers: do not modify it).
        `cursor` is the last event of the last list taken."""
        if self._cursor is not None:
            async for caught_up in self._catch_up(self._cursor, limit):
                yield caught_up
        while True:
            batch: list[ExecutionEvent] = []
            while self._buffer and len(batch) < limit:
                chunk = self._buffer.popleft()
                ids = chunk.ids
                # Events the catch-up already gave are skipped.
                start = bisect.bisect_right(ids, self._last) if ids[0] <= self._last else 0
                end = min(len(ids), start + limit - len(batch))
                if end < len(ids):  # the rest waits for the next batch
                    self._buffer.appendleft(_Chunk(ids[end:], chunk.events[end:]))
                self._buffered -= end
                if start == end:
                    continue
                self._last = ids[end - 1]
                if not batch and start == 0 and end == len(ids):
                    batch = chunk.events  # shared, as it is (the common case: one read's events)
                else:
                    batch = [*batch, *chunk.events[start:end]]
            if batch:
                yield batch
                continue
            if self._overflowed:
                raise SubscriberTooSlow(self.cursor)
            if self._closed:
                raise FanoutClosed(self.cursor)
            self._wake.clear()
            await self._wake.wait()

    async def _catch_up(self, cursor: str, limit: int) -> AsyncIterator[list[ExecutionEvent]]:
        # Registered with the fan-out before this runs, so every event after the reader's position
        # reaches the buffer; this reads everything after `cursor` up to the stream's end now, which
        # is at or past that position: together, no gap. Pages keep each read bounded.
        await self._fanout._check_retained(cursor)
        after = cursor
        while True:
            page = await self._fanout._read_after(after)
            batch: list[ExecutionEvent] = []
            for event in page.events:
                event_id = stream_id(event.cursor)
                if event_id > self._last and self.filter.matches(event):
                    batch.append(event)
                    if len(batch) == limit:
                        self._last = event_id
                        yield batch
                        batch = []
            if batch:
                self._last = stream_id(batch[-1].cursor)
                yield batch
            if page.events:  # the events filtered out were seen too
                self._last = max(self._last, stream_id(page.events[-1].cursor))
            if page.entries < CATCH_UP_PAGE:
                return
            after = page.last  # past the page's last entry, understood or skipped


class EventFanout:
    """One reader of the event stream per process, fanned out to any number of subscribers.

    The reader blocks on `XREAD` only while someone subscribes. Each subscriber has a bounded buffer:
    one that falls behind is ended (`SubscriberTooSlow`) instead of slowing the reader or the others.

    Args:
        redis: The client (a blocking read holds one of its pooled connections).
        buffer: Events buffered per subscriber.
        block: Longest single XREAD wait (the reader notices it has no subscribers left within this).
        timeout: Bound on every other Redis call, and on the wait for the reader's first position.
        batch: Most events per read.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        buffer: int = 1000,
        block: timedelta = timedelta(seconds=1),
        timeout: timedelta = timedelta(seconds=5),
        batch: int = 500,
    ) -> None:
        self._redis = redis
        self._buffer = buffer
        self._block_ms = int(block.total_seconds() * 1000)
        self._timeout = timeout.total_seconds()
        # One read is dispatched to every buffer at once: a batch larger than a buffer would end
        # even subscribers that keep up.
        self._batch = max(1, min(batch, buffer))
        self._subscribers: set[Subscription] = set()
        self._wanted = asyncio.Event()
        self._positioned = asyncio.Event()
        self._position: tuple[int, int] = (0, 0)
        self._closed = False
        self.dropped = 0  # subscribers ended for being too slow (metrics, tests)

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    @property
    def position(self) -> str:
        """The id of the last event the reader has fanned out."""
        return _format_id(self._position)

    @contextlib.asynccontextmanager
    async def subscribe(self, event_filter: EventFilter, cursor: str | None = None) -> AsyncIterator[Subscription]:
        """Subscribe for the duration of the `async with` block.

        Args:
            event_filter: Which events to deliver.
            cursor: Deliver every event after this stream id first (within the stream's retention);
                None: from the reader's current position on (`Subscription.cursor` tells which).

        Raises:
            InvalidArgument: a malformed cursor.
            FanoutClosed: the fan-out has stopped.
            Unavailable: the reader could not establish its position in time (Redis unreachable).
        """
        start = stream_id(cursor) if cursor is not None else None
        if self._closed:
            raise FanoutClosed(cursor or "0-0")
        subscription = Subscription(self, event_filter, cursor, self._buffer)
        # With a cursor, events at or before it are never delivered (the catch-up covers the rest).
        # Without one the subscription starts where the reader is now, or, if the reader has no
        # position yet, where it takes one (it sets `_last` then, before reading anything).
        if start is not None:
            subscription._last = start
        elif self._positioned.is_set():
            subscription._last = self._position
        else:
            subscription._awaiting_start = True
        self._subscribers.add(subscription)
        self._wanted.set()
        try:
            try:
                async with asyncio.timeout(self._timeout):
                    await self._positioned.wait()
            except TimeoutError:
                raise Unavailable("the execution event stream cannot be read right now; retry") from None
            yield subscription
        finally:
            self._subscribers.discard(subscription)
            if not self._subscribers:
                self._wanted.clear()

    def close(self) -> None:
        """End every subscription (`FanoutClosed`) and refuse new ones (server shutdown)."""
        self._closed = True
        for subscription in list(self._subscribers):
            subscription._close()

    async def _read_after(self, cursor: str) -> _Page:
        async with asyncio.timeout(self._timeout):
            # redis-py types stream replies loosely; the shape is [(id, {field: value}), ...].
            reply: Any = await self._redis.xrange(_KEYS.stream, min=f"({cursor}", count=CATCH_UP_PAGE)
        return _decode_entries(reply)

    async def _check_retained(self, cursor: str) -> None:
        """Raise CursorExpired if events after `cursor` may have been trimmed away, InvalidArgument
        if `cursor` is past the newest event ever added.

        Trimming removes the oldest entries. The events right after `cursor` are all still there if
        nothing was ever trimmed, if the cursor's own entry is still there, or if the cursor is at
        or past the stream's first entry; otherwise some may be gone, and silence would be a lie.
        A cursor past the newest id was never issued (or the stream was lost since): the events
        after it would be skipped until the stream caught up with it, so it is refused too.
        """
        async with asyncio.timeout(self._timeout):
            try:
                info: Any = await self._redis.xinfo_stream(_KEYS.stream)
            except ResponseError:  # no stream yet: nothing was ever trimmed, no event was ever added
                info = {}
            newest = _text(info.get("last-generated-id") or "0-0")
            if stream_id(cursor) > stream_id(newest):
                raise InvalidArgument(
                    "cursor", f"{cursor} is past the newest event ({newest}); watch without a cursor to start now"
                )
            if not info or int(info.get("entries-added", 0)) <= int(info.get("length", 0)):
                return
            first = info.get("first-entry")
            if not first or stream_id(cursor) >= stream_id(_text(first[0])):
                return
            if await self._redis.xrange(_KEYS.stream, min=cursor, max=cursor, count=1):
                return
        raise CursorExpired(cursor, _text(first[0]))

    async def _stream_end(self) -> tuple[int, int]:
        async with asyncio.timeout(self._timeout):
            reply: Any = await self._redis.xrevrange(_KEYS.stream, count=1)
        return stream_id(_text(reply[0][0])) if reply else (0, 0)

    async def run(self) -> None:
        """The reader loop; runs until cancelled. Redis errors are logged and retried with backoff."""
        backoff = _MIN_BACKOFF
        while True:
            await self._wanted.wait()
            try:
                # Positioned at the stream's end *before* any subscriber's catch-up reads it.
                if not self._positioned.is_set():
                    self._position = await self._stream_end()
                    for subscription in self._subscribers:
                        if subscription._awaiting_start:
                            subscription._last = self._position
                            subscription._awaiting_start = False
                    self._positioned.set()
                while self._subscribers:
                    await self._read_once()
                    backoff = _MIN_BACKOFF
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a Redis outage must not end the reader: log, back off, go on
                _log.warning("event stream read failed: %s", exc, extra={"retry_in_s": backoff})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
                continue
            # Nobody listens: the next subscriber repositions at the then end of the stream.
            self._positioned.clear()

    async def _read_once(self) -> None:
        async with asyncio.timeout(self._block_ms / 1000 + self._timeout):
            reply: Any = await self._redis.xread({_KEYS.stream: self.position}, count=self._batch, block=self._block_ms)
        read: list[tuple[tuple[int, int], ExecutionEvent]] = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                cursor = _text(entry_id)
                event_id = stream_id(cursor)
                self._position = event_id  # first: the reader moves past every entry, understood or not
                try:
                    read.append((event_id, ExecutionEvent.from_fields(cursor, fields or {})))
                except UndecodableEvent as error:
                    _SKIPS.skipped(error)
        if not read:
            return
        # Each filter is matched once per read, however many subscribers share it; each subscriber
        # then takes its events in one call (and one wake-up), as one shared chunk.
        matched: dict[EventFilter, _Chunk | None] = {}
        for subscription in list(self._subscribers):
            event_filter = subscription.filter
            if event_filter in matched:
                chunk = matched[event_filter]
            else:
                admitted = [entry for entry in read if event_filter.matches(entry[1])]
                chunk = matched[event_filter] = (
                    _Chunk([entry[0] for entry in admitted], [entry[1] for entry in admitted]) if admitted else None
                )
            if chunk is not None and not subscription._offer(chunk):
                self._subscribers.discard(subscription)
                self.dropped += 1
