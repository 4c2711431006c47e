"""Structured logs: one JSON object per line (orjson), or readable text for a terminal.

Modules log through the standard `logging` module and pass context as `extra={...}`
(job_id, execution_id, worker_id, attempt, term, ...); every extra field lands in the JSON object.

Writing is off the caller's thread: a record is formatted where it is logged (its arguments may
change later), put on a bounded queue, and written to stderr by a listener thread, so a slow or
full stderr pipe never blocks the event loop. When the queue is full, lines are dropped and counted
(a later line says how many); the queue is flushed at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import copy
import logging
import logging.handlers
import queue
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

# The trace id of the gRPC call being served, set by the interceptors; every log line written while
# serving it carries it, so one call's lines can be found together.
TRACE: contextvars.ContextVar[str | None] = contextvars.ContextVar("scheduler_trace", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra=` and is context.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def _context(record: logging.LogRecord) -> dict[str, Any]:
    return {key: value for key, value in vars(record).items() if key not in _STANDARD and not key.startswith("_")}


_make_record = logging.getLogRecordFactory()


def _record_with_trace(*args: Any, **kwargs: Any) -> logging.LogRecord:
    # Stamp the trace when the record is made (in the call's context), not when it is formatted.
    record = _make_record(*args, **kwargs)
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


class _FormattedQueueHandler(logging.handlers.QueueHandler):
    """Formats in the logging thread with the real formatter, enqueues without ever blocking."""

    def __init__(self, lines: queue.Queue[Any], formatter: logging.Formatter) -> None:
        super().__init__(lines)
        self.setFormatter(formatter)
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        line = self.format(record)
        prepared = copy.copy(record)  # other handlers (pytest's caplog) still see the original
        prepared.msg = prepared.message = line
        prepared.args = prepared.exc_info = prepared.exc_text = prepared.stack_info = None
        return prepared

    def enqueue(self, record: logging.LogRecord) -> None:
        # Called under the handler's lock (Handler.handle), so `dropped` needs no lock of its own.
        try:
            if self.dropped:
                notice = logging.LogRecord(__name__, logging.WARNING, __file__, 0, "log lines dropped", None, None)
                notice.dropped = self.dropped
                self.queue.put_nowait(self.prepare(notice))
                self.dropped = 0
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


class _Listener(logging.handlers.QueueListener):
    """Writes queued lines to stderr on its own thread; `stop` (at exit) writes what is left."""

    def __init__(self, lines: queue.Queue[Any], writer: logging.Handler) -> None:
        super().__init__(lines, writer)
        self.lines = lines

    def enqueue_sentinel(self) -> None:
        # The stdlib's put_nowait would raise on a full queue: wait for room instead, boundedly.
        self.lines.put(None, timeout=_FLUSH_TIMEOUT_S)


_listener: _Listener | None = None


def pending() -> int:
    """Lines waiting to be written to stderr (0 before `setup`)."""
    return _listener.lines.qsize() if _listener is not None else 0


def _stop_listener() -> None:
    global _listener
    if _listener is not None:
        listener, _listener = _listener, None
        with contextlib.suppress(queue.Full):  # stderr is stuck: exit without the last lines, not hang
            listener.stop()


def setup(role: str, level: str = "INFO", fmt: str = "auto") -> None:
    """Send this process's logs to stderr in the chosen format, tagged with its role.

    Lines go through a bounded queue to a writer thread (see the module docstring), flushed at exit.
    """
    global _listener
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    _stop_listener()
    lines: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_SIZE)
    writer = logging.StreamHandler(sys.stderr)  # the lines arrive formatted
    handler = _FormattedQueueHandler(lines, JsonFormatter(role) if fmt == "json" else TextFormatter(role))
    _listener = _Listener(lines, writer)
    _listener.start()
    atexit.unregister(_stop_listener)
    atexit.register(_stop_listener)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Libraries are chatty at INFO; keep their warnings.
    for noisy in ("asyncio", "grpc"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
