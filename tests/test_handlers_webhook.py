"""http.webhook against a local aiohttp server, and the SSRF guard.

Only 127.0.0.1 is ever connected to: a safety net around aiohttp's connect step fails the test if
anything else is attempted. Other addresses appear only in resolve/vet tests.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from typing import Any

import aiohappyeyeballs
import pytest
from aiohttp import web

from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.handlers import (
    ExecutionContext,
    HandlerError,
    HandlerSettings,
    PermanentHandlerError,
    WebhookHandler,
)
from scheduler_grpc.handlers.ssrf import (
    AddrInfo,
    TargetRefused,
    VettingResolver,
    parse_literal_host,
    refusal_reason,
)

LOOPBACK_ONLY = (ip_network("127.0.0.1/32"),)
ALLOWED = HandlerSettings(webhook_allowlist=LOOPBACK_ONLY)
STRICT = HandlerSettings()


def make_ctx(settings: HandlerSettings, *, execution_id: str = "exec-42", attempt: int = 3) -> ExecutionContext:
    return ExecutionContext(
        execution_id=execution_id,
        job_id="job-1",
        job_name="nightly",
        attempt=attempt,
        scheduled_for=datetime(2025, 1, 1, tzinfo=UTC),
        timeout=timedelta(seconds=30),
        settings=settings,
        maintenance=None,
        log=logging.getLogger("test.webhook"),
    )


@pytest.fixture(autouse=True)
def loopback_connections_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any connection attempt to a non-loopback address (the guard's guard)."""
    real = aiohappyeyeballs.start_connection

    async def checked(addr_infos: Any, *args: Any, **kwargs: Any) -> socket.socket:
        for info in addr_infos:
            address = ip_address(info[4][0].split("%")[0])
            if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
                address = address.ipv4_mapped
            assert address.is_loopback, f"test tried to connect to {address}"
        return await real(addr_infos, *args, **kwargs)

    monkeypatch.setattr(aiohappyeyeballs, "start_connection", checked)  # aiohttp calls it through the module


