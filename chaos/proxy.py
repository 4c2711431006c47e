"""A small asyncio TCP fault proxy: one listening port in front of one server, per link.

Each role reaches Redis and PostgreSQL through proxies of its own, so a fault can hit one link
("the leader reaches PostgreSQL but not Redis") and leave the others alone. Faults:

* `latency(low, high)`: every chunk, each way, is delivered `uniform(low, high)` seconds after it
  arrived, in order (a slow network, not a slow server: throughput is kept).
* `blackhole()`: nothing is delivered, new connections are accepted but not connected upstream.
  Bytes are held, not dropped, as TCP would (dropping would desynchronise the protocol): on
  `heal()` whatever the peers still wait for arrives. Clients see silence and time out.
* `reset()`: every open connection is aborted with an RST, both ways; with `refuse=True` new
  connections are reset at once until `heal()` (a server that is down).
* `drop_reply_to(marker)`: the next request containing `marker` reaches the server, but its reply
  is swallowed and the connection reset: the command ran, the client saw a connection error (what
  makes a client's auto-retry resend a command).

Loopback only: `tc` and toxiproxy are not available on the machines this runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

_CHUNK = 65536


@dataclass
class LinkStats:
    """What went through a proxy (for tests and reports)."""

    accepted: int = 0
    reset: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    dropped_replies: int = 0


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0), not a FIN: the peer sees ECONNRESET."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    swallow_reply: bool = False  # set by a request carrying the `drop_reply_to` marker

    def abort(self) -> None:
        _abort(self.client)
        if self.upstream is not None:
            _abort(self.upstream)
        for task in self.tasks:
            task.cancel()


class FaultProxy:
    """Forward `127.0.0.1:port` to `target_host:target_port`, with injectable faults.

    Args:
        name: For reports and logs (e.g. "worker-1/redis").
        target_host: The server's address.
        target_port: The server's port.
        seed: Seed of the latency generator (reproducible runs).
    """

    def __init__(self, name: str, target_host: str, target_port: int, *, seed: int = 0) -> None:
        self.name = name
        self.target = (target_host, target_port)
        self.port = 0
        self.stats = LinkStats()
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[object]] = set()
        self._open = asyncio.Event()
        self._open.set()
        self._latency = (0.0, 0.0)
        self._refuse = False
        self._drop_marker: bytes | None = None
        self._rng = random.Random(seed)

    @classmethod
    def for_url(cls, url: str, *, name: str = "proxy") -> FaultProxy:
        """A proxy (not started) in front of the server of a `redis://` or `postgresql://` URL."""
        parts = urlsplit(url)
        return cls(name, parts.hostname or "127.0.0.1", parts.port or 0)

    @classmethod
    async def to_url(cls, url: str, *, name: str = "proxy") -> tuple[FaultProxy, str]:
        """A started proxy in front of the server of `url`, and the same URL through the proxy."""
        proxy = await cls.for_url(url, name=name).start()
        return proxy, proxy.url(url)

    def url(self, url: str) -> str:
        """`url` with its host and port replaced by this (started) proxy's."""
        parts = urlsplit(url)
        credentials = parts.netloc.rpartition("@")[0]
        netloc = f"{credentials}@{self.url_host_port}" if credentials else self.url_host_port
        return urlunsplit(parts._replace(netloc=netloc))

    @property
    def url_host_port(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def state(self) -> str:
        if self._refuse:
            return "refusing"
        if not self._open.is_set():
            return "blackhole"
        if self._latency != (0.0, 0.0):
            return f"latency {self._latency[0]:g}-{self._latency[1]:g}s"
        return "ok"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._abort_all()
            for handler in self._handlers:
                handler.cancel()
            if self._handlers:
                await asyncio.wait(self._handlers, timeout=2)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await self._server.wait_closed()
            self._server = None

    # -- faults ------------------------------------------------------------------------------------

    def latency(self, low: float, high: float | None = None) -> None:
        """Delay every chunk by uniform(low, high) seconds from now on (open connections too)."""
        self._latency = (low, low if high is None else high)

    def blackhole(self) -> None:
        """Deliver nothing from now on (bytes are held until `heal`)."""
        self._open.clear()

    def reset(self, *, refuse: bool = False) -> int:
        """Abort every open connection with an RST; with `refuse`, reset new ones until `heal`.

        Returns:
            How many connections were reset.
        """
        self._refuse = refuse
        return self._abort_all()

    def drop_reply_to(self, marker: bytes) -> None:
        """Swallow the reply to the next request that contains `marker`, then reset its connection."""
        self._drop_marker = marker

    def heal(self) -> None:
        """Back to a plain pipe: no latency, held bytes flow, new connections accepted."""
        self._latency = (0.0, 0.0)
        self._refuse = False
        self._open.set()

    def connections(self) -> int:
        return len(self._connections)

    # -- the pipe ----------------------------------------------------------------------------------

    def _abort_all(self) -> int:
        connections = list(self._connections)
        for connection in connections:
            connection.abort()
        self._connections.clear()
        self.stats.reset += len(connections)
        return len(connections)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A task of the proxy's own, not the one asyncio makes of a coroutine callback: `close`
        # cancels it, and on Python 3.11 asyncio's done-callback for that task calls `exception()`
        # on it cancelled, logging "Exception in callback ... CancelledError" into every test.
        handler = asyncio.create_task(self._serve(reader, writer))
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        if self._refuse:
            _abort(writer)
            self.stats.reset += 1
            return
        connection = _Connection(writer)
        self._connections.add(connection)
        try:
            await self._open.wait()  # a partitioned link does not even connect
            try:
                async with asyncio.timeout(5):
                    up_reader, up_writer = await asyncio.open_connection(*self.target)
            except (OSError, TimeoutError):
                _abort(writer)  # the server is down: the client sees a reset, as it would
                return
            connection.upstream = up_writer
            connection.tasks = [
                asyncio.create_task(self._pump(reader, up_writer, connection, up=True)),
                asyncio.create_task(self._pump(up_reader, writer, connection, up=False)),
            ]
            # One side closing ends the connection: close the other side too.
            await asyncio.wait(connection.tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in connection.tasks:
                task.cancel()
            for side in (writer, connection.upstream):
                if side is not None:
                    side.close()
            self._connections.discard(connection)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: _Connection, *, up: bool
    ) -> None:
        """Copy one direction; a reader task and a delivering loop, so latency keeps throughput."""
        # Bounded: a held (blackholed) link pushes back on the sender, as a full TCP window does.
        pending: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=256)

        async def read() -> None:
            while True:
                try:
                    data = await reader.read(_CHUNK)
                except (ConnectionError, OSError):
                    data = b""
                low, high = self._latency
                delay = self._rng.uniform(low, high) if high > 0 else 0.0
                await pending.put((time.monotonic() + delay, data))
                if not data:
                    return

        reading = asyncio.create_task(read())
        last = 0.0
        try:
            while True:
                deliver_at, data = await pending.get()
                deliver_at = max(deliver_at, last)  # in order, whatever each chunk's delay
                last = deliver_at
                if (wait := deliver_at - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                await self._open.wait()
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                if up:
                    self.stats.bytes_up += len(data)
                    if self._drop_marker is not None and self._drop_marker in data:
                        self._drop_marker, connection.swallow_reply = None, True
                else:
                    if connection.swallow_reply:
                        self.stats.dropped_replies += 1
                        connection.abort()
                        return
                    self.stats.bytes_down += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            return
        finally:
            reading.cancel()
            await asyncio.wait([reading])
