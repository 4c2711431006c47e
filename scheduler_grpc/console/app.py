"""The console's aiohttp application: routes, the security middleware, start and stop.

The middleware, for every request: sets the security headers; lets the login page and static files
through; otherwise authenticates the session cookie (a Login session token) with the API's
`Authenticator`, checks the CSRF token of every POST, and checks the role the route's RPC needs in
`auth.METHOD_ROLES`. Errors become pages by the API's own mapping (`statuses.status_of`, as HTTP
statuses: INVALID_ARGUMENT 400, NOT_FOUND 404, ALREADY_EXISTS/FAILED_PRECONDITION/ABORTED 409,
RESOURCE_EXHAUSTED 429, PERMISSION_DENIED 403, UNAVAILABLE 503 saying a store is down).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from scheduler_grpc import statuses
from scheduler_grpc.application import Api
from scheduler_grpc.auth import Unauthenticated
from scheduler_grpc.config import Settings
from scheduler_grpc.console import bulk, depth, flash, flows, live, search, security, users, views
from scheduler_grpc.console.context import CONSOLE, STATIC, Console, environment, render
from scheduler_grpc.errors import ConfigError

log = logging.getLogger(__name__)

DEV_HOST: Final = "127.0.0.1"
_PUBLIC: Final = ("/login", "/static/", "/healthz", "/favicon.ico")
STORES_DOWN: Final = "Redis or PostgreSQL did not answer; try again when both are up"


async def _error(request: web.Request, status: int, message: str) -> web.StreamResponse:
    if request.path.startswith("/api/"):
        return web.json_response({"error": message}, status=status)
    return await render(request, "error.html", {"status": status, "message": message}, status=status)


@web.middleware
async def security_middleware(request: web.Request, handler: security.Handler) -> web.StreamResponse:
    try:
        response = await _guarded(request, handler)
    except web.HTTPException as exc:  # redirects: raised, not returned (aiohttp's rule)
        for name, value in security.SECURITY_HEADERS.items():
            exc.headers.setdefault(name, value)
        raise
    for name, value in security.SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


async def _guarded(request: web.Request, handler: security.Handler) -> web.StreamResponse:
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


def build_app(console: Console) -> web.Application:
    """The console's routes on a new application."""
    app = web.Application(middlewares=[security_middleware, flash.middleware], client_max_size=1024 * 1024)
    app[CONSOLE] = console
    app[live.LABELS] = live.Labels(console.api.control)
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
    runner = web.AppRunner(build_app(console), access_log=None, handle_signals=False, shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, settings.http_port, ssl_context=context, reuse_address=False)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(
                f"SCHEDULER_HTTP_HOST/PORT: cannot listen on {host}:{settings.http_port}: {exc}"
            ) from None
        sockets = [s for server in [site._server] if server is not None for s in getattr(server, "sockets", [])]
        port = sockets[0].getsockname()[1] if sockets else settings.http_port
        scheme = "https" if context else "http"
        shown = f"[{host}]" if ":" in host else host
        url = f"{scheme}://{shown}:{port}/"
        log.info("web console listening", extra={"url": url, "tls": context is not None})
        async with depth.sampling(api.control):  # the charts' queue depth over time
            yield RunningConsole(url=url, port=port)
    finally:
        with contextlib.suppress(asyncio.CancelledError):
            await runner.cleanup()


__all__ = ["build_app", "serve_console"]
