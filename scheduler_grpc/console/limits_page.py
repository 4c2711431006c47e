"""The console's Limits page (issue 22): each limit with its definition and overrides, its busiest
keys, one key's state per queue, and pause/resume buttons for a key.

Each handler is the console side of a LimitService RPC (`security.rpc`), so the API's role table
decides who may use it (viewers read, operators pause and resume), and each calls
`Control.limits`/`Control.limit_keys` as the servicer does: the same validation, the same rules.
"""

from __future__ import annotations

import urllib.parse
from typing import Final

from aiohttp import web

from scheduler_grpc.config import parse_duration
from scheduler_grpc.console import flash
from scheduler_grpc.console.context import CONSOLE, render
from scheduler_grpc.console.security import rpc
from scheduler_grpc.control_limit_keys import LimitKeyState
from scheduler_grpc.errors import InvalidArgument

_V: Final = "/scheduler.v1.LimitService/"
PAGE_SIZE: Final = 100


async def _form(request: web.Request) -> dict[str, str]:
    data = await request.post()
    return {key: value for key, value in data.items() if isinstance(value, str)}


def _back(limit: str, key: str, queue: str) -> str:
    """The Limits page showing this key (where an action returns to)."""
    query = {"limit": limit, "key": key, **({"queue": queue} if queue else {})}
    return "/limits?" + urllib.parse.urlencode(query) + "#key-state"


def _queues_text(state: LimitKeyState) -> str:
    return ", ".join(entry.queue for entry in state.queues) or "no queue"


@rpc(_V + "ListLimits")
async def limits(request: web.Request) -> web.StreamResponse:
    control = request.app[CONSOLE].api.control
    query = request.query
    page = await control.limits.list_limits(PAGE_SIZE, query.get("token", ""))
    busiest = await control.limit_keys.busiest_keys([limit.name for limit in page.limits])
    state = None
    if query.get("limit") and query.get("key"):
        state = await control.limit_keys.key_state(query["limit"], query["key"], queue=query.get("queue") or None)
    return await render(
        request,
        "limits.html",
        {"page": page, "busiest": busiest, "state": state, "query": query},
    )


@rpc(_V + "PauseLimitKey")
async def pause_key(request: web.Request) -> web.StreamResponse:
    form = await _form(request)
    limit, key, queue = form.get("limit", ""), form.get("key", ""), form.get("queue", "").strip()
    raw = form.get("duration", "").strip()
    try:
        duration = parse_duration(raw)
    except ValueError:
        raise InvalidArgument("duration", "must be a duration such as 30s, 5m or 1h") from None
    state = await request.app[CONSOLE].api.control.limit_keys.pause_key(
        limit, key, duration=duration, queue=queue or None
    )
    message = f"Paused key {key} of {limit} for {raw} on {_queues_text(state)}"
    raise flash.redirect(request, _back(limit, key, queue), message)


@rpc(_V + "ResumeLimitKey")
async def resume_key(request: web.Request) -> web.StreamResponse:
    form = await _form(request)
    limit, key, queue = form.get("limit", ""), form.get("key", ""), form.get("queue", "").strip()
    state = await request.app[CONSOLE].api.control.limit_keys.resume_key(limit, key, queue=queue or None)
    raise flash.redirect(request, _back(limit, key, queue), f"Resumed key {key} of {limit} on {_queues_text(state)}")


ROUTES: Final = [
    web.get("/limits", limits),
    web.post("/limits/pause", pause_key),
    web.post("/limits/resume", resume_key),
]
