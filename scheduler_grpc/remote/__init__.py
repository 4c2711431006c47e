"""Remote workers (issue 23): workers in any language serve runs over one `WorkerService.Connect`
stream each, on the same run lifecycle as the in-process worker.

- `protocol`: what the two sides say, as domain values, and the checks of a worker's hello;
- `handler`: the handlers of a session (`RemoteHandler` per advertised handler, `NotServedHere`
  for the rest, `NotAcknowledged`, the unspent hand-back of an assignment not acknowledged);
- `session`: one stream's `Session`, a `scheduler_grpc.worker.Worker` whose handlers are remote,
  with credit, acks, outcomes, cancels, pings, parking at a stream's end and resuming held runs;
- `unary`: the unary fallback (`OpenWorkerSession` / `PollWorkerSession` / `CloseWorkerSession`),
  the same `Session` served by polls.

`RemoteWorkers` opens the sessions of one server process and knows the live ones (so that a
session that resumed runs another one still holds makes that one let them go).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from datetime import UTC, datetime, timedelta

from redis.asyncio import Redis

from scheduler_grpc.auth import PermissionDenied, Unauthenticated
from scheduler_grpc.config import Settings
from scheduler_grpc.errors import Unavailable
from scheduler_grpc.ports import HistoryPruning, RunStore
from scheduler_grpc.remote.protocol import Hello, check_hello
from scheduler_grpc.remote.session import Session
from scheduler_grpc.remote.unary import UnarySessions
from scheduler_grpc.sharding import ShardMap

log = logging.getLogger("scheduler_grpc.remote")


class RemoteWorkers:
    """The remote workers' sessions of one server process.

    Args:
        redis: The server's Redis client.
        runs: The attempts in PostgreSQL (the worker's hot path).
        history: What `system.cleanup` prunes through.
        settings: The server's settings.
        reserved: Handler names remote workers may not serve (the server's built-in handlers).
    """

    def __init__(
        self,
        redis: Redis,
        runs: RunStore,
        history: HistoryPruning,
        settings: Settings,
        reserved: Collection[str] = (),
        *,
        shard_map: ShardMap | None = None,
    ) -> None:
        self._reserved = frozenset(reserved)
        self._shard_map = shard_map
        self._redis = redis
        self._runs = runs
        self._history = history
        self._settings = settings
        self.sessions: set[Session] = set()  # open, until their hand-back is done
        self.unary = UnarySessions(self.open, settings)  # the sessions served by polls, among those
        self._stopping = False

    @property
    def hello_timeout(self) -> timedelta:
        """How long a stream may take to say `hello` (SCHEDULER_REMOTE_HELLO_TIMEOUT)."""
        return self._settings.remote_hello_timeout

    def open(self, hello: Hello, peer: str) -> Session:
        """A session for a worker that said `hello` from `peer` (a gRPC peer string).

        Raises:
            InvalidArgument: naming the hello's field at fault.
            Unavailable: the server is stopping (the worker reconnects, to another server).
        """
        if self._stopping:
            raise Unavailable("the server is stopping; reconnect to another server")
        check_hello(hello, self._reserved)
        session = Session(
            hello, redis=self._redis, runs=self._runs, history=self._history, settings=self._settings,
            peer_host=peer_host(peer), on_adopted=self._adopted, shard_map=self._shard_map,
        )  # fmt: skip
        self.sessions.add(session)
        session.ended.add_done_callback(lambda _: self.sessions.discard(session))
        return session

    async def keep_authorized(self, session: Session, check: Callable[[], Awaitable[object]]) -> None:
        """Run for the stream's life: every ping interval, `check` the credential the stream opened
        with (the authenticator, through its short cache); a key revoked or expired since ends the
        stream with UNAUTHENTICATED, so an operator's revoke stops the worker (its runs parked as
        at any stream's end: their leases expire unless resumed with a valid key). A store that
        cannot answer does not end it: logged once, checked again next time."""
        interval = self._settings.remote_ping_interval.total_seconds()
        unanswered = False
        while True:
            await asyncio.sleep(interval)
            try:
                async with asyncio.timeout(interval):
                    await check()
            except (Unauthenticated, PermissionDenied):
                log.warning("remote worker's API key was revoked or expired; ending its stream",
                            extra={"worker_id": session.id})  # fmt: skip
                session.fail(Unauthenticated("the worker's API key was revoked or has expired"))
                return
            except Exception as exc:  # the key store is down: the stream goes on meanwhile
                if not unanswered:
                    log.warning("could not recheck a remote worker's API key: %s", exc,
                                extra={"worker_id": session.id})  # fmt: skip
                unanswered = True
            else:
                unanswered = False

    def _adopted(self, adopter: Session, runs: Mapping[str, str]) -> None:
        """`adopter` resumed `runs` (execution id: claim token): any other session here lets them go."""
        for session in list(self.sessions):
            if session is not adopter:
                session.let_go(runs)

    async def drain(self, grace: timedelta) -> None:
        """The server is stopping: tell every stream to drain, let them end within `grace` (their
        outcomes in flight recorded), then end the rest (UNAVAILABLE: reconnect to another server),
        and wait for every session's end. Runs still running then are parked, not handed back: the
        worker resumes them on the server it reconnects to (or their leases expire)."""
        self._stopping = True
        deadline = datetime.now(UTC) + grace
        for session in list(self.sessions):
            session.drain(deadline)
        waiting = [s.ended for s in self.sessions]
        if waiting:
            await asyncio.wait(waiting, timeout=grace.total_seconds())
        for session in list(self.sessions):
            session.fail(Unavailable("the server is stopping; reconnect to another server"))
        waiting = [s.ended for s in self.sessions]
        if waiting:
            await asyncio.wait(waiting)
        await self.unary.wait_closed()


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (`ipv4:1.2.3.4:5678`, `ipv6:[::1]:5678`, `unix:...`)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = rest.rsplit(":", 1)[0]
        return host.strip("[]") or "unknown"
    return kind or "unknown"


__all__ = ["Hello", "RemoteWorkers", "Session", "check_hello", "peer_host"]
