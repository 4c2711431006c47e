"""`shell.command`: run an argv (no shell) in its own process group, and never leave orphans."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import time
from collections.abc import Awaitable, Mapping
from typing import Any, ClassVar, TypeVar

from scheduler_grpc.handlers.base import (
    ExecutionContext,
    Field,
    Handler,
    HandlerError,
    HandlerSettings,
    JSONValue,
    PermanentHandlerError,
    get_number,
    get_str,
    get_str_map,
    payload_error,
)
from scheduler_grpc.processes import die_with_parent

MAX_ARGS = 256
MAX_ARG_LENGTH = 4096
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0
TAIL_BYTES = 4096
TERM_GRACE_SECONDS = 0.5
# Variables a command inherits from the worker; everything else (credentials above all) is dropped.
INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "HOME")
DISABLED = "shell.command is disabled; set SCHEDULER_SHELL_ENABLED=true"

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_T = TypeVar("_T")


class ShellHandler(Handler):
    """Runs `argv` with `create_subprocess_exec` in a new session (its own process group).

    The environment is scrubbed to `INHERITED_ENV` plus the job's `env`. On cancellation or
    timeout the whole group gets SIGTERM, then SIGKILL after `TERM_GRACE_SECONDS`; members left
    behind by a command that exited are killed the same way. Output is captured bounded (the last
    4 KiB of stdout and stderr). Should the worker die without clean-up (SIGKILL, the OOM killer),
    the kernel kills the program it started (PR_SET_PDEATHSIG): a run the leader recovers and hands
    to another worker is not left running twice. The program's own children escape that signal.
    """

    name: ClassVar[str] = "shell.command"
    description: ClassVar[str] = "Run a program (argv, no shell) on the worker; admins only, off by default"
    admin_only: ClassVar[bool] = True
    fields: ClassVar[tuple[Field, ...]] = (
        Field(
            "argv",
            "array<string>",
            f"program and arguments, executed without a shell (1-{MAX_ARGS} items of at most "
            f'{MAX_ARG_LENGTH} characters); use ["sh", "-c", "..."] to opt into a shell',
            required=True,
        ),
        Field("cwd", "string", "absolute working directory; must exist on the worker"),
        Field(
            "env",
            "object<string,string>",
            f"variables added to a scrubbed environment (only {', '.join(INHERITED_ENV)} are inherited)",
            default={},
        ),
        Field(
            "timeout_seconds",
            "number",
            "kill the command's process group after this many seconds (the job timeout applies too)",
        ),
    )

    def disabled_reason(self, settings: HandlerSettings) -> str | None:
        return None if settings.shell_enabled else DISABLED

    def normalize(self, payload: Mapping[str, Any], settings: HandlerSettings) -> dict[str, Any]:
        argv = payload["argv"]
        if not isinstance(argv, list) or not argv:
            raise payload_error("argv", 'must be a non-empty array of strings, e.g. ["/usr/bin/backup", "--all"]')
        if len(argv) > MAX_ARGS:
            raise payload_error("argv", f"has {len(argv)} items; at most {MAX_ARGS} are allowed")
        for index, arg in enumerate(argv):
            if not isinstance(arg, str):
                raise payload_error(f"argv[{index}]", "must be a string")
            if len(arg) > MAX_ARG_LENGTH:
                raise payload_error(f"argv[{index}]", f"is {len(arg)} characters; at most {MAX_ARG_LENGTH}")
            if "\0" in arg:
                raise payload_error(f"argv[{index}]", "must not contain NUL characters")
        if not argv[0]:
            raise payload_error("argv[0]", "must name a program")
        result: dict[str, Any] = {"argv": list(argv)}
        cwd = get_str(payload, "cwd", max_length=4096)
        if cwd is not None:
            if not os.path.isabs(cwd) or "\0" in cwd:
                raise payload_error("cwd", f"must be an absolute path, got {cwd!r}")
            result["cwd"] = cwd
        env = get_str_map(payload, "env", max_items=128, max_key_length=256, max_value_length=32768)
        for key, value in env.items():
            if not _ENV_NAME.match(key):
                raise payload_error("env", f"{key!r} is not a valid variable name (letters, digits, '_')")
            if "\0" in value:
                raise payload_error(f"env.{key}", "must not contain NUL characters")
        result["env"] = env
        timeout = get_number(
            payload, "timeout_seconds", default=None, minimum=0, maximum=MAX_TIMEOUT_SECONDS, exclusive_minimum=True
        )
        if timeout is not None:
            result["timeout_seconds"] = timeout
        return result

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        if not ctx.settings.shell_enabled:
            raise PermanentHandlerError(DISABLED)
        argv: list[str] = payload["argv"]
        cwd: str | None = payload.get("cwd")
        if cwd is not None and not await asyncio.to_thread(os.path.isdir, cwd):
            raise HandlerError(f"cwd {cwd!r} is not an existing directory on this worker")
        timeout: float | None = payload.get("timeout_seconds")
        env = scrubbed_env(payload.get("env", {}))
        # Looked up here, not by the exec: the wrapper below would turn a missing program into an
        # exit status instead of this clear error.
        program = await asyncio.to_thread(_program, argv[0], cwd, env["PATH"])
        if program is None:
            raise HandlerError(f"cannot start {argv[0]!r}: no such program (PATH={env['PATH']})")
        started = time.perf_counter()
        # The spawn is shielded: a cancel landing while it completes must still find (and kill)
        # the process group it started.
        spawn = asyncio.ensure_future(_spawn(die_with_parent(signal.SIGKILL, [program, *argv[1:]]), cwd, env))
        try:
            child = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            await _uninterruptible(_abandon(spawn))
            raise
        except FileNotFoundError:
            raise HandlerError(f"cannot start {argv[0]!r}: no such program (PATH={env['PATH']})") from None
        except OSError as exc:
            raise HandlerError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
        process = child.process
        ctx.log.debug("started %s as pid %d", argv[0], process.pid, extra={"pid": process.pid})
        timed_out = False
        try:
            async with asyncio.timeout(timeout):
                await child.exited.wait()
        except TimeoutError:
            timed_out = True
        finally:
            # Runs on success, timeout and cancellation alike; a second cancel cannot cut it short.
            await _uninterruptible(child.end())
        code = process.returncode
        assert code is not None
        result: dict[str, JSONValue] = {
            "exit_code": code,
            "stdout_tail": child.stdout.text(),
            "stderr_tail": child.stderr.text(),
            "elapsed_ms": round((time.perf_counter() - started) * 1000, 1),
        }
        if timed_out:
            raise HandlerError(f"timed out after {timeout:g}s; process group killed", details=result)
        if code != 0:
            tail = child.stderr.text()[-1000:].strip()
            raise HandlerError(f"{_describe_exit(code)}: {tail}" if tail else _describe_exit(code), details=result)
        return result


def scrubbed_env(extra: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a command: `INHERITED_ENV` from the worker plus the job's variables."""
    environ = os.environ if environ is None else environ
    env = {key: environ[key] for key in INHERITED_ENV if key in environ}
    env.setdefault("PATH", os.defpath)
    env.update(extra)
    return env


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Tail:
    """Keeps the last `limit` bytes of a stream."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffer = bytearray()

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self.buffer += chunk
            if len(self.buffer) > self.limit:
                del self.buffer[: -self.limit]

    def text(self) -> str:
        return self.buffer.decode("utf-8", errors="replace")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member changed credentials; it is still there
        return True
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Stream protocol that also reports the moment the process exits.

    `Process.wait()` on the default loop also waits for the pipes to close, which a leftover
    group member holding stdout would delay; `exited` does not.
    """

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited = asyncio.Event()

    def process_exited(self) -> None:
        super().process_exited()
        self.exited.set()


