"""Bounds on the console's connections: how many at once, and how long a request head may take.

aiohttp holds a connection that never completes its first request head for ever, and accepts as
many as the process has file descriptors: 20,000 half-sent requests left the gRPC API in the same
process without a descriptor to accept a call with. `ConnectionGuard` wraps aiohttp's protocol
factory (what `loop.create_server` calls per accepted connection) and keeps two bounds:

* time: a connection must complete a request (head and body) within `header_timeout` of its
  opening or of the end of its previous response, else it is closed (this is also the idle
  keep-alive limit); a request being answered (a page, the live event stream) is never cut;
* number: at most `limit` connections at once. One more replaces the connection that has been
  waiting longest for a request (a browser whose idle keep-alive connection is closed simply opens
  another); if every connection is busy answering, the new one is closed at once.

One timer serves every connection: waiting connections are kept in the order they started
waiting, which is also the order of their deadlines.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
from collections.abc import Callable
from typing import Final, cast

log = logging.getLogger(__name__)

# Descriptors the console may take of the process's limit: the rest are for gRPC, Redis,
# PostgreSQL, webhooks and the logs.
FD_SHARE: Final = 4
MIN_CONNECTIONS: Final = 16


def connection_limit(configured: int, soft: int | None = None) -> int:
    """`configured`, lowered to a quarter of the soft RLIMIT_NOFILE `soft` (default: this process's),
    at least MIN_CONNECTIONS."""
    if soft is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(MIN_CONNECTIONS, min(configured, soft // FD_SHARE))


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol, seen by the guard first."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream server's transport (TCP, or TLS over it): it can be aborted.
        self.transport = cast(asyncio.Transport, transport)
        if not self._guard._admit(self):
            self.transport.abort()  # the inner protocol never saw it: nothing to tell it
            return
        self.admitted = True
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.admitted:
            return
        self.admitted = False
        self._guard._release(self)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class ConnectionGuard:
    """A protocol factory for `loop.create_server` bounding connections in number and idle time.

    Args:
        factory: aiohttp's protocol factory (`AppRunner.server`).
        limit: Connections held at once.
        header_timeout: Seconds a connection may wait for its next complete request.
    """

    def __init__(self, factory: Callable[[], asyncio.Protocol], *, limit: int, header_timeout: float) -> None:
        self._factory = factory
        self.limit = limit
        self.header_timeout = header_timeout
        self._open: set[_Guarded] = set()
        self._by_inner: dict[object, _Guarded] = {}
        # Connections waiting for a request -> their deadline, in deadline order.
        self._waiting: collections.OrderedDict[_Guarded, float] = collections.OrderedDict()
        self._timer: asyncio.TimerHandle | None = None
        self.evicted = 0
        self.refused = 0
        self.timed_out = 0
        self._warned = False

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self, self._factory())

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def _admit(self, connection: _Guarded) -> bool:
        if len(self._open) >= self.limit:
            if not self._waiting:
                self.refused += 1
                self._warn()
                return False
            oldest, _ = self._waiting.popitem(last=False)
            self.evicted += 1
            self._warn()
            self._drop(oldest)
            oldest.abort()
        self._open.add(connection)
        self._by_inner[connection.inner] = connection
        self._wait(connection)
        return True

    def _warn(self) -> None:
        if not self._warned:  # once per process: a flood must not flood the log too
            self._warned = True
            log.warning(
                "console: connection limit reached; the longest-waiting connections are closed",
                extra={"limit": self.limit},
            )

    def _drop(self, connection: _Guarded) -> None:
        self._open.discard(connection)
        self._by_inner.pop(connection.inner, None)
        self._waiting.pop(connection, None)

    def _release(self, connection: _Guarded) -> None:
        self._drop(connection)

    def _wait(self, connection: _Guarded) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.header_timeout
        self._waiting[connection] = deadline
        self._waiting.move_to_end(connection)
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._waiting:
            connection, deadline = next(iter(self._waiting.items()))
            if deadline > now:
                self._timer = loop.call_at(deadline, self._sweep)
                return
            self._waiting.popitem(last=False)
            self.timed_out += 1
            self._drop(connection)
            connection.abort()

    def request_started(self, protocol: object) -> None:
        """The connection of `protocol` (aiohttp's, `request.protocol`) has a request to answer."""
        connection = self._by_inner.get(protocol)
        if connection is not None:
            self._waiting.pop(connection, None)

    def request_finished(self, protocol: object) -> None:
        """The request is answered: the connection waits for its next one (within the timeout)."""
        connection = self._by_inner.get(protocol)
        if connection is not None and connection in self._open:
            self._wait(connection)

    def close(self) -> None:
        """Stop the timer (the server's connections are closed by aiohttp's shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
