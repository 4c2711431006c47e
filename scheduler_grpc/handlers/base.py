"""The handler interface and the registry of handlers.

A handler is the code behind a job's `handler` name: it validates a job's payload when the job is
defined and runs one execution when a worker picks it up. Handlers know nothing of Redis,
PostgreSQL or gRPC; the worker hands them an `ExecutionContext` and turns their result or error
into history.

Contract of `Handler.run`:

- return a JSON-able result (stored with the execution);
- raise `HandlerError` for a failure the engine may retry, `PermanentHandlerError` for one that
  retries cannot fix (the engine dead-letters it at once);
- cancellation (job timeout, CancelExecution, worker shutdown) arrives as `asyncio.CancelledError`:
  release what the run holds (kill processes, close responses) and re-raise it, never swallow it.

Plugins are Handler subclasses published under the entry point group `scheduler_grpc.handlers`.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from ipaddress import IPv4Network, IPv6Network
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeAlias

from scheduler_grpc import outputs
from scheduler_grpc.errors import InvalidArgument, SchedulerError

if TYPE_CHECKING:
    from scheduler_grpc.config import Settings

JSONValue: TypeAlias = "bool | int | float | str | list[JSONValue] | dict[str, JSONValue] | None"

ENTRY_POINT_GROUP = "scheduler_grpc.handlers"
MAX_PAYLOAD_BYTES = outputs.MAX_STORED_BYTES
_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$")

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Settings, context, errors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HandlerSettings:
    """The part of the process settings that handlers read.

    Attributes:
        shell_enabled: allow `shell.command` (SCHEDULER_SHELL_ENABLED).
        webhook_allowlist: networks `http.webhook` may reach although they are not globally
            routable (SCHEDULER_WEBHOOK_ALLOWLIST).
        dev_mode: SCHEDULER_ENV=dev; enables `test.crash`.
    """

    shell_enabled: bool = False
    webhook_allowlist: tuple[IPv4Network | IPv6Network, ...] = ()
    dev_mode: bool = True

    @classmethod
    def from_settings(cls, settings: Settings) -> HandlerSettings:
        """Take the handler settings out of the process settings."""
        return cls(
            shell_enabled=settings.shell_enabled,
            webhook_allowlist=tuple(settings.webhook_allowlist),
            dev_mode=settings.env == "dev",
        )


class Maintenance(Protocol):
    """Housekeeping operations the worker offers to `system.cleanup`.

    Each call deletes what is older than `older_than` and returns how many items it removed.
    """

    async def prune_executions(self, older_than: datetime) -> int:
        """Drop the whole days of execution history that end by `older_than`, except days holding an
        open run; returns the executions they held."""
        ...

    async def trim_events(self, older_than: datetime) -> int:
        """Trim execution events older than `older_than` from the event stream."""
        ...

    async def trim_dead_letters(self, older_than: datetime) -> int:
        """Purge dead letters parked before `older_than`."""
        ...


@dataclass(frozen=True)
class ExecutionContext:
    """What a handler knows about the execution it runs.

    Attributes:
        execution_id: id of this attempt's execution row. A handler is started at most once per
            execution id; each retry, and each re-run after a lost worker or an interrupted one,
            is a new attempt with a new id. `(job_id, scheduled_for)` names the run across its
            attempts: a handler with side effects dedupes on that.
        job_id: id of the job.
        job_name: unique name of the job.
        attempt: 1 for the first attempt, 2 for the first retry, ...
        scheduled_for: the schedule slot this execution belongs to.
        timeout: the job's timeout; the engine cancels `run` when it elapses.
        settings: handler settings of this process.
        maintenance: housekeeping operations, or None where the worker offers none.
        log: logger carrying the execution's context (job_id, execution_id, ...).
        upstream_results: in a flow run (job dependencies), the result of each upstream job's run
            of the same flow run, by job name (None for one that did not succeed); empty
            otherwise. (A payload can also take them by `{"$from": "<job>.result.<path>"}`.)
        run_id: id of the run (its first attempt's execution id; "" where not known).
        claim_token: the attempt's fencing token: writes about this attempt apply only under it (a
            remote worker's session hands it to its worker; "" where not known).
    """

    execution_id: str
    job_id: str
    job_name: str
    attempt: int
    scheduled_for: datetime
    timeout: timedelta
    settings: HandlerSettings
    maintenance: Maintenance | None
    log: logging.Logger | logging.LoggerAdapter[Any]
    upstream_results: Mapping[str, Any] = field(default_factory=dict)
    run_id: str = ""
    claim_token: str = ""


class HandlerError(SchedulerError):
    """An execution failed; the engine may retry it.

    Attributes:
        message: what went wrong, for the execution's `error`.
        details: optional JSON-able detail (e.g. output tails) to store with the failure.
    """

    retryable: ClassVar[bool] = True

    def __init__(self, message: str, *, details: JSONValue = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class PermanentHandlerError(HandlerError):
    """An execution failed in a way retries cannot fix (e.g. the handler is disabled)."""

    retryable: ClassVar[bool] = False


MAX_RATE_LIMIT_WAIT = timedelta(hours=1)
"""The longest wait a `RateLimited` asks for is bounded to this."""


class RateLimited(HandlerError):
    """The upstream said "too many requests, retry after T" (back-pressure, not a failure).

    The worker hands the run back without spending an attempt: the attempt goes back to `queued`
    and the run's limit keys are paused until `retry_after` has passed (so the other runs of those
    keys wait too, while runs of other keys go on); a run without limit keys waits that long by
    itself. A worker that does not know this type takes it as the `HandlerError` it also is.

    Attributes:
        retry_after: How long to wait, bounded to 0..`MAX_RATE_LIMIT_WAIT`.
        reason: What the upstream said, for the logs.
    """

    def __init__(self, retry_after: timedelta, reason: str = "rate limited by the upstream") -> None:
        super().__init__(f"{reason}; retry after {retry_after.total_seconds():g}s")
        self.retry_after = min(max(retry_after, timedelta(0)), MAX_RATE_LIMIT_WAIT)
        self.reason = reason


# --------------------------------------------------------------------------------------------
# Payload description and validation helpers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One payload field, as described to API clients by ListHandlers.

    Attributes:
        name: key in the payload object.
        type: `string`, `integer`, `number`, `boolean`, `any`, `array<string>`, `array<integer>`,
            `object<string,string>`.
        description: what the field means, its bounds and its default.
        required: the payload must contain it.
        default: value used when it is absent (None: no default).
    """

    name: str
    type: str
    description: str
    required: bool = False
    default: JSONValue = None

    def to_json(self) -> dict[str, JSONValue]:
        """The field as a JSON object."""
        return {
            "name": self.name,
            "type": self.type,
            "required": self.required,
            "default": self.default,
            "description": self.description,
        }


