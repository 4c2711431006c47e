"""A loopback TCP proxy that injects real network faults between a client and a server.

These machines have no `tc` and no toxiproxy; a client pointed at the proxy sees exactly what it
would see from a failing network: connections reset, refused, or a reply that never arrives after
the server has acted on the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit, urlunsplit


class _Link:
    def __init__(self, client: asyncio.StreamWriter, server: asyncio.StreamWriter) -> None:
        self.client = client
        self.server = server
        self.swallow_reply = False

    def close(self) -> None:
        for writer in (self.client, self.server):
            with contextlib.suppress(Exception):
                writer.transport.abort()  # a reset, not a polite FIN


class FaultProxy:
    """Forwards `127.0.0.1:<port>` to `target_host:target_port`, until told to misbehave.

    Faults:
        refuse() (or cut()): reset every open connection and every new one until `heal()`.
        drop_reply_to(marker): the next request containing `marker` reaches the server, but its
            reply is swallowed and the connection reset: the command ran, the client saw a
            ConnectionError.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._refusing = False
        self._drop_marker: bytes | None = None
        self.port = 0
        self.dropped_replies = 0

    @classmethod
    def for_url(cls, url: str) -> FaultProxy:
        """A proxy (not started) to the server of `url`."""
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 0)

    def url(self, url: str) -> str:
        """`url` with its host and port replaced by the (started) proxy's."""
        parts = urlsplit(url)
        credentials = parts.netloc.rpartition("@")[0]
        netloc = f"{credentials}@127.0.0.1:{self.port}" if credentials else f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    @classmethod
    async def to_url(cls, url: str) -> tuple[FaultProxy, str]:
        """A started proxy to the server of `url`, and the same URL through the proxy."""
        proxy = cls.for_url(url)
        await proxy.start()
        return proxy, proxy.url(url)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        for link in list(self._links):
            link.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def refuse(self) -> None:
        """Reset every open connection, and every new one until `heal()` (a stopped server)."""
        self._refusing = True
        for link in list(self._links):
            link.close()

    cut = refuse

    def heal(self) -> None:
        self._refusing = False

    def drop_reply_to(self, marker: bytes) -> None:
        self._drop_marker = marker

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.transport.abort()
            return
        try:
            server_reader, server_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        link = _Link(writer, server_writer)
        self._links.add(link)
        try:
            await asyncio.gather(
                self._pump(reader, link, upstream=True), self._pump(server_reader, link, upstream=False)
            )
        finally:
            self._links.discard(link)
            link.close()

    async def _pump(self, reader: asyncio.StreamReader, link: _Link, *, upstream: bool) -> None:
        writer = link.server if upstream else link.client
        try:
            while chunk := await reader.read(65536):
                if upstream and self._drop_marker is not None and self._drop_marker in chunk:
                    self._drop_marker = None
                    link.swallow_reply = True
                if not upstream and link.swallow_reply:
                    self.dropped_replies += 1
                    link.close()
                    return
                writer.write(chunk)
                await writer.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            link.close()
