"""What every console page needs: its dependencies and template rendering."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import jinja2
from aiohttp import web
from markupsafe import Markup

from scheduler_grpc.application import Api
from scheduler_grpc.console import humane, security

TEMPLATES: Final = Path(__file__).parent / "templates"
STATIC: Final = Path(__file__).parent / "static"


@dataclass
class Console:
    """The console's dependencies (one per server process).

    Attributes:
        api: The application layer the servicers use too (Control, Authenticator, fan-out,
            cluster view, handlers, and the server's store health for the outage banner).
        secure: Whether the session cookie is `Secure` (TLS here, or at a proxy in front).
        templates: The Jinja2 environment (autoescaped).
    """

    api: Api
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
    env.filters["rel"] = humane.relative
    env.filters["duration"] = humane.duration
    return env


def _visible(value: Any) -> Any:
    """A template value with bidirectional-text controls made visible (`security.visible`).

    In form fields too: the one free-text field that can hold them is the JSON payload, where the
    escape is the same JSON string (the parsed payload is unchanged when the form is saved).
    """
    if isinstance(value, Markup):
        return Markup(security.visible(str(value)))  # the escapes hold no markup characters
    if isinstance(value, str):
        return security.visible(value)
    return value


def _ago(moment: datetime | None) -> Markup:
    return humane.relative(moment)


def _when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if moment else "—"


def _secs(value: timedelta | float | None) -> str:
    return humane.duration(value)


async def render(request: web.Request, template: str, values: dict[str, Any], status: int = 200) -> web.Response:
    """`template` rendered with `values` and what every page shows (user, CSRF token, store health)."""
    console = request.app[CONSOLE]
    health = console.api.health  # the server's own checks (about every second), not a ping per page
    principal = request.get(security.PRINCIPAL)
    context = {
        "principal": principal,
        "csrf": request.get(security.CSRF, ""),
        "can": (lambda method: security.can(principal.role, method)) if principal else (lambda method: False),
        "redis_up": health.redis_up,
        "postgres_up": health.postgres_up,
        "path": request.path_qs,
        "flash": request.get(FLASH),
        **values,
    }
    body = console.templates.get_template(template).render(context)
    return web.Response(text=body, status=status, content_type="text/html")


CONSOLE: Final = web.AppKey("console", Console)
FLASH: Final = web.RequestKey("flash", str)
"""The flash message a page shows (set by `flash.middleware` from the action that redirected here)."""
