"""`http.webhook`: one HTTP request per execution, with an SSRF guard and no redirects."""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from ipaddress import IPv6Address
from typing import Any, ClassVar

import aiohttp
import orjson
from yarl import URL

from scheduler_grpc import tracing
from scheduler_grpc.handlers.base import (
    MAX_RATE_LIMIT_WAIT,
    ExecutionContext,
    Field,
    Handler,
    HandlerError,
    HandlerSettings,
    JSONValue,
    PermanentHandlerError,
    RateLimited,
    get_number,
    get_str,
    get_str_map,
    payload_error,
    require_str,
)
from scheduler_grpc.handlers.ssrf import GetAddrInfo, Network, TargetRefused, VettingResolver, parse_literal_host, vet

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
MAX_URL_LENGTH = 2048
MAX_TIMEOUT_SECONDS = 300.0
DEFAULT_TIMEOUT_SECONDS = 30.0
PREVIEW_BYTES = 1024
MAX_HEADERS = 64
USER_AGENT = "scheduler-grpc-webhook/1"

_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_BAD_VALUE_CHARS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# Set by the handler or by the HTTP layer; a job may not override them.
_RESERVED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "proxy-connection",
        "idempotency-key",
        "x-scheduler-execution-id",
        "x-scheduler-attempt",
    }
)


