"""The console's one Server-Sent Events relay: execution events from the shared fan-out (the source
of WatchExecutions) to a browser, for the executions page and a flow run's page alike.

Each message's `id` is its stream cursor: a browser that reconnects sends it back as `Last-Event-ID`
and the stream resumes right after it. A quiet stream gets a comment line every `KEEPALIVE`, which
keeps proxies from timing it out and finds a client that went away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Final

import orjson
from aiohttp import web

from scheduler_grpc.console.context import CONSOLE
from scheduler_grpc.events import CursorExpired, EventFilter, ExecutionEvent, FanoutClosed, SubscriberTooSlow

KEEPALIVE: Final = timedelta(seconds=15)

Encode = Callable[[ExecutionEvent], Awaitable[bytes]]
"""The `data:` of one event's message (bytes of one line)."""


def cursor_of(request: web.Request) -> str | None:
    """Where the browser resumes: its `Last-Event-ID`, else a `cursor` the page read before."""
    return request.headers.get("Last-Event-ID") or request.query.get("cursor") or None


def stream_response() -> web.StreamResponse:
    return web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no"})


async def relay(request: web.Request, event_filter: EventFilter, encode: Encode) -> web.StreamResponse:
    """Stream the events `event_filter` admits until the client goes or the fan-out drops it.

    An expired cursor ends the stream with `event: expired` (the page reloads); a subscriber too slow
    for the fan-out, or a fan-out closing with the server, ends it plainly (the browser reconnects
    with its last event id and resumes from there).
    """
    response = stream_response()
    try:
        async with request.app[CONSOLE].api.fanout.subscribe(event_filter, cursor_of(request)) as subscription:
            # Headers only once subscribed: a refusal (a malformed cursor, Redis unreachable) is
            # still an ordinary error response.
            await response.prepare(request)
            await response.write(f"retry: 1000\nid: {subscription.cursor}\nevent: hello\ndata: {{}}\n\n".encode())

            async def forward() -> None:
                async for event in subscription:
                    data = await encode(event)
                    await response.write(b"id: " + event.cursor.encode() + b"\ndata: " + data + b"\n\n")

            forwarder = asyncio.ensure_future(forward())
            try:
                while True:
                    done, _ = await asyncio.wait({forwarder}, timeout=KEEPALIVE.total_seconds())
                    if done:
                        forwarder.result()
                        break
                    await response.write(b": keepalive\n\n")
            finally:
                forwarder.cancel()
                # Waits without raising the forwarder's outcome; a cancellation of this handler
                # (the client went away) still propagates.
                await asyncio.wait({forwarder})
    except CursorExpired as exc:
        await response.prepare(request)
        await response.write(b"event: expired\ndata: " + orjson.dumps({"error": str(exc)}) + b"\n\n")
    except (SubscriberTooSlow, FanoutClosed):
        pass
    return response
