"""Events are typed and forward compatible: an entry a reader does not understand is skipped and
counted, never retried forever (issue 19, defect 6).

One undecodable entry in the stream used to freeze every watcher: the reader raised before it moved
past the entry and read the same one again every 2 s. These tests write such entries into the real
stream (garbage, entries of a newer writer) between ordinary events, with watchers open over a
real server and the console's live page.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Redis

from scheduler_grpc import events, metrics
from scheduler_grpc.events import CATCH_UP_PAGE, EventType, ExecutionEvent, UndecodableEvent
from scheduler_grpc.keys import EventKeys
from tests.test_api_executions import burst, take, watch
from tests.test_api_support import Harness, api  # noqa: F401 - `api` is a fixture
from tests.test_console import Console, console, login  # noqa: F401 - `console` is a fixture

STREAM = EventKeys().stream


def newer(kind: str, attempt: int, job_id: str = "") -> bytes:
    """An event as a newer writer might encode it: a type this reader may not know, and two more
    positions after the nine it does."""
    job_id = job_id or str(uuid.UUID(int=1))
    fixed = [kind, str(uuid.uuid4()), str(uuid.uuid4()), job_id, attempt, "test.echo", "w1", "",
             datetime.now(UTC).isoformat()]  # fmt: skip
    return orjson.dumps([*fixed, {"new": "position"}, 7])


async def write_garbage(redis: Redis) -> None:
    """Entries no version of the writer produces, and entries of a newer one of an unknown type."""
    await redis.xadd(STREAM, {"x": "y"})  # the reproduction: `XADD {events}:executions * x y`
    await redis.xadd(STREAM, {"e": "not json"})
    await redis.xadd(STREAM, {"e": "[1, 2]"})  # too few positions
    await redis.xadd(STREAM, {"e": '{"type": "created"}'})  # not an array
    await redis.xadd(STREAM, {"e": orjson.dumps([1, "a", "b", "c", "one", "h", "w", "", "now"])})  # mistyped
    await redis.xadd(STREAM, {"e": orjson.dumps(["created", "a", "b", "c", 1, "h", "w", "", "not a time"])})
    await redis.xadd(STREAM, {"e": newer("paused", 99)})  # a type of a newer writer
    await redis.xadd(STREAM, {"e": b"\xff\xfe"})  # not UTF-8


def skipped() -> float:
    return sum(
        metrics.REGISTRY.get_sample_value("scheduler_events_skipped_total", {"reason": reason}) or 0.0
        for reason in ("unknown_type", "malformed")
    )


@pytest.mark.parametrize("batch", [0, 100])  # one event per response, or batches
async def test_watchers_keep_receiving_events_after_entries_they_do_not_understand(
    api: Harness,  # noqa: F811
    redis: Redis,
    batch: int,
) -> None:
    live, _ = await watch(api, api.viewer, max_events_per_response=batch)
    await events.publish(redis, burst(1, 2))
    before = (await events.read_after(redis))[-1].cursor  # after event 2
    assert [e.attempt for e in await take(live, 2)] == [1, 2]
    counted = skipped()
    await write_garbage(redis)
    await events.publish(redis, burst(3, 2))
    # The live reader moved past every bad entry: the next events arrive, in order.
    assert [e.attempt for e in await take(live, 2)] == [3, 4]
    assert skipped() - counted == 8
    # A watcher resuming from before the bad entries (the catch-up's path) gets the same events.
    resumed, _ = await watch(api, api.viewer, cursor=before, max_events_per_response=batch)
    assert [e.attempt for e in await take(resumed, 2)] == [3, 4]
    # And both go on with later events: nothing is stuck on the bad entries.
    await events.publish(redis, burst(5, 1))
    assert [e.attempt for e in await take(live, 1)] == [5]
    assert [e.attempt for e in await take(resumed, 1)] == [5]
    live.cancel()
    resumed.cancel()


async def test_a_catch_up_past_a_page_of_bad_entries_reaches_the_events_after_them(
    api: Harness,  # noqa: F811
    redis: Redis,
) -> None:
    await events.publish(redis, burst(1, 1))
    cursor = (await events.read_after(redis))[-1].cursor
    pipe = redis.pipeline(transaction=False)
    for _ in range(CATCH_UP_PAGE + 10):  # more than a page of the catch-up: it must page on
        pipe.xadd(STREAM, {"x": "y"})
    await pipe.execute()
    await events.publish(redis, burst(2, 2))
    resumed, _ = await watch(api, api.viewer, cursor=cursor)
    assert [e.attempt for e in await take(resumed, 2)] == [2, 3]
    resumed.cancel()


async def test_an_old_reader_ignores_what_a_newer_writer_adds(api: Harness, redis: Redis) -> None:  # noqa: F811
    live, _ = await watch(api, api.viewer)
    # A known type with positions and stream fields this reader does not know: delivered.
    await redis.xadd(STREAM, {"e": newer("succeeded", 1), "trace": "abc", "v": "2"})
    # A type this reader does not know: skipped, without blocking the next one.
    await redis.xadd(STREAM, {"e": newer("paused", 2), "v": "2"})
    await redis.xadd(STREAM, {"e": newer("failed", 3)})
    received = await take(live, 2)
    assert [(e.attempt, e.type) for e in received] == [(1, 3), (3, 4)]  # EVENT_TYPE_SUCCEEDED, _FAILED
    stored = await events.read_after(redis)
    assert [(e.attempt, e.type) for e in stored] == [(1, EventType.SUCCEEDED), (3, EventType.FAILED)]
    live.cancel()


async def test_the_consoles_live_page_keeps_receiving_events_after_bad_entries(
    console: Console,  # noqa: F811
    redis: Redis,
) -> None:
    async with console.client() as http:
        await login(http)
        async with http.get("/events", timeout=aiohttp.ClientTimeout(total=20)) as stream:
            assert (await next_data(stream))["event"] == "hello"
            await write_garbage(redis)
            await events.publish(redis, burst(1, 1))
            data = orjson.loads((await next_data(stream))["data"])
            assert (data["type"], data["attempt"]) == ("succeeded", 1)


async def next_data(response: aiohttp.ClientResponse) -> dict[str, str]:
    """The next server-sent event (comment lines, such as keep-alives, are not events)."""
    current: dict[str, str] = {}
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if not line:
            if current:
                return current
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(": ")
        current[key] = value
    raise AssertionError("the stream ended")


def test_an_event_survives_its_own_encoding() -> None:
    event = ExecutionEvent(EventType.RETRYING, "e", "r", "j", 2, handler="h", worker_id="w", error="boom",
                           time=datetime.now(UTC), cursor="1-1")  # fmt: skip
    assert ExecutionEvent.from_fields("1-1", {b"e": event.encode()}) == event


_scalar = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
_json = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=12) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=30,
)
# Arrays shaped like an event, each position right or wrong: most draws get deep into the decoder.
_position = st.sampled_from([*EventType, "paused", "2026-01-01T00:00:00+00:00", "x"]) | st.integers() | _scalar
_event_like = st.lists(_position, min_size=8, max_size=11)


@given(st.one_of(_json.map(json.dumps), _event_like.map(json.dumps), st.binary(max_size=64)), st.booleans())
def test_any_entry_decodes_or_is_refused_as_undecodable(encoded: str | bytes, as_text: bool) -> None:
    raw = encoded.encode() if isinstance(encoded, str) else encoded
    fields: dict[Any, Any] = {"e": raw.decode(errors="replace")} if as_text else {b"e": raw}
    reason = ""
    try:
        event = ExecutionEvent.from_fields("1-1", fields)
    except UndecodableEvent as error:
        reason = error.reason
    else:
        assert isinstance(event.type, EventType)
        assert isinstance(event.attempt, int)
    assert reason in ("", "unknown_type", "malformed")


@pytest.mark.parametrize("fields", [{}, {b"x": b"y"}, {b"e": None}, {"e": 5}])
def test_an_entry_without_an_event_is_malformed(fields: dict[Any, Any]) -> None:
    with pytest.raises(UndecodableEvent) as caught:
        ExecutionEvent.from_fields("1-1", fields)
    assert caught.value.reason == "malformed"