def payload_error(name: str, message: str) -> InvalidArgument:
    """An InvalidArgument for payload field `name` (which may be a path such as `argv[2]`)."""
    return InvalidArgument(f"payload.{name}", message)


def check_payload_size(payload: Mapping[str, Any]) -> None:
    """Require a JSON object of at most 64 KiB as PostgreSQL stores it (`octet_length(payload::text)`,
    the column's CHECK: jsonb's text form, with ": " and ", ", not compact JSON).

    Raises:
        InvalidArgument: field `payload`, or the path of a value PostgreSQL cannot store in it.
    """
    if not isinstance(payload, Mapping):
        raise InvalidArgument("payload", f"must be a JSON object, got {type(payload).__name__}")
    try:
        size = outputs.stored_size(dict(payload))
    except outputs.Unstorable as exc:
        field = "payload" + outputs.locate_unstorable(dict(payload))
        raise InvalidArgument(field, f"must be JSON (object keys strings, values JSON): {exc}") from None
    if size > MAX_PAYLOAD_BYTES:
        raise InvalidArgument(
            "payload", f"is {size:,} bytes as stored; at most {MAX_PAYLOAD_BYTES:,} bytes are allowed"
        )


def get_str(
    payload: Mapping[str, Any],
    name: str,
    *,
    default: str | None = None,
    max_length: int = 4096,
    allow_empty: bool = False,
) -> str | None:
    """A string field (or `default` when absent), at most `max_length` characters."""
    if name not in payload:
        return default
    value = payload[name]
    if not isinstance(value, str):
        raise payload_error(name, f"must be a string, got {_json_type(value)}")
    if not value and not allow_empty:
        raise payload_error(name, "must not be empty")
    if len(value) > max_length:
        raise payload_error(name, f"is {len(value)} characters; at most {max_length} are allowed")
    return value


