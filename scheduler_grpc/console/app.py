"""The console's aiohttp application: routes, the security middleware, start and stop.

The middleware, for every request: refuses a `Host` the console does not answer to (421, DNS
rebinding); reads the body while the connection still counts as waiting (`limits.ConnectionGuard`
bounds that time and the number of connections); refuses a POST from another origin; lets the login
page and static files through; otherwise authenticates the session cookie (a Login session token) with the API's
`Authenticator`, checks the CSRF token of every POST, and checks the role the route's RPC needs in
`auth.METHOD_ROLES`. Errors become pages by the API's own mapping (`statuses.status_of`, as HTTP
statuses: INVALID_ARGUMENT 400, NOT_FOUND 404, ALREADY_EXISTS/FAILED_PRECONDITION/ABORTED 409,
RESOURCE_EXHAUSTED 429, PERMISSION_DENIED 403, UNAVAILABLE 503 saying a store is down). The
security headers are set on every response as it is prepared (`on_response_prepare`), so streams
that send their headers from inside their handler (`/events`) have them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from scheduler_grpc import statuses
from scheduler_grpc.application import Api
from scheduler_grpc.auth import Unauthenticated
from scheduler_grpc.config import Settings
from scheduler_grpc.console import bulk, depth, flash, flows, limits_page, live, search, security, users, views
from scheduler_grpc.console.context import CONSOLE, STATIC, Console, environment, render
from scheduler_grpc.console.limits import ConnectionGuard, connection_limit
from scheduler_grpc.errors import ConfigError

log = logging.getLogger(__name__)

DEV_HOST: Final = "127.0.0.1"
_PUBLIC: Final = ("/login", "/static/", "/healthz", "/favicon.ico")
STORES_DOWN: Final = "Redis or PostgreSQL did not answer; try again when both are up"
MACHINE_NAMES_TIMEOUT: Final = 2.0


async def _error(request: web.Request, status: int, message: str) -> web.StreamResponse:
    if request.path.startswith("/api/"):
        return web.json_response({"error": message}, status=status)
    return await render(request, "error.html", {"status": status, "message": message}, status=status)


HOSTS: Final = web.AppKey("hosts", security.HostPolicy)
GUARD: Final = web.AppKey("guard", ConnectionGuard)
_FORMS: Final = ("application/x-www-form-urlencoded", "multipart/form-data")


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every response's security headers, set as its headers go out: pages, redirects, errors,
    static files and the live event stream (which sends its headers from inside its handler)."""
    for name, value in security.SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)


@web.middleware
async def security_middleware(request: web.Request, handler: security.Handler) -> web.StreamResponse:
    # The Host check comes first: a DNS-rebinding page gets nothing, not even the login form.
    # /healthz says only "ok" (load balancers probe it by address or by any name).
    if request.path != "/healthz" and not request.app[HOSTS].host_ok(request.headers.get("Host")):
        return web.Response(
            status=421, text="421 Misdirected Request: this console does not answer to that host name\n"
        )
    guard = request.app.get(GUARD)
    protocol = request.protocol
    if guard is not None and request.body_exists:
        # The body is read while the connection still counts as waiting for its request, so a
        # body sent slowly is cut at the same deadline as a head sent slowly. Read once here,
        # the handler gets it from aiohttp's cache.
        try:
            await (request.post() if request.content_type in _FORMS else request.read())
        except ValueError:
            return web.Response(status=400, text="400 Bad Request: malformed form body\n")
    if guard is not None:
        guard.request_started(protocol)
    try:
        return await _guarded(request, handler)
    finally:
        if guard is not None:
            guard.request_finished(protocol)


