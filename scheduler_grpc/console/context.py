"""What every console page needs: its dependencies, store health, and template rendering."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import jinja2
import markupsafe
from aiohttp import web
from redis.asyncio import Redis

from scheduler_grpc.console import security
from scheduler_grpc.db.console import ConsoleQueries
from scheduler_grpc.db.pool import Pool, ping
from scheduler_grpc.services import Api

TEMPLATES: Final = Path(__file__).parent / "templates"
STATIC: Final = Path(__file__).parent / "static"
# A page asks each store for a sign of life at most this often (every page shows an outage banner).
HEALTH_CACHE: Final = 1.0
HEALTH_TIMEOUT: Final = 1.0


@dataclass
class StoreHealth:
    """Whether Redis and PostgreSQL answer, asked at most every HEALTH_CACHE seconds."""

    redis: Redis
    pool: Pool
    redis_up: bool = True
    postgres_up: bool = True
    _checked: float = 0.0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def _answers(self, check: Any) -> bool:
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT):
                await check()
        except asyncio.CancelledError:
            raise
        except Exception:
            return False
        return True

    async def check(self) -> tuple[bool, bool]:
        async with self._lock:
            if time.monotonic() - self._checked >= HEALTH_CACHE:
                self.redis_up, self.postgres_up = await asyncio.gather(
                    self._answers(self.redis.ping), self._answers(lambda: ping(self.pool))
                )
                self._checked = time.monotonic()
        return self.redis_up, self.postgres_up


@dataclass
class Console:
    """The console's dependencies (one per server process).

    Attributes:
        api: What the servicers use (Control, Authenticator, fan-out, cluster view, handlers).
        queries: The console's list and overview reads.
        health: Store liveness for the outage banner.
        secure: Whether the session cookie is `Secure` (TLS here, or at a proxy in front).
        templates: The Jinja2 environment (autoescaped).
    """

    api: Api
    queries: ConsoleQueries
    health: StoreHealth
    secure: bool
    templates: jinja2.Environment


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=jinja2.select_autoescape(["html"]),
        undefined=jinja2.StrictUndefined,
        enable_async=False,
        # Every `{{ ... }}` output: bidi controls in user data shown as escapes, not applied.
        finalize=_visible,
    )
    env.filters["ago"] = _ago
    env.filters["when"] = _when
    env.filters["secs"] = _secs
    return env


def _visible(value: Any) -> Any:
    """A template value with bidirectional-text controls made visible (`security.visible`).

    In form fields too: the one free-text field that can hold them is the JSON payload, where the
    escape is the same JSON string (the parsed payload is unchanged when the form is saved).
    """
    if isinstance(value, markupsafe.Markup):
        return markupsafe.Markup(security.visible(str(value)))  # the escapes hold no markup characters
    if isinstance(value, str):
        return security.visible(value)
    return value


def _ago(moment: datetime | None) -> str:
    if moment is None:
        return "—"
    seconds = (datetime.now(UTC) - moment).total_seconds()
    return f"{seconds:.1f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def _when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if moment else "—"


def _secs(value: timedelta | float | None) -> str:
    if value is None:
        return "—"
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    return f"{seconds * 1000:.0f} ms" if abs(seconds) < 10 else f"{seconds:.1f} s"


async def render(request: web.Request, template: str, values: dict[str, Any], status: int = 200) -> web.Response:
    """`template` rendered with `values` and what every page shows (user, CSRF token, store health)."""
    console = request.app[CONSOLE]
    redis_up, postgres_up = await console.health.check()
    principal = request.get(security.PRINCIPAL)
    context = {
        "principal": principal,
        "csrf": request.get(security.CSRF, ""),
        "can": (lambda method: security.can(principal.role, method)) if principal else (lambda method: False),
        "redis_up": redis_up,
        "postgres_up": postgres_up,
        "path": request.path_qs,
        **values,
    }
    body = console.templates.get_template(template).render(context)
    return web.Response(text=body, status=status, content_type="text/html")


CONSOLE: Final = web.AppKey("console", Console)
