"""Structured logs: one JSON object per line (orjson), or readable text for a terminal.

Modules log through the standard `logging` module and pass context as `extra={...}`
(job_id, execution_id, worker_id, attempt, term, ...); every extra field lands in the JSON object.
"""

from __future__ import annotations

import contextvars
import logging
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


def setup(role: str, level: str = "INFO", fmt: str = "auto") -> None:
    """Send this process's logs to stderr in the chosen format, tagged with its role."""
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role) if fmt == "json" else TextFormatter(role))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Libraries are chatty at INFO; keep their warnings.
    for noisy in ("asyncio", "grpc"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