def require_str(payload: Mapping[str, Any], name: str, *, max_length: int = 4096) -> str:
    """A required, non-empty string field."""
    value = get_str(payload, name, max_length=max_length)
    if value is None:
        raise payload_error(name, "is required")
    return value


def get_int(payload: Mapping[str, Any], name: str, *, default: int, minimum: int, maximum: int) -> int:
    """An integer field in [minimum, maximum] (or `default` when absent). Booleans are refused."""
    if name not in payload:
        return default
    value = payload[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise payload_error(name, f"must be an integer, got {_json_type(value)}")
    if not minimum <= value <= maximum:
        raise payload_error(name, f"must be between {minimum} and {maximum}, got {value}")
    return value


def get_number(
    payload: Mapping[str, Any],
    name: str,
    *,
    default: float | None,
    minimum: float,
    maximum: float,
    exclusive_minimum: bool = False,
) -> float | None:
    """A number field in [minimum, maximum] (or `default` when absent). Booleans are refused."""
    if name not in payload:
        return default
    value = payload[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise payload_error(name, f"must be a number, got {_json_type(value)}")
    number = float(value)
    low_ok = number > minimum if exclusive_minimum else number >= minimum
    if not (low_ok and number <= maximum):
        low = f"greater than {minimum:g}" if exclusive_minimum else f"at least {minimum:g}"
        raise payload_error(name, f"must be {low} and at most {maximum:g}, got {value}")
    return number


def get_str_map(
    payload: Mapping[str, Any],
    name: str,
    *,
    max_items: int,
    max_key_length: int,
    max_value_length: int,
) -> dict[str, str]:
    """An object of string values (empty when absent)."""
    if name not in payload:
        return {}
    value = payload[name]
    if not isinstance(value, Mapping):
        raise payload_error(name, f"must be an object of strings, got {_json_type(value)}")
    if len(value) > max_items:
        raise payload_error(name, f"has {len(value)} entries; at most {max_items} are allowed")
    result: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key or len(key) > max_key_length:
            raise payload_error(name, f"keys must be 1-{max_key_length} character strings, got {key!r:.80}")
        if not isinstance(item, str):
            raise payload_error(f"{name}.{key}", f"must be a string, got {_json_type(item)}")
        if len(item) > max_value_length:
            raise payload_error(f"{name}.{key}", f"is {len(item)} characters; at most {max_value_length} allowed")
        result[key] = item
    return result


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


# --------------------------------------------------------------------------------------------
# Handler
# --------------------------------------------------------------------------------------------


class Handler(ABC):
    """Base of every handler; subclasses are stateless apart from pools they close in `aclose`.

    Class attributes:
        name: the handler name jobs refer to (`http.webhook`); lowercase dotted words.
        description: one line for ListHandlers.
        admin_only: only admins may create or update jobs using it.
        fields: the payload fields it accepts (see `Field`).
        extra_fields: accept fields not listed in `fields` (only `test.echo` does).
    """

    name: ClassVar[str]
    description: ClassVar[str]
    admin_only: ClassVar[bool] = False
    fields: ClassVar[tuple[Field, ...]] = ()
    extra_fields: ClassVar[bool] = False

    def schema(self) -> dict[str, JSONValue]:
        """A JSON-able description of the handler and its payload fields, for ListHandlers."""
        return {
            "name": self.name,
            "description": self.description,
            "admin_only": self.admin_only,
            "additional_fields": self.extra_fields,
            "fields": [f.to_json() for f in self.fields],
        }

    def disabled_reason(self, settings: HandlerSettings) -> str | None:
        """Why the handler may not run under `settings`, or None when it may."""
        return None

    def validate(self, payload: Mapping[str, Any], settings: HandlerSettings) -> dict[str, Any]:
        """Check a payload and return it normalised (defaults filled in).

        Checks that the handler is enabled, the payload's size, unknown and required fields,
        then calls `normalize` for the handler's own checks.

        Raises:
            InvalidArgument: field `handler` when the handler is disabled, `payload` when the
                payload is not a JSON object of at most 64 KiB, `payload.<field>` otherwise.
        """
        reason = self.disabled_reason(settings)
        if reason is not None:
            raise InvalidArgument("handler", reason)
        check_payload_size(payload)
        known = {f.name for f in self.fields}
        if not self.extra_fields:
            unknown = sorted(key for key in payload if key not in known)
            if unknown:
                accepted = ", ".join(sorted(known)) or "no fields"
                raise payload_error(unknown[0], f"unknown field; {self.name} accepts: {accepted}")
        for f in self.fields:
            if f.required and f.name not in payload:
                raise payload_error(f.name, f"is required: {f.description}")
        return self.normalize(payload, settings)

    def normalize(self, payload: Mapping[str, Any], settings: HandlerSettings) -> dict[str, Any]:
        """Handler-specific checks of a payload whose fields are known; returns it normalised.

        Override this rather than `validate`. Raise `InvalidArgument("payload.<field>", ...)`
        (`payload_error`) naming the field and what is expected.
        """
        return dict(payload)

    def breaker_key(self, payload: Mapping[str, Any]) -> str:
        """The circuit breaker this payload's executions count against (default: the handler's)."""
        return self.name

    @abstractmethod
    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        """Run one execution with a payload `validate` returned.

        Returns:
            A JSON-able result.

        Raises:
            HandlerError: a failure the engine may retry.
            PermanentHandlerError: a failure retries cannot fix.
            asyncio.CancelledError: re-raised after cleanup when the run is cancelled.
        """

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release pools and connections; the handler is not used afterwards."""


# --------------------------------------------------------------------------------------------
# Registry and plugins
# --------------------------------------------------------------------------------------------


class EntryPointLike(Protocol):
    """What the plugin loader needs of an `importlib.metadata.EntryPoint`."""

    @property
    def name(self) -> str: ...

    def load(self) -> Any: ...


def check_handler_name(name: object) -> None:
    """Require a handler name by the naming rule (a built-in's, a plugin's, a remote worker's).

    Raises:
        TypeError: saying the rule.
    """
    if not isinstance(name, str) or len(name) > 64 or not _NAME.match(name):
        raise TypeError(f"handler name {name!r:.80} must be 1-64 lowercase dotted words such as 'acme.sync'")


def check_handler(handler: Handler) -> None:
    """Require a well-formed handler identity.

    Raises:
        TypeError: naming what is wrong.
    """
    name = getattr(handler, "name", None)
    check_handler_name(name)
    if not isinstance(getattr(handler, "description", None), str):
        raise TypeError(f"handler {name!r} needs a `description` string")
    if not all(isinstance(f, Field) for f in handler.fields):
        raise TypeError(f"handler {name!r}: `fields` must be a tuple of Field")


def load_plugins(
    entry_points: Iterable[EntryPointLike] | None = None,
    *,
    taken: Iterable[str] = (),
    log: logging.Logger | logging.LoggerAdapter[Any] = logger,
) -> list[Handler]:
    """Instantiate the Handler subclasses published under the `scheduler_grpc.handlers` group.

    A plugin that fails to import, is not a concrete Handler subclass, cannot be instantiated,
    has a malformed name or one already taken is logged and skipped; loading never raises.

    Args:
        entry_points: the entry points to load (default: the installed ones of the group).
        taken: names already registered (built-ins win over plugins).
        log: where to report skipped plugins.
    """
    if entry_points is None:
        try:
            entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        except Exception:
            log.exception("cannot list handler plugins; none loaded")
            return []
    handlers: list[Handler] = []
    names = set(taken)
    for entry_point in entry_points:
        label = getattr(entry_point, "name", "?")
        try:
            loaded = entry_point.load()
            if not (isinstance(loaded, type) and issubclass(loaded, Handler)):
                raise TypeError(f"entry point does not name a Handler subclass but {loaded!r:.100}")  # noqa: TRY301
            if inspect.isabstract(loaded):
                raise TypeError(f"{loaded.__qualname__} is abstract (implement run)")  # noqa: TRY301
            handler = loaded()
            check_handler(handler)
            if handler.name in names:
                raise ValueError(f"handler name {handler.name!r} is taken already")  # noqa: TRY301
        except (Exception, SystemExit) as exc:
            log.error(  # noqa: TRY400 - one line per broken plugin; the cause is in exc_info
                "handler plugin %r skipped: %s",
                label,
                exc,
                exc_info=exc,
                extra={"plugin": label, "group": ENTRY_POINT_GROUP},
            )
            continue
        handlers.append(handler)
        names.add(handler.name)
        log.info("handler plugin %r loaded as %s", label, handler.name, extra={"plugin": label})
    return handlers


class HandlerRegistry:
    """The handlers one process knows, by name.

    Args:
        settings: the settings payloads are validated under.
        handlers: handlers to register (names must be unique).
    """

    def __init__(self, settings: HandlerSettings | None = None, handlers: Iterable[Handler] = ()) -> None:
        self.settings = settings or HandlerSettings()
        self._handlers: dict[str, Handler] = {}
        for handler in handlers:
            self.register(handler)

    def register(self, handler: Handler) -> None:
        """Add a handler.

        Raises:
            ValueError: a handler of that name is registered already.
            TypeError: the handler's name or description is malformed.
        """
        check_handler(handler)
        if handler.name in self._handlers:
            raise ValueError(f"a handler named {handler.name!r} is registered already")
        self._handlers[handler.name] = handler

    def get(self, name: str) -> Handler:
        """The handler called `name`.

        Raises:
            InvalidArgument: field `handler`, listing the known names.
        """
        handler = self._handlers.get(name)
        if handler is None:
            raise InvalidArgument("handler", f"unknown handler {name!r}; known: {', '.join(self.names())}")
        return handler

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._handlers)

    def __iter__(self) -> Iterator[Handler]:
        return iter([self._handlers[name] for name in self.names()])

    def __len__(self) -> int:
        return len(self._handlers)

    def __contains__(self, name: object) -> bool:
        return name in self._handlers

    def validate(self, handler_name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Validate `payload` for the named handler; returns the normalised payload.

        Raises:
            InvalidArgument: naming `handler`, `payload` or `payload.<field>`.
        """
        return self.get(handler_name).validate(payload, self.settings)

    def validate_remote(self, handler_name: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Validate `payload` for a handler this registry does not know, a remote worker's: its name
        by the naming rule, the payload only as a JSON object of at most 64 KiB.

        Raises:
            InvalidArgument: naming `handler` or `payload`.
        """
        try:
            check_handler_name(handler_name)
        except TypeError as exc:
            raise InvalidArgument(
                "handler",
                f"unknown handler {handler_name!r:.80}; known: {', '.join(self.names())}; a remote "
                f"worker's must follow the naming rule: {exc}",
            ) from None
        check_payload_size(payload)
        return dict(payload)

    def describe(self) -> list[dict[str, JSONValue]]:
        """Every handler's schema plus whether it is enabled here, sorted by name."""
        described = []
        for handler in self:
            entry = handler.schema()
            reason = handler.disabled_reason(self.settings)
            entry["enabled"] = reason is None
            entry["disabled_reason"] = reason
            described.append(entry)
        return described

    async def aclose(self) -> None:
        """Close every handler; an error closing one is logged and the others still close."""
        for handler in self:
            try:
                await handler.aclose()
            except Exception:
                logger.exception("closing handler %r failed", handler.name)
