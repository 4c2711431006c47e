"""Flash messages: one line saying what an action did, shown on the page it redirects to.

An action's redirect carries the message in a short-lived cookie (`redirect`); the next page shows it
(`render` reads `FLASH`) and the cookie is cleared with that response. Actions that do not say
anything themselves get a default message from their route (`DEFAULTS`), so every action answers.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import parse_qs, quote, unquote, urlsplit

from aiohttp import web

from scheduler_grpc.console import security
from scheduler_grpc.console.context import CONSOLE, FLASH

COOKIE: Final = "scheduler_flash"
MAX_LENGTH: Final = 300
# What an action that sets no message of its own did (by its handler's name).
DEFAULTS: Final = {
    "create_job": "Job created",
    "update_job": "Job saved",
    "pause_job": "Job paused",
    "resume_job": "Job resumed",
    "trigger_job": "Run started",
    "delete_job": "Job deleted",
    "backfill_job": "Backfill started",
    "cancel_execution": "Cancel requested",
    "revoke_api_key": "API key revoked",
}


def _set(response: web.StreamResponse, message: str, *, secure: bool) -> None:
    response.set_cookie(
        COOKIE, quote(message[:MAX_LENGTH]), max_age=60, path="/", httponly=True, samesite="Strict", secure=secure
    )


def redirect(request: web.Request, location: str, message: str) -> web.HTTPSeeOther:
    """A redirect to `location` that shows `message` there."""
    answer = web.HTTPSeeOther(location)
    _set(answer, message, secure=request.app[CONSOLE].secure)
    return answer


@web.middleware
async def middleware(request: web.Request, handler: security.Handler) -> web.StreamResponse:
    """Hand the pending message to the page and clear it; give redirects of actions their default."""
    pending = request.cookies.get(COOKIE)
    if pending:
        request[FLASH] = unquote(pending)[:MAX_LENGTH]
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if request.method == "POST" and 300 <= exc.status < 400 and COOKIE not in exc.cookies:
            message = _default(request, exc.headers.get("Location", ""))
            if message:
                _set(exc, message, secure=request.app[CONSOLE].secure)
        elif pending and COOKIE not in exc.cookies:
            exc.del_cookie(COOKIE, path="/")
        raise
    if pending and request.method == "GET" and COOKIE not in response.cookies and response.prepared is False:
        response.del_cookie(COOKIE, path="/")
    return response


def _default(request: web.Request, location: str) -> str | None:
    name = getattr(getattr(request.match_info, "handler", None), "__name__", "")
    done = parse_qs(urlsplit(location).query).get("done")
    if done:  # the dead-letter actions say what they did in the page they return to
        return done[0].capitalize()
    return DEFAULTS.get(name)
