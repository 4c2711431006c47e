"""The unary fallback of a remote worker's stream (issue 23), for environments where a bidirectional
stream does not survive: a `UnarySession` is a stream's `Session`, the same in-process `Worker`
with the same credit, acks, outcomes, cancels and hand-backs, served by calls instead
(`WorkerService.OpenWorkerSession`, `PollWorkerSession`, `CloseWorkerSession`).

* Open: `remote.open(hello)` exactly as a stream's hello (checks, resume once honoured); the
  session's id is a random secret bound to the API key that opened it.
* Poll: the worker's batch goes to the session's `on_ack` / `on_outcome` / `on_credit` (the
  stream's own methods, in the stream's order); the session's `outbound()` messages, which a pump
  task reads into a buffer as the stream's servicer would write them, go out in the answer, waiting
  up to the poll's `wait` for one. Polls may overlap; each message goes out once.
* Liveness: a poll is the proof of life (a unary session has no pings: the pump answers the
  session's own pings itself). A session with no poll in flight for `poll_timeout` is ended, and its
  runs handed back as at a stream's end. A protocol error in a poll's batch ends the session with
  that error, as it ends a stream.
* Close: the stream's end (`Session.end`), waiting for the hand-back.

An ended session answers its end's status to the polls that follow for `poll_timeout` (so a worker
learns why), then is forgotten (NOT_FOUND, as a session another process holds).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Final

from scheduler_grpc.config import Settings, format_duration
from scheduler_grpc.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, SchedulerError
from scheduler_grpc.remote.protocol import Hello, Outbound, Ping
from scheduler_grpc.remote.session import OUTBOX_SLACK, Session

log = logging.getLogger("scheduler_grpc.remote")

GONE: Final = "is not held by this server process (another process opened it, or it ended); open a new one"


class UnarySession:
    """One unary session: a `Session`, its messages waiting for a poll, its liveness timer.

    Args:
        session: The session (opened by `RemoteWorkers.open`, not yet running).
        owner: The id of the API key that opened it (only it may poll).
        poll_timeout: How long the session lives with no poll in flight.
        forget: Called once the session ended and its status was kept for `poll_timeout`.
    """

    def __init__(self, session: Session, *, owner: str, poll_timeout: timedelta, forget: Callable[[], None]) -> None:
        self.id = secrets.token_urlsafe(24)
        self.session = session
        self.owner = owner
        self.poll_timeout = poll_timeout
        self._forget = forget
        self._buffer: collections.deque[Outbound] = collections.deque()
        self._changed = asyncio.Event()
        self._polls = 0  # in flight
        self._loop = asyncio.get_running_loop()
        self._expiry: asyncio.TimerHandle | None = None
        self.ending = False  # the session's messages ended: it takes no more
        self.error: Exception | None = None  # why it ended, if not closed by its worker
        # Done once the session runs, its held runs resumed (the welcome says which), or failed to.
        self.ready: asyncio.Future[None] = self._loop.create_future()
        self.task = asyncio.create_task(self._serve(), name=f"remote-unary {session.id}")
        self._arm()

    # -- the session's life ----------------------------------------------------------------------------

    async def _serve(self) -> None:
        session = self.session
        limit = session.hello.slots + OUTBOX_SLACK
        try:
            async with session.running():
                if not self.ready.done():
                    self.ready.set_result(None)
                try:
                    async for message in session.outbound():
                        if isinstance(message, Ping):
                            session.on_pong(message.nonce)  # the polls are the liveness (`_expire`)
                            continue
                        if isinstance(message, list):
                            self._buffer.extend(message)
                        else:
                            self._buffer.append(message)
                        self._changed.set()
                        if len(self._buffer) > limit:
                            session.fail(Aborted("the worker does not poll its session; open a new one"))
                except SchedulerError as exc:
                    self.error = exc
                except Exception:
                    log.exception("remote worker's unary session failed", extra={"worker_id": session.id})
                    self.error = Aborted("the server failed to serve this session (logged); open a new one")
                finally:
                    self.ending = True
                    self._changed.set()
        except SchedulerError as exc:  # it could not start (resuming its held runs failed)
            self.error = exc
        finally:
            self.ending = True
            if not self.ready.done():
                self.ready.set_exception(self.error or Aborted("the session could not start; open a new one"))
            self._disarm()
            self._changed.set()
            self._loop.call_later(self.poll_timeout.total_seconds(), self._forget)

    def _arm(self) -> None:
        self._disarm()
        self._expiry = self._loop.call_later(self.poll_timeout.total_seconds(), self._expire)

    def _disarm(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _expire(self) -> None:
        self._expiry = None
        if self._polls or self.ending:
            return
        log.warning(
            "remote worker's unary session had no poll in time; ending it", extra={"worker_id": self.session.id}
        )
        self.session.fail(
            Aborted(f"no poll for {format_duration(self.poll_timeout)}: the session is ended; open a new one")
        )

    def status(self) -> Exception:
        """What a poll of the ended session raises."""
        return self.error if self.error is not None else NotFound(f"session_id: the session {GONE}")

    # -- a poll ----------------------------------------------------------------------------------------

    async def poll(self, apply: Callable[[Session], None], wait: timedelta, take: Callable[[Outbound], bool]) -> None:
        """One poll: `apply` the worker's batch to the session, then hand the messages ready (or
        the first to come within `wait`) to `take`, in order, while it accepts them (it accepts at
        least the first; one it refuses stays for the next poll).

        Raises:
            InvalidArgument, FailedPrecondition: the batch broke the protocol (the session ends).
            Aborted: a server bug on the batch (logged; the session ends), or the session's end.
            NotFound: the session ended without an error (closed).
        """
        if self.ending:
            raise self.status()
        self._polls += 1
        self._disarm()
        try:
            try:
                apply(self.session)
            except (InvalidArgument, FailedPrecondition) as exc:
                self.session.fail(exc)
                raise
            except Exception:
                log.exception("remote worker's poll could not be handled", extra={"worker_id": self.session.id})
                error = Aborted("the server failed to handle a message of this session (logged); open a new one")
                self.session.fail(error)
                raise error from None
            await self._wait(wait.total_seconds())
            if self.ending:  # what it had not sent is moot: its runs are handed back
                raise self.status()
            buffer = self._buffer
            while buffer and take(buffer[0]):
                buffer.popleft()
        finally:
            self._polls -= 1
            if not self._polls and not self.ending:
                self._arm()

    async def _wait(self, seconds: float) -> None:
        if not self._buffer and not self.ending and seconds > 0:
            deadline = self._loop.time() + seconds
            while not self._buffer and not self.ending:
                remaining = deadline - self._loop.time()
                if remaining <= 0:
                    return
                self._changed.clear()
                try:
                    async with asyncio.timeout(remaining):
                        await self._changed.wait()
                except TimeoutError:
                    return
        # One turn of the loop: what the session is about to send with it (the other assignments of
        # a fetch) goes out in the same answer.
        await asyncio.sleep(0)

    async def close(self) -> None:
        """The worker ends its session (as it closes a stream); returns once its runs are back."""
        self.session.end()
        await asyncio.shield(self.task)


class UnarySessions:
    """The unary sessions of one server process.

    Args:
        open_session: Opens a stream's session for a hello from a peer (`RemoteWorkers.open`).
        settings: The server's settings (`remote_poll_wait`, `remote_poll_timeout`).
    """

    def __init__(self, open_session: Callable[[Hello, str], Session], settings: Settings) -> None:
        self._open = open_session
        self.max_wait = settings.remote_poll_wait
        self.poll_timeout = settings.remote_poll_timeout
        self._held: dict[str, UnarySession] = {}

    def __len__(self) -> int:
        """The sessions held (ended ones included until they are forgotten)."""
        return len(self._held)

    def open(self, hello: Hello, peer: str, owner: str) -> UnarySession:
        """A session for a worker's hello, held here.

        Raises:
            InvalidArgument: naming the hello's field at fault.
        """
        session = self._open(hello, peer)
        held: UnarySession | None = None

        def forget() -> None:
            if held is not None and self._held.get(held.id) is held:
                del self._held[held.id]

        held = UnarySession(session, owner=owner, poll_timeout=self.poll_timeout, forget=forget)
        self._held[held.id] = held
        return held

    def get(self, session_id: str, owner: str) -> UnarySession:
        """The session `session_id`, if this process holds it for `owner`.

        Raises:
            InvalidArgument: no `session_id`.
            NotFound: not held here (another process opened it, it was forgotten, or another API
                key opened it: no other key learns that it exists).
        """
        if not session_id:
            raise InvalidArgument("session_id", "required: the id OpenWorkerSession returned")
        held = self._held.get(session_id)
        if held is None or not secrets.compare_digest(held.owner, owner):
            raise NotFound(f"session_id: the session {session_id[:64]!r} {GONE}")
        return held

    async def close(self, session_id: str, owner: str) -> None:
        """End a session at its worker's request and forget it.

        Raises:
            InvalidArgument, NotFound: as `get`.
        """
        held = self.get(session_id, owner)
        del self._held[session_id]
        await held.close()

    async def wait_closed(self) -> None:
        """Wait for every session's task (after the sessions were ended: `RemoteWorkers.drain`)."""
        tasks = [held.task for held in self._held.values() if not held.task.done()]
        if tasks:
            await asyncio.wait(tasks)


__all__ = ["UnarySession", "UnarySessions"]
