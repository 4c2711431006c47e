"""Structured logs: one JSON object per line (orjson), or readable text for a terminal.

Modules log through the standard `logging` module and pass context as `extra={...}`
(job_id, execution_id, worker_id, attempt, term, ...); every extra field lands in the JSON object.

Writing is off the caller's thread: a record is formatted where it is logged (its arguments may
change later), put on a bounded queue, and written to stderr by a writer thread in batches (at most
every 20 ms, one write for all the lines queued meanwhile), so a slow or full stderr pipe never
blocks the event loop and a line costs no thread wake-up of its own. With nothing to write the
writer sleeps until the next line comes (an idle process is not woken 50 times a second). When the
queue is full, lines are dropped and counted (a later line says how many); the queue is flushed at exit.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import logging
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import orjson

# The trace id of the gRPC call being served, set by the interceptors; every log line written while
# serving it carries it, so one call's lines can be found together.
TRACE: contextvars.ContextVar[str | None] = contextvars.ContextVar("scheduler_trace", default=None)

# Set by `tracing` while OpenTelemetry tracing is on: the current span's (trace id, span id), or
# None outside any span. Then a line carries those ids (`trace`, `span`) instead of TRACE's.
span_ids: Callable[[], tuple[str, str] | None] | None = None

# Attributes every LogRecord has; anything else on a record came from `extra=` and is context.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def _context(record: logging.LogRecord) -> dict[str, Any]:
    return {key: value for key, value in vars(record).items() if key not in _STANDARD and not key.startswith("_")}


_make_record = logging.getLogRecordFactory()


def _record_with_trace(*args: Any, **kwargs: Any) -> logging.LogRecord:
    # Stamp the trace when the record is made (in the call's context), not when it is formatted.
    record = _make_record(*args, **kwargs)
    if span_ids is not None and (ids := span_ids()) is not None and not hasattr(record, "trace"):
        record.trace, record.span = ids
        return record
    trace = TRACE.get()
    if trace is not None and not hasattr(record, "trace"):
        record.trace = trace
    return record


logging.setLogRecordFactory(_record_with_trace)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object: time, level, role, pid, logger, message, context."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "role": self.role,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_context(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """`HH:MM:SS.mmm LEVEL role[pid] message key=value ...` for people at a terminal."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
        context = " ".join(f"{key}={value}" for key, value in _context(record).items())
        line = f"{stamp} {record.levelname:<7} {self.role}[{record.process}] {record.getMessage()}"
        if context:
            line += f"  {context}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


QUEUE_SIZE = 10_000
"""Lines waiting for stderr at most; beyond, lines are dropped (and counted) rather than block."""
_FLUSH_TIMEOUT_S = 5.0
# While lines come, the writer wakes this often and writes every line queued meanwhile in one
# write: a line costs its formatting and an append, not a thread wake-up and a write of its own (at
# INFO, one per gRPC call). With none queued it sleeps until `emit` wakes it.
_WRITE_INTERVAL_S = 0.02


class _BufferedHandler(logging.Handler):
    """Formats a record where it is logged and queues the line, never blocking; a thread of its
    own writes the queued lines to `stream` in batches, every `_WRITE_INTERVAL_S`, and what is left
    at `close` (bounded by `_FLUSH_TIMEOUT_S`: a stuck stderr does not hang the exit)."""

    def __init__(self, formatter: logging.Formatter, stream: Any) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self._stream = stream
        self._lines: collections.deque[str] = collections.deque()
        self.dropped = 0
        self._closing = threading.Event()
        # Set by `emit` only when the writer sleeps for want of lines (`_idle`), so a busy stream
        # of lines costs no Event.set (a lock and a notify) per line.
        self._wake = threading.Event()
        self._idle = False
        self._writer = threading.Thread(target=self._write_loop, name="log-writer", daemon=True)
        self._writer.start()

    def pending(self) -> int:
        return len(self._lines)

    def emit(self, record: logging.LogRecord) -> None:
        # Called under the handler's lock (Handler.handle), so `dropped` needs no lock of its own.
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        if len(self._lines) >= QUEUE_SIZE:
            self.dropped += 1
            return
        if self.dropped:
            notice = logging.LogRecord(__name__, logging.WARNING, __file__, 0, "log lines dropped", None, None)
            notice.dropped = self.dropped
            self._lines.append(self.format(notice))
            self.dropped = 0
        self._lines.append(line)  # deque.append is atomic: the writer pops from the other end
        if self._idle:  # checked after the append: see `_write_loop`
            self._idle = False
            self._wake.set()

    def _write_loop(self) -> None:
        while not self._closing.wait(_WRITE_INTERVAL_S):
            self._write_pending()
            if not self._lines:
                # Nothing to write: sleep until a line comes. `_idle` is set before the deque is
                # looked at again, and `emit` looks at `_idle` after its append, so a line
                # appended meanwhile is either seen here or wakes us.
                self._idle = True
                if not self._lines:
                    self._wake.wait()
                self._idle = False
                self._wake.clear()
        self._write_pending()

    def _write_pending(self) -> None:
        lines = self._lines
        batch = [lines.popleft() for _ in range(len(lines))]
        if batch:
            with contextlib.suppress(Exception):  # stderr closed: nowhere left to say so
                self._stream.write("\n".join(batch) + "\n")
                self._stream.flush()

    def close(self) -> None:
        self._closing.set()
        self._wake.set()
        self._writer.join(_FLUSH_TIMEOUT_S)  # a stuck stderr: exit without the last lines, not hang
        super().close()


_handler: _BufferedHandler | None = None


def pending() -> int:
    """Lines waiting to be written to stderr (0 before `setup`)."""
    return _handler.pending() if _handler is not None else 0


def _stop_writer() -> None:
    global _handler
    if _handler is not None:
        handler, _handler = _handler, None
        handler.close()


def setup(role: str, level: str = "INFO", fmt: str = "auto") -> None:
    """Send this process's logs to stderr in the chosen format, tagged with its role.

    Lines go through a bounded queue to a writer thread (see the module docstring), flushed at exit.
    """
    global _handler
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    _stop_writer()
    _handler = _BufferedHandler(JsonFormatter(role) if fmt == "json" else TextFormatter(role), sys.stderr)
    atexit.unregister(_stop_writer)
    atexit.register(_stop_writer)
    root = logging.getLogger()
    root.handlers[:] = [_handler]
    root.setLevel(level)
    # Libraries are chatty at INFO; keep their warnings.
    for noisy in ("asyncio", "grpc"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