@dataclass
class Target:
    """A local HTTP server recording what it receives."""

    base: str
    port: int
    requests: list[dict[str, Any]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def hits(self, path: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"] == path]


@pytest.fixture
async def target() -> AsyncIterator[Target]:
    state = Target("", 0)

    async def record(request: web.Request) -> None:
        state.requests.append(
            {
                "path": request.path,
                "method": request.method,
                "headers": dict(request.headers),
                "body": await request.read(),
            }
        )

    async def hook(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"ok": True})

    async def status(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(status=int(request.match_info["code"]), text="nope")

    async def redirect(request: web.Request) -> web.Response:
        await record(request)
        raise web.HTTPFound("/landing")

    async def slow(request: web.Request) -> web.Response:
        await record(request)
        await asyncio.wait_for(state.release.wait(), 10)
        return web.Response(text="late")

    async def big(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(body=b"a" * 200_000)

    app = web.Application()
    app.router.add_route("*", "/hook", hook)
    app.router.add_route("*", "/status/{code}", status)
    app.router.add_route("*", "/redirect", redirect)
    app.router.add_route("*", "/landing", hook)
    app.router.add_route("*", "/slow", slow)
    app.router.add_route("*", "/big", big)
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    state.base, state.port = f"http://127.0.0.1:{port}", port
    try:
        yield state
    finally:
        state.release.set()
        await runner.cleanup()


@pytest.fixture
async def webhook() -> AsyncIterator[WebhookHandler]:
    handler = WebhookHandler()
    try:
        yield handler
    finally:
        await handler.aclose()


async def call(handler: WebhookHandler, settings: HandlerSettings, payload: dict[str, Any], **ctx: Any) -> Any:
    return await handler.run(make_ctx(settings, **ctx), handler.validate(payload, settings))


# ----------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------


async def test_success_sends_idempotency_headers(webhook: WebhookHandler, target: Target) -> None:
    result = await call(
        webhook,
        ALLOWED,
        {"url": f"{target.base}/hook", "headers": {"X-Team": "ops"}, "body": {"n": 1}},
        execution_id="exec-7",
        attempt=2,
    )
    assert result["status"] == 200
    assert result["body_preview"] == '{"ok": true}'
    assert result["elapsed_ms"] >= 0
    (request,) = target.hits("/hook")
    assert request["method"] == "POST"
    assert request["headers"]["Idempotency-Key"] == "exec-7"
    assert request["headers"]["X-Scheduler-Execution-Id"] == "exec-7"
    assert request["headers"]["X-Scheduler-Attempt"] == "2"
    assert request["headers"]["X-Team"] == "ops"
    assert request["headers"]["Content-Type"] == "application/json"
    assert request["body"] == b'{"n":1}'


async def test_methods_and_string_body(webhook: WebhookHandler, target: Target) -> None:
    await call(webhook, ALLOWED, {"url": f"{target.base}/hook", "method": "put", "body": "plain"})
    await call(webhook, ALLOWED, {"url": f"{target.base}/hook", "method": "GET"})
    put, get = target.hits("/hook")
    assert (put["method"], put["body"], put["headers"]["Content-Type"]) == (
        "PUT",
        b"plain",
        "text/plain; charset=utf-8",
    )
    assert (get["method"], get["body"]) == ("GET", b"")


async def test_unexpected_status_is_a_handler_error(webhook: WebhookHandler, target: Target) -> None:
    with pytest.raises(HandlerError, match="HTTP 503") as err:
        await call(webhook, ALLOWED, {"url": f"{target.base}/status/503"})
    assert not isinstance(err.value, PermanentHandlerError)
    assert isinstance(err.value.details, dict)
    assert err.value.details["status"] == 503
    # ... and an expected non-2xx status is a success
    result = await call(webhook, ALLOWED, {"url": f"{target.base}/status/404", "expected_statuses": [404]})
    assert result["status"] == 404
    with pytest.raises(HandlerError, match="HTTP 200"):
        await call(webhook, ALLOWED, {"url": f"{target.base}/hook", "expected_statuses": [201]})


async def test_redirects_are_not_followed(webhook: WebhookHandler, target: Target) -> None:
    with pytest.raises(HandlerError, match=r"HTTP 302.*not followed"):
        await call(webhook, ALLOWED, {"url": f"{target.base}/redirect"})
    assert len(target.hits("/redirect")) == 1
    assert target.hits("/landing") == []
    result = await call(webhook, ALLOWED, {"url": f"{target.base}/redirect", "expected_statuses": [302]})
    assert result["status"] == 302
    assert target.hits("/landing") == []


async def test_body_preview_is_bounded(webhook: WebhookHandler, target: Target) -> None:
    result = await call(webhook, ALLOWED, {"url": f"{target.base}/big"})
    assert result["body_preview"] == "a" * 1024


async def test_timeout_is_honoured(webhook: WebhookHandler, target: Target) -> None:
    started = time.monotonic()
    with pytest.raises(HandlerError, match=r"within 0\.3s"):
        await call(webhook, ALLOWED, {"url": f"{target.base}/slow", "timeout_seconds": 0.3})
    assert time.monotonic() - started < 2


async def test_cancellation_propagates(webhook: WebhookHandler, target: Target, deadline: Any) -> None:
    task = asyncio.ensure_future(call(webhook, ALLOWED, {"url": f"{target.base}/slow"}))
    until = deadline(5)
    while not target.hits("/slow"):
        assert time.monotonic() < until, "request never arrived"
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_one_pooled_session_is_reused(webhook: WebhookHandler, target: Target) -> None:
    for _ in range(3):
        await call(webhook, ALLOWED, {"url": f"{target.base}/hook"})
    assert len(webhook._sessions) == 1
    await webhook.aclose()
    assert webhook._sessions == {}


async def test_connection_refused_is_retryable(webhook: WebhookHandler) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(HandlerError, match="failed") as err:
        await call(webhook, ALLOWED, {"url": f"http://127.0.0.1:{port}/"})
    assert not isinstance(err.value, PermanentHandlerError)


# ----------------------------------------------------------------------------------------------
# SSRF guard
# ----------------------------------------------------------------------------------------------

LITERAL_FORBIDDEN = [
    "127.0.0.1",
    "0177.0.0.1",
    "2130706433",
    "0x7f.1",
    "127.1",
    "[::1]",
    "[::ffff:127.0.0.1]",
    "169.254.169.254",
    "100.64.0.1",
    "10.0.0.1",
    "192.168.1.1",
    "0.0.0.0",
    "[fe80::1]",
    "[::]",
    "[::ffff:10.0.0.1]",
    "[2002:7f00:1::]",
    "224.0.0.1",
    "192.0.2.1",
]


@pytest.mark.parametrize("host", LITERAL_FORBIDDEN)
async def test_literal_forbidden_hosts_refused_at_validate_and_run(host: str, webhook: WebhookHandler) -> None:
    url = f"http://{host}:8080/hook"
    with pytest.raises(InvalidArgument) as err:
        webhook.validate({"url": url}, STRICT)
    assert err.value.field == "payload.url"
    assert "refusing" in err.value.message
    # run() checks again (a payload validated under other settings, or stored before a change)
    with pytest.raises(PermanentHandlerError, match="refusing to connect"):
        await webhook.run(make_ctx(STRICT), {"url": url, "method": "GET"})


async def test_localhost_name_refused_via_resolver(webhook: WebhookHandler, target: Target) -> None:
    payload = webhook.validate({"url": f"http://localhost:{target.port}/hook"}, STRICT)  # a name: no DNS yet
    with pytest.raises(PermanentHandlerError, match=r"localhost \(127\.0\.0\.1\).*loopback"):
        await webhook.run(make_ctx(STRICT), payload)
    assert target.requests == []


async def test_allow_listed_loopback_works_in_any_spelling(webhook: WebhookHandler, target: Target) -> None:
    for host in ("127.0.0.1", "127.1", "0x7f.1", "2130706433", "[::ffff:127.0.0.1]"):
        result = await call(webhook, ALLOWED, {"url": f"http://{host}:{target.port}/hook"})
        assert result["status"] == 200
    assert len(target.hits("/hook")) == 5


async def test_connects_to_the_vetted_address_keeping_the_host_name(target: Target) -> None:
    lookups: list[str] = []

    async def fake_dns(host: str, port: int, family: int) -> list[AddrInfo]:
        lookups.append(host)
        assert host == "hooks.example.test"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    handler = WebhookHandler(getaddrinfo=fake_dns)
    try:
        result = await call(handler, ALLOWED, {"url": f"http://hooks.example.test:{target.port}/hook"})
        assert result["status"] == 200
        # Not allow-listed: the very same resolution is refused, nothing is sent.
        with pytest.raises(PermanentHandlerError, match=r"hooks\.example\.test \(127\.0\.0\.1\)"):
            await call(handler, STRICT, {"url": f"http://hooks.example.test:{target.port}/hook"})
    finally:
        await handler.aclose()
    (request,) = target.hits("/hook")
    assert request["headers"]["Host"] == f"hooks.example.test:{target.port}"
    assert lookups == ["hooks.example.test", "hooks.example.test"]


@pytest.mark.parametrize(
    "addresses",
    [
        ["93.184.216.34", "10.0.0.1"],  # one bad address refuses the host
        ["2606:2800:220:1::1", "::1"],
        ["169.254.169.254"],
        ["::ffff:192.168.0.1"],
    ],
)
async def test_resolver_refuses_if_any_address_is_bad(addresses: list[str]) -> None:
    async def fake_dns(host: str, port: int, family: int) -> list[AddrInfo]:
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses
        ]

    with pytest.raises(TargetRefused):
        await VettingResolver(getaddrinfo=fake_dns).resolve("rebind.example.test", 443)


async def test_resolver_returns_vetted_addresses_with_host_name() -> None:
    async def fake_dns(host: str, port: int, family: int) -> list[AddrInfo]:
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("2606:2800:220:1::1", port, 0, 0)),
        ]

    results = await VettingResolver(getaddrinfo=fake_dns).resolve("example.test", 443)
    assert [(r["hostname"], r["host"], r["port"]) for r in results] == [
        ("example.test", "93.184.216.34", 443),
        ("example.test", "2606:2800:220:1::1", 443),
    ]