class WebhookHandler(Handler):
    """Sends one HTTP request and succeeds on an expected status.

    One pooled `aiohttp.ClientSession` per handler instance (per allow-list), created lazily in
    the running loop; its connector resolves through `VettingResolver`. Redirects are not
    followed, proxies from the environment are ignored and cookies are not kept between jobs.

    Args:
        getaddrinfo: DNS lookup override for tests (default: the loop's resolver).
    """

    name: ClassVar[str] = "http.webhook"
    description: ClassVar[str] = (
        "HTTP request to a globally routable (or allow-listed) URL; fails on an unexpected status"
    )
    fields: ClassVar[tuple[Field, ...]] = (
        Field("url", "string", f"http:// or https:// URL, at most {MAX_URL_LENGTH} characters", required=True),
        Field("method", "string", f"one of {', '.join(METHODS)}", default="POST"),
        Field(
            "headers",
            "object<string,string>",
            f"extra request headers (at most {MAX_HEADERS}); Host, Content-Length, hop-by-hop and "
            "Idempotency-Key/X-Scheduler-* headers are set by the scheduler",
            default={},
        ),
        Field(
            "body",
            "any",
            "request body: a string is sent as is (text/plain unless Content-Type is set), any other "
            "JSON value as JSON; absent or null sends no body",
        ),
        Field(
            "timeout_seconds",
            "number",
            f"time allowed for the whole request, greater than 0 and at most {MAX_TIMEOUT_SECONDS:g}",
            default=DEFAULT_TIMEOUT_SECONDS,
        ),
        Field(
            "expected_statuses",
            "array<integer>",
            "HTTP statuses that count as success (default: 200-299); redirects are never followed",
        ),
    )

    def __init__(self, *, getaddrinfo: GetAddrInfo | None = None) -> None:
        self._getaddrinfo = getaddrinfo
        self._sessions: dict[tuple[Network, ...], aiohttp.ClientSession] = {}

    # -- validation ---------------------------------------------------------------------------

    def normalize(self, payload: Mapping[str, Any], settings: HandlerSettings) -> dict[str, Any]:
        url = _check_url(require_str(payload, "url", max_length=MAX_URL_LENGTH), settings)
        method = (get_str(payload, "method", default="POST") or "POST").upper()
        if method not in METHODS:
            raise payload_error("method", f"must be one of {', '.join(METHODS)}, got {payload['method']!r}")
        headers = get_str_map(payload, "headers", max_items=MAX_HEADERS, max_key_length=256, max_value_length=8192)
        seen: set[str] = set()
        for key, value in headers.items():
            lowered = key.lower()
            if not _TOKEN.match(key):
                raise payload_error("headers", f"{key!r} is not a valid header name")
            if lowered in _RESERVED_HEADERS:
                raise payload_error(f"headers.{key}", "is set by the scheduler and may not be given")
            if lowered in seen:
                raise payload_error(f"headers.{key}", "is given twice (header names are case-insensitive)")
            if _BAD_VALUE_CHARS.search(value):
                raise payload_error(f"headers.{key}", "must not contain control characters or line breaks")
            seen.add(lowered)
        timeout = get_number(
            payload,
            "timeout_seconds",
            default=DEFAULT_TIMEOUT_SECONDS,
            minimum=0,
            maximum=MAX_TIMEOUT_SECONDS,
            exclusive_minimum=True,
        )
        result: dict[str, Any] = {"method": method, "url": url, "headers": headers, "timeout_seconds": timeout}
        if payload.get("body") is not None:
            result["body"] = payload["body"]
        if "expected_statuses" in payload:
            result["expected_statuses"] = _check_statuses(payload["expected_statuses"])
        return result

    def breaker_key(self, payload: Mapping[str, Any]) -> str:
        """`http.webhook:<host>`: one breaker per target host (see `webhook_breaker_key`)."""
        return webhook_breaker_key(payload)

    # -- execution ----------------------------------------------------------------------------

    def _session(self, allowlist: tuple[Network, ...]) -> aiohttp.ClientSession:
        session = self._sessions.get(allowlist)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(
                resolver=VettingResolver(allowlist, getaddrinfo=self._getaddrinfo),
                limit=100,
                limit_per_host=20,
            )
            session = aiohttp.ClientSession(
                connector=connector,
                trust_env=False,  # an environment proxy would bypass the SSRF guard
                cookie_jar=aiohttp.DummyCookieJar(),  # no state shared between jobs
                headers={"User-Agent": USER_AGENT},
            )
            self._sessions[allowlist] = session
        return session

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        allowlist = tuple(ctx.settings.webhook_allowlist)
        url = URL(payload["url"])
        host = url.raw_host or ""
        literal = parse_literal_host(host)
        if literal is not None:
            # aiohttp connects to literal hosts without asking the resolver: vet them here and
            # connect to the canonical spelling of the address that was vetted.
            try:
                vet(host, literal, allowlist)
            except TargetRefused as exc:
                raise PermanentHandlerError(str(exc)) from None
            if isinstance(literal, IPv6Address) and literal.ipv4_mapped is not None:
                literal = literal.ipv4_mapped  # the same endpoint; works without IPv6 sockets too
            url = url.with_host(str(literal))
        timeout = float(payload.get("timeout_seconds", DEFAULT_TIMEOUT_SECONDS))
        expected = payload.get("expected_statuses")
        headers = dict(payload.get("headers", {}))
        headers["Idempotency-Key"] = ctx.execution_id
        headers["X-Scheduler-Execution-Id"] = ctx.execution_id
        headers["X-Scheduler-Attempt"] = str(ctx.attempt)
        if tracing.enabled:  # the attempt's handler span: the target's spans join the run's trace
            tracing.inject(headers)
        data: bytes | None = None
        body = payload.get("body")
        if body is not None:
            has_type = any(key.lower() == "content-type" for key in headers)
            if isinstance(body, str):
                data = body.encode()
                if not has_type:
                    headers["Content-Type"] = "text/plain; charset=utf-8"
            else:
                data = orjson.dumps(body)
                if not has_type:
                    headers["Content-Type"] = "application/json"

        session = self._session(allowlist)
        started = time.perf_counter()
        try:
            async with session.request(
                payload.get("method", "POST"),
                url,
                headers=headers,
                data=data,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                preview = await _read_prefix(response.content, PREVIEW_BYTES)
                status = response.status
                location = response.headers.get("Location")
                retry_after = response.headers.get("Retry-After")
        except TargetRefused as exc:
            raise PermanentHandlerError(str(exc)) from None
        except aiohttp.ClientConnectorDNSError as exc:
            if isinstance(exc.os_error, TargetRefused):
                raise PermanentHandlerError(str(exc.os_error)) from None
            raise HandlerError(f"cannot resolve {host}: {exc.os_error}") from None
        except TimeoutError:
            raise HandlerError(f"no complete response from {host} within {timeout:g}s") from None
        except aiohttp.ClientError as exc:
            raise HandlerError(f"request to {host} failed: {exc or type(exc).__name__}") from None
        result: dict[str, JSONValue] = {
            "status": status,
            "elapsed_ms": round((time.perf_counter() - started) * 1000, 1),
            "body_preview": preview.decode("utf-8", errors="replace"),
        }
        if not _expected(status, expected):
            wait = retry_after_of(retry_after) if status in (429, 503) else None
            if wait is not None:  # back-pressure: the run is handed back, its keys paused
                raise RateLimited(wait, f"HTTP {status} from {host} with Retry-After: {retry_after}")
            wanted = "200-299" if expected is None else ", ".join(map(str, expected))
            hint = f" (redirect to {location!r} not followed)" if 300 <= status < 400 and location else ""
            raise HandlerError(f"HTTP {status} from {host}{hint}; expected {wanted}", details=result)
        return result

    async def aclose(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()


def retry_after_of(value: str | None, now: datetime | None = None) -> timedelta | None:
    """The wait a `Retry-After` header asks for (RFC 9110: delay seconds, or an HTTP date), at
    least 0 (a date in the past) and at most `MAX_RATE_LIMIT_WAIT`; None when absent or unreadable."""
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        wait = timedelta(seconds=min(int(text[:12]), int(MAX_RATE_LIMIT_WAIT.total_seconds())))
    else:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # "-0000": UTC, as HTTP dates are
            when = when.replace(tzinfo=UTC)
        wait = when - (now or datetime.now(UTC))
    return min(max(wait, timedelta(0)), MAX_RATE_LIMIT_WAIT)


def _check_url(text: str, settings: HandlerSettings) -> str:
    try:
        url = URL(text)
    except ValueError as exc:
        raise payload_error("url", f"is not a valid URL: {exc}") from None
    if url.scheme not in ("http", "https"):
        raise payload_error("url", f"must use http or https, got {url.scheme or 'no scheme'!r}")
    host = url.raw_host
    if not host:
        raise payload_error("url", "must name a host, e.g. https://example.com/hook")
    if url.user is not None or url.password is not None:
        raise payload_error("url", "must not carry credentials; send them in `headers` instead")
    if url.explicit_port == 0:
        raise payload_error("url", "port 0 cannot be connected to")
    try:
        literal = parse_literal_host(host)
    except ValueError:
        raise payload_error("url", f"host {host!r} is not a valid IPv6 address") from None
    if literal is not None:
        try:
            vet(host, literal, settings.webhook_allowlist)
        except TargetRefused as exc:
            raise payload_error("url", str(exc)) from None
    return text


def _check_statuses(value: Any) -> list[int]:
    if not isinstance(value, list) or not value:
        raise payload_error("expected_statuses", "must be a non-empty array of HTTP status codes")
    if len(value) > 500:
        raise payload_error("expected_statuses", "may list at most 500 statuses")
    statuses: set[int] = set()
    for index, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or not 100 <= item <= 599:
            raise payload_error(f"expected_statuses[{index}]", f"must be an HTTP status 100-599, got {item!r}")
        statuses.add(item)
    return sorted(statuses)


def _expected(status: int, expected: list[int] | None) -> bool:
    return 200 <= status <= 299 if expected is None else status in expected


async def _read_prefix(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """Up to `limit` bytes of the body; the rest is never read (the connection is then dropped)."""
    buffer = bytearray()
    while len(buffer) < limit:
        chunk = await stream.read(limit - len(buffer))
        if not chunk:
            break
        buffer += chunk
    return bytes(buffer)


def webhook_breaker_key(payload: Mapping[str, Any]) -> str:
    """`http.webhook:<host>` for a payload's target host (`http.webhook` without a usable URL).

    A pure function of the payload, so the queue item can carry it from enqueue time and a worker
    can leave an open host's work in the queue without claiming it.
    """
    name = WebhookHandler.name
    try:
        host = URL(str(payload["url"])).raw_host
    except (KeyError, ValueError, TypeError):
        return name
    if not host:
        return name
    try:
        literal = parse_literal_host(host)
    except ValueError:
        literal = None
    return f"{name}:{literal if literal is not None else host.lower()}"