async def _guarded(request: web.Request, handler: security.Handler) -> web.StreamResponse:
    if request.method not in ("GET", "HEAD") and not request.app[HOSTS].origin_ok(
        request.headers.get("Origin"), request.headers.get("Sec-Fetch-Site"), request.headers.get("Host")
    ):
        # Before the public routes: the login form is a target too (login CSRF).
        return await _error(request, 403, "this request came from another site's page (its Origin); refused")
    unrouted = request.match_info.http_exception
    if unrouted is not None:  # no such page (404) or method (405): said as it is, to anyone
        return await _error(request, unrouted.status, unrouted.reason.lower())
    if any(request.path.startswith(prefix) for prefix in _PUBLIC):
        try:
            response: web.StreamResponse = await handler(request)
        except Exception as exc:
            return await _failed(request, exc)
        return response
    console = request.app[CONSOLE]
    token = request.cookies.get(security.COOKIE, "")
    try:
        # Only sessions: an API key is for programs, not a browser cookie.
        principal = await console.api.auth.authenticate(token) if token.startswith("st_") else None
    except Unauthenticated:
        principal = None
    except Exception as exc:
        return await _failed(request, exc)
    if principal is None:
        if request.method == "GET" and not request.path.startswith("/api/") and request.path != "/events":
            raise web.HTTPSeeOther("/login") from None
        return await _error(request, 401, "log in first (no valid session)")
    request[security.PRINCIPAL] = principal
    request[security.CSRF] = security.csrf_token(token)
    if request.method not in ("GET", "HEAD"):
        presented = request.headers.get(security.CSRF_HEADER)
        if presented is None and request.content_type in ("application/x-www-form-urlencoded", "multipart/form-data"):
            presented = (await request.post()).get(security.CSRF_FIELD)  # type: ignore[assignment]
        if not security.csrf_ok(token, presented if isinstance(presented, str) else None):
            return await _error(request, 403, "the form's CSRF token is missing or wrong; reload the page and retry")
    method = security.route_rpc(getattr(request.match_info, "handler", None))
    if method is None:
        return await _error(request, 403, "this page is not open to any role")
    if not security.allows(principal, method):
        return await _error(
            request, 403, f"{method.rsplit('/', 1)[-1]} needs a higher role (you are {principal.role.value})"
        )
    try:
        answer: web.StreamResponse = await handler(request)
    except Exception as exc:
        return await _failed(request, exc)
    return answer


async def _failed(request: web.Request, exc: Exception) -> web.StreamResponse:
    """The page for a handler that raised `exc`: the API's status for it (`statuses.status_of`) as
    an HTTP status; an unexpected error propagates (a 500, logged with its traceback)."""
    code, message = statuses.status_of(exc)
    if code is statuses.Code.INTERNAL:
        raise exc
    if code is statuses.Code.UNAVAILABLE:
        log.warning("console: a store did not answer", extra={"path": request.path, "error": repr(exc)})
        message = STORES_DOWN
    return await _error(request, statuses.HTTP_STATUS[code], message)


async def healthz(request: web.Request) -> web.StreamResponse:
    return web.Response(text="ok")


async def favicon(request: web.Request) -> web.StreamResponse:
    """The icon browsers ask for at /favicon.ico (an SVG: every current browser draws one)."""
    return web.FileResponse(STATIC / "favicon.svg", headers={"Content-Type": "image/svg+xml"})


def build_app(
    console: Console, hosts: security.HostPolicy | None = None, guard: ConnectionGuard | None = None
) -> web.Application:
    """The console's routes on a new application.

    Args:
        console: The console's dependencies.
        hosts: The host names it answers to (default: loopback names and addresses only).
        guard: The connection bounds of the server it is served by (request start and end are
            reported to it).
    """
    app = web.Application(middlewares=[security_middleware, flash.middleware], client_max_size=1024 * 1024)
    app[CONSOLE] = console
    app[live.LABELS] = live.Labels(console.api.control)
    app[HOSTS] = hosts or security.HostPolicy.build("127.0.0.1", ())
    if guard is not None:
        app[GUARD] = guard
    app.on_response_prepare.append(_security_headers)
    v = views
    app.add_routes(
        [
            web.get("/login", v.login_page),
            web.post("/login", v.login),
            web.get("/healthz", healthz),
            web.get("/favicon.ico", favicon),
            web.post("/logout", v.logout),
            web.get("/", v.overview),
            web.get("/jobs", v.jobs),
            web.get("/jobs/new", v.new_job),
            web.post("/jobs", v.create_job),
            # Before /jobs/{id}: the first route that matches a path serves it.
            web.post("/jobs/bulk", bulk.jobs_bulk),
            web.post("/executions/bulk", bulk.executions_bulk),
            web.get("/jobs/{id}", v.job_detail),
            web.get("/jobs/{id}/edit", v.edit_job),
            web.post("/jobs/{id}", v.update_job),
            web.post("/jobs/{id}/pause", v.pause_job),
            web.post("/jobs/{id}/resume", v.resume_job),
            web.post("/jobs/{id}/trigger", v.trigger_job),
            web.post("/jobs/{id}/delete", v.delete_job),
            web.post("/jobs/{id}/backfill", v.backfill_job),
            web.get("/api/preview", v.preview),
            web.get("/executions", v.executions),
            web.get("/executions/{id}", v.execution_detail),
            web.post("/executions/{id}/cancel", v.cancel_execution),
            web.get("/events", v.events),
            web.get("/workers", v.workers),
            web.get("/dead-letters", search.dead_letters),
            web.post("/dead-letters/requeue", v.requeue_dead),
            web.post("/dead-letters/purge", v.purge_dead),
            web.get("/api-keys", v.api_keys),
            web.post("/api-keys", v.create_api_key),
            web.post("/api-keys/{id}/revoke", v.revoke_api_key),
            web.get("/charts", search.charts),
            *users.ROUTES,
            *flows.ROUTES,
            *limits_page.ROUTES,
            web.static("/static", STATIC, append_version=False),
        ]
    )
    return app


