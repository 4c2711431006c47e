"""Event watchers for the fault suite: `WatchExecutions` streams and the console's live feed.

A `Watcher` records the stream cursor of every event it receives, as a client would see it: a gRPC
stream through the Python client (which resumes from its last cursor when the stream breaks), or
the console's Server-Sent Events endpoint `/events` (reconnecting with `Last-Event-ID`, as a
browser does). `gaps` then compares what each one received with what the stream holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import aiohttp
from redis.asyncio import Redis
from scheduler_client import SchedulerClient

from scheduler_grpc.auth import DEV_ADMIN_PASSWORD
from scheduler_grpc.console.security import COOKIE
from scheduler_grpc.events import stream_id
from scheduler_grpc.keys import EventKeys

log = logging.getLogger("chaos")

RECONNECTS = 20  # a watcher gives up after this many broken streams without an event between


@dataclass
class Watcher:
    """One subscriber and what reached it.

    Attributes:
        name: For reports ("grpc-all", "console-live", ...).
        cursor: The cursor it was opened with (events after it are due), or None: from now on.
        since: For one opened without a cursor: the stream's end once it was subscribed (set by
            `Watchers.subscribed`; every later event is due to it).
        job_ids: Only these jobs' events (empty: all).
        received: The cursors of the events it received, in order.
        error: Why it stopped, if it did.
    """

    name: str
    cursor: str | None = None
    job_ids: tuple[str, ...] = ()
    since: str | None = None
    received: list[str] = field(default_factory=list)
    error: str = ""
    subscribed: asyncio.Event = field(default_factory=asyncio.Event)

    def due(self, cursor: str) -> bool:
        """Whether the event at `cursor` was due to it (by position; filters aside): after the
        cursor it was opened with, or, opened without one, after `since`."""
        start = self.cursor if self.cursor is not None else self.since
        return start is not None and stream_id(cursor) > stream_id(start)

    def due_of(self, ordinary: Sequence[tuple[str, str]]) -> list[str]:
        """The cursors due to it among `ordinary` events ((cursor, job id), oldest first)."""
        return [cursor for cursor, job in ordinary if self.due(cursor) and (not self.job_ids or job in self.job_ids)]

    def received_after(self, cursor: str) -> int:
        after = stream_id(cursor)
        return sum(stream_id(each) > after for each in self.received)


@dataclass(frozen=True)
class Gaps:
    """How what one watcher received differs from what was due to it."""

    due: int
    missing: list[str]
    twice: list[str]


def gaps(due: Iterable[str], received: Sequence[str]) -> Gaps:
    """Compare the cursors due to a watcher with those it received (extra ones, such as entries the
    reader may pass on from a newer writer, are allowed; each only once)."""
    wanted = list(due)
    seen: set[str] = set()
    twice: list[str] = []
    for cursor in received:
        if cursor in seen:
            twice.append(cursor)
        seen.add(cursor)
    return Gaps(len(wanted), [cursor for cursor in wanted if cursor not in seen], twice)


def judge(watcher: Watcher, ordinary: Sequence[tuple[str, str]], fault: str) -> tuple[str, list[tuple[str, str]]]:
    """A note on what `watcher` received, and the violations: it stopped receiving after `fault`
    (a cursor), it missed ordinary events due to it, it received one twice.

    Args:
        watcher: The watcher, at the end.
        ordinary: (cursor, job id) of every event the service wrote, oldest first.
        fault: The cursor of the first entry the scenario injected.
    """
    found = gaps(watcher.due_of(ordinary), watcher.received)
    after = watcher.received_after(fault)
    note = (f"{watcher.name}: {len(watcher.received)} events, {after} after the fault, "
            f"{len(found.missing)} of {found.due} due missing")  # fmt: skip
    violations: list[tuple[str, str]] = []
    if found.missing and after == 0:
        violations.append(("watcher stopped receiving",
                           f"{watcher.name}: nothing after the fault ({watcher.error or 'no error'})"))  # fmt: skip
    elif found.missing:
        missed = f"{watcher.name}: {len(found.missing)} of {found.due}, first {found.missing[0]}"
        violations.append(("watcher missed events", missed))
    if found.twice:
        violations.append(("watcher received an event twice", f"{watcher.name}: {found.twice[:3]}"))
    return note, violations


async def login(address: str) -> str:
    """A session token of the development admin (the servers run with SCHEDULER_ENV=dev)."""
    async with SchedulerClient.connect(address) as client:
        return (await client.login("admin", DEV_ADMIN_PASSWORD, rpc_timeout=30)).token


class Watchers:
    """The watchers of one scenario against one server, each in a task of its own.

    Use as `async with Watchers(address, console_url, token) as watchers:`; leaving the block stops
    every watcher. A watcher that fails records why (`Watcher.error`) instead of raising.
    """

    def __init__(self, address: str, console_url: str, token: str) -> None:
        self.address = address
        self.console_url = console_url.rstrip("/")
        self.token = token
        self.watchers: list[Watcher] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)

    def grpc(self, name: str, *, cursor: str | None = None, job_ids: Sequence[str] = ()) -> Watcher:
        """Open a WatchExecutions stream."""
        return self._start(Watcher(name, cursor, tuple(job_ids)), self._grpc)

    def console(self, name: str, *, cursor: str | None = None) -> Watcher:
        """Open the console's live feed (`/events`), as the executions page does."""
        return self._start(Watcher(name, cursor), self._sse)

    async def subscribed(self, redis: Redis, within: float) -> None:
        """Wait until every watcher is subscribed (TimeoutError past `within`); then those opened
        without a cursor are due every event after the stream's current end."""
        async with asyncio.timeout(within):
            for watcher in self.watchers:
                await watcher.subscribed.wait()
            # redis-py types stream replies loosely; the shape is [(id, {field: value}), ...].
            last: Any = await redis.xrevrange(EventKeys().stream, count=1)
        end = last[0][0].decode() if last else "0-0"
        for watcher in self.watchers:
            if watcher.cursor is None and watcher.since is None:
                watcher.since = end

    def _start(self, watcher: Watcher, body: Callable[[Watcher], Coroutine[Any, Any, None]]) -> Watcher:
        self.watchers.append(watcher)
        self._tasks.append(asyncio.create_task(self._guarded(watcher, body(watcher)), name=f"watch-{watcher.name}"))
        return watcher

    @staticmethod
    async def _guarded(watcher: Watcher, body: Coroutine[Any, Any, None]) -> None:
        try:
            await body
        except Exception as exc:  # reported by the scenario as a watcher that stopped
            watcher.error = f"{type(exc).__name__}: {exc}"
            log.warning("watcher %s stopped: %s", watcher.name, watcher.error)
        finally:
            watcher.subscribed.set()  # nobody waits for a watcher that has stopped

    async def _grpc(self, watcher: Watcher) -> None:
        async with SchedulerClient.connect(self.address, token=self.token) as client:
            events = client.watch_executions(
                job_ids=watcher.job_ids, cursor=watcher.cursor, subscribed=watcher.subscribed,
                max_reconnects=RECONNECTS, reconnect_delay=0.2,
            )  # fmt: skip
            async with contextlib.aclosing(events):
                async for event in events:
                    watcher.received.append(event.cursor)
        watcher.error = "the server ended the stream"

    async def _sse(self, watcher: Watcher) -> None:
        last = watcher.cursor
        failures = 0
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while failures < RECONNECTS:
                headers = {"Cookie": f"{COOKIE}={self.token}"}
                if last is not None:
                    headers["Last-Event-ID"] = last
                try:
                    async with http.get(f"{self.console_url}/events", headers=headers) as response:
                        if response.status != 200:
                            raise RuntimeError(f"/events answered {response.status}: {(await response.text())[:200]}")
                        watcher.subscribed.set()
                        event_id: str | None = None
                        kind: str | None = None
                        data = False
                        async for raw in response.content:
                            line = raw.decode().rstrip("\r\n")
                            if line.startswith("id: "):
                                event_id = line[4:]
                            elif line.startswith("event: "):
                                kind = line[7:]
                            elif line.startswith("data: "):
                                data = True
                            elif not line:  # the end of one event
                                if event_id is not None:
                                    last = event_id  # what a browser sends back (the hello's too)
                                    if data and kind is None:
                                        watcher.received.append(event_id)
                                        failures = 0
                                event_id, kind, data = None, None, False
                except (aiohttp.ClientError, TimeoutError) as exc:
                    watcher.error = f"{type(exc).__name__}: {exc}"
                failures += 1
                await asyncio.sleep(0.5)  # the page's `retry: 1000`, shorter
        raise RuntimeError(f"gave up after {RECONNECTS} broken streams ({watcher.error or 'ended'})")