class _Child:
    """A started command: its process, exit event and bounded output readers."""

    def __init__(self, process: asyncio.subprocess.Process, exited: asyncio.Event) -> None:
        assert process.stdout is not None
        assert process.stderr is not None
        self.process = process
        self.exited = exited
        self.stdout = _Tail(TAIL_BYTES)
        self.stderr = _Tail(TAIL_BYTES)
        self.readers = [
            asyncio.create_task(self.stdout.drain(process.stdout)),
            asyncio.create_task(self.stderr.drain(process.stderr)),
        ]

    async def end(self) -> None:
        """SIGTERM the group, SIGKILL it after the grace period, wait for the exit, stop reading."""
        pgid = self.process.pid  # start_new_session: the child leads its own group
        if not self.exited.is_set() or _group_alive(pgid):
            _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + TERM_GRACE_SECONDS
            while time.monotonic() < deadline:
                if self.exited.is_set() and not _group_alive(pgid):
                    break
                await asyncio.sleep(0.01)
            # Always: a member that ignored SIGTERM must go too.
            _signal_group(pgid, signal.SIGKILL)
        await self.exited.wait()
        # With the group gone the pipes close; a process that escaped the group (setsid) and
        # keeps them open must not hold the job: stop reading after a moment.
        _done, pending = await asyncio.wait(self.readers, timeout=1.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)


def _program(name: str, cwd: str | None, path: str) -> str | None:
    """The executable file `name` runs: found on `path`, or a path itself (relative to `cwd`)."""
    if os.sep not in name:
        return shutil.which(name, path=path)
    candidate = os.path.join(cwd or os.getcwd(), name)  # an absolute `name` stays as it is
    return candidate if os.path.isfile(candidate) and os.access(candidate, os.X_OK) else None


async def _spawn(argv: list[str], cwd: str | None, env: dict[str, str]) -> _Child:
    loop = asyncio.get_running_loop()
    protocol: _ExitProtocol | None = None

    def factory() -> _ExitProtocol:
        nonlocal protocol
        protocol = _ExitProtocol(limit=2**16, loop=loop)
        return protocol

    transport, _ = await loop.subprocess_exec(
        factory,
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    assert protocol is not None
    return _Child(asyncio.subprocess.Process(transport, protocol, loop), protocol.exited)


async def _abandon(spawn: asyncio.Future[_Child]) -> None:
    """Kill whatever a spawn that is no longer wanted started."""
    try:
        child = await spawn
    except Exception:
        return
    await child.end()


async def _uninterruptible(awaitable: Awaitable[_T]) -> _T:
    """Await to completion even if cancelled meanwhile; then re-raise that cancellation."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result