def listen_host(settings: Settings) -> str:
    """Where the console listens.

    Raises:
        ConfigError: production without SCHEDULER_HTTP_HOST.
    """
    if settings.http_host:
        return settings.http_host
    if settings.production:
        raise ConfigError("SCHEDULER_HTTP_HOST must be set in production (or SCHEDULER_HTTP_ENABLED=false)")
    return DEV_HOST


def _ssl_context(settings: Settings) -> ssl.SSLContext | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(settings.tls_cert, settings.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"SCHEDULER_TLS_CERT/KEY cannot be used for the console: {exc}") from None
    return context


@dataclass(frozen=True)
class RunningConsole:
    """A started console: its URL and bound port."""

    url: str
    port: int


class _GuardedSite(web.BaseSite):
    """A TCP site whose connections go through a `ConnectionGuard`, on a reusable address.

    SO_REUSEADDR (asyncio's default on POSIX, which the console used to turn off): a restart binds
    at once although the previous process's connections sit in TIME_WAIT. It does not let two
    live servers share the port (that is SO_REUSEPORT, left off): a second server still fails.
    """

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        guard: ConnectionGuard,
        *,
        ssl_context: ssl.SSLContext | None,
        handshake_timeout: float,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host = host
        self._port = port
        self._guard = guard
        self._handshake_timeout = handshake_timeout

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    @property
    def sockets(self) -> list[socket.socket]:
        return list(getattr(self._server, "sockets", None) or [])

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        # A TLS handshake happens before the guard sees the connection: it gets the same deadline.
        self._server = await loop.create_server(
            self._guard,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=True,
            reuse_port=False,
            ssl_handshake_timeout=self._handshake_timeout if self._ssl_context else None,
        )


@contextlib.asynccontextmanager
async def serve_console(settings: Settings, api: Api) -> AsyncIterator[RunningConsole]:
    """Serve the console on SCHEDULER_HTTP_HOST:PORT until the block exits.

    Raises:
        ConfigError: no host in production, unusable TLS files, or the port cannot be bound.
    """
    host = listen_host(settings)
    context = _ssl_context(settings)
    console = Console(
        api=api,
        secure=context is not None or settings.http_tls_proxy,
        templates=environment(),
    )
    machine: list[str] = []
    if security.is_wildcard(host):
        # getfqdn may ask DNS: off the loop, bounded (without an answer, the host name alone).
        try:
            async with asyncio.timeout(MACHINE_NAMES_TIMEOUT):
                machine = await asyncio.to_thread(security.machine_names)
        except TimeoutError:
            machine = [socket.gethostname()]
    hosts = security.HostPolicy.build(host, settings.http_allowed_hosts, machine_names=machine)

    def protocol() -> asyncio.Protocol:
        """aiohttp's protocol for one connection (the runner is set up before anything connects)."""
        assert runner.server is not None
        return runner.server()

    guard = ConnectionGuard(
        protocol,
        limit=connection_limit(settings.http_max_connections),
        header_timeout=settings.http_header_timeout.total_seconds(),
    )
    runner = web.AppRunner(
        build_app(console, hosts, guard),
        access_log=None,
        handle_signals=False,
        shutdown_timeout=2.0,
        # Idle keep-alive connections are closed by the guard; aiohttp's own (longer) timer stays.
        keepalive_timeout=max(75.0, settings.http_header_timeout.total_seconds()),
    )
    await runner.setup()
    try:
        site = _GuardedSite(
            runner,
            host,
            settings.http_port,
            guard,
            ssl_context=context,
            handshake_timeout=settings.http_header_timeout.total_seconds(),
        )
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(
                f"SCHEDULER_HTTP_HOST/PORT: cannot listen on {host}:{settings.http_port}: {exc}"
            ) from None
        sockets = site.sockets
        port = sockets[0].getsockname()[1] if sockets else settings.http_port
        scheme = "https" if context else "http"
        shown = f"[{host}]" if ":" in host else host
        url = f"{scheme}://{shown}:{port}/"
        log.info(
            "web console listening",
            extra={"url": url, "tls": context is not None, "max_connections": guard.limit},
        )
        async with depth.sampling(api.control):  # the charts' queue depth over time
            yield RunningConsole(url=url, port=port)
    finally:
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await runner.cleanup()
        finally:
            guard.close()


__all__ = ["build_app", "serve_console"]