async def test_resolver_vets_real_lookups_of_odd_literals() -> None:
    resolver = VettingResolver()
    for host in ("0x7f.1", "127.1", "localhost"):
        with pytest.raises(TargetRefused, match="loopback"):
            await resolver.resolve(host, 80)
    allowed = VettingResolver(LOOPBACK_ONLY)
    assert [r["host"] for r in await allowed.resolve("0x7f.1", 80)] == ["127.0.0.1"]


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("0177.0.0.1", IPv4Address("127.0.0.1")),
        ("2130706433", IPv4Address("127.0.0.1")),
        ("0x7f.1", IPv4Address("127.0.0.1")),
        ("127.1", IPv4Address("127.0.0.1")),
        ("0x7f000001", IPv4Address("127.0.0.1")),
        ("10.0.0.1.", IPv4Address("10.0.0.1")),
        ("::ffff:7f00:1", IPv6Address("::ffff:127.0.0.1")),
        ("fe80::1%eth0", IPv6Address("fe80::1")),
        ("example.com", None),
        ("1.2.3.4 x", None),
        ("cafe.be", None),
        ("deadbeef", None),
    ],
)
def test_parse_literal_host(host: str, expected: Any) -> None:
    assert parse_literal_host(host) == expected


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("8.8.8.8", None),
        ("93.184.216.34", None),
        ("2606:4700:4700::1111", None),
        ("64:ff9b::5db8:d822", None),  # NAT64 of a public address
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("100.64.0.1", "carrier-grade NAT"),
        ("169.254.169.254", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("239.255.255.250", "multicast"),
        ("255.255.255.255", "reserved"),
        ("198.51.100.7", "documentation"),
        ("198.18.0.1", "benchmarking"),
        ("::", "unspecified"),
        ("::1", "loopback"),
        ("::ffff:10.0.0.1", "private"),
        ("::ffff:169.254.169.254", "link-local"),
        ("::127.0.0.1", "IPv4-compatible"),
        ("2002:a00:1::", "private (embedded IPv4 10.0.0.1)"),
        ("64:ff9b::7f00:1", "loopback (embedded IPv4 127.0.0.1)"),
        ("2001:db8::1", "documentation"),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"),
        ("fd00::1", "unique local"),
        ("fe80::1", "link-local"),
        ("ff02::1", "multicast"),
    ],
)
def test_refusal_reasons(address: str, reason: str | None) -> None:
    found = refusal_reason(ip_address(address))
    if reason is None:
        assert found is None
    else:
        assert found is not None
        assert reason in found


def test_allowlist() -> None:
    allow = (ip_network("10.0.0.0/8"), ip_network("127.0.0.1/32"))
    assert refusal_reason(ip_address("10.9.8.7"), allow) is None
    assert refusal_reason(ip_address("::ffff:127.0.0.1"), allow) is None  # the same endpoint
    assert refusal_reason(ip_address("127.0.0.2"), allow) == "loopback"
    assert refusal_reason(ip_address("::1"), allow) == "loopback"


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({}, "payload.url"),
        ({"url": "ftp://example.com/x"}, "payload.url"),
        ({"url": "https:///nohost"}, "payload.url"),
        ({"url": "https://user:pw@example.com/"}, "payload.url"),
        ({"url": "https://example.com/" + "a" * 2048}, "payload.url"),
        ({"url": "http://[::ffff:0177.0.0.1]/"}, "payload.url"),
        ({"url": 5}, "payload.url"),
        ({"url": "https://example.com/", "method": "FETCH"}, "payload.method"),
        ({"url": "https://example.com/", "headers": {"Host": "evil"}}, "payload.headers.Host"),
        ({"url": "https://example.com/", "headers": {"Idempotency-Key": "x"}}, "payload.headers.Idempotency-Key"),
        ({"url": "https://example.com/", "headers": {"X-A": "a\r\nX-B: b"}}, "payload.headers.X-A"),
        ({"url": "https://example.com/", "headers": {"bad name": "x"}}, "payload.headers"),
        ({"url": "https://example.com/", "headers": {"X-A": 1}}, "payload.headers.X-A"),
        ({"url": "https://example.com/", "headers": {"X-A": "1", "x-a": "2"}}, "payload.headers.x-a"),
        ({"url": "https://example.com/", "timeout_seconds": 0}, "payload.timeout_seconds"),
        ({"url": "https://example.com/", "timeout_seconds": 301}, "payload.timeout_seconds"),
        ({"url": "https://example.com/", "timeout_seconds": True}, "payload.timeout_seconds"),
        ({"url": "https://example.com/", "expected_statuses": []}, "payload.expected_statuses"),
        ({"url": "https://example.com/", "expected_statuses": [200, 99]}, "payload.expected_statuses[1]"),
    ],
)
def test_validation_errors_name_the_field(payload: dict[str, Any], field: str, webhook: WebhookHandler) -> None:
    with pytest.raises(InvalidArgument) as err:
        webhook.validate(payload, STRICT)
    assert err.value.field == field


def test_validate_normalises(webhook: WebhookHandler) -> None:
    assert webhook.validate({"url": "https://example.com/x", "method": "get", "body": None}, STRICT) == {
        "url": "https://example.com/x",
        "method": "GET",
        "headers": {},
        "timeout_seconds": 30.0,
    }
    normalised = webhook.validate({"url": "https://example.com/", "expected_statuses": [204, 200, 204]}, STRICT)
    assert normalised["expected_statuses"] == [200, 204]


@dataclass
class Proxy:
    """A loopback listener standing in for an HTTP proxy: counts connections and closes them."""

    url: str
    connections: int = 0


@pytest.fixture
async def proxy_env(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Proxy]:
    """Every proxy variable points at `Proxy`, and nothing is exempt from it (no NO_PROXY)."""
    proxy = Proxy("")

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        proxy.connections += 1
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    proxy.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, proxy.url)
        monkeypatch.setenv(name.lower(), proxy.url)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    async with server:
        yield proxy


async def test_environment_proxies_are_ignored(proxy_env: Proxy, webhook: WebhookHandler, target: Target) -> None:
    result = await call(webhook, ALLOWED, {"url": f"{target.base}/hook"})
    assert proxy_env.connections == 0
    assert result["status"] == 200
