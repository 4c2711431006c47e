"""Console sessions, CSRF tokens, security headers and the role check of each route.

* The session cookie holds a session token exactly like the one `Login` returns (`Authenticator.login`),
  so the same throttling applies to logging in, the same expiry to the session, and logging out
  (`Authenticator.logout`) revokes it for the API too. The cookie is HttpOnly, SameSite=Strict, and
  Secure when the console is served over TLS (or behind a TLS-terminating proxy).
* CSRF: each state-changing request (every POST) must carry a token derived from the session token
  (`csrf_token`), in the `csrf` form field or the `X-CSRF-Token` header. It cannot be computed without
  the session token, which script on another origin never sees (HttpOnly), and needs no server state.
* Roles: every route names the RPC it corresponds to (`rpc`); the middleware allows it only to a
  role that `auth.required_role` allows for that RPC: one role table for the API and the console.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from aiohttp import web

from scheduler_grpc.auth import Principal, Role, required_role

COOKIE: Final = "scheduler_session"
CSRF_FIELD: Final = "csrf"
CSRF_HEADER: Final = "X-CSRF-Token"
# No inline script or style anywhere: scripts and CSS are files under /static, images are inline SVG
# markup (not data: URLs). frame-ancestors 'none' keeps the console out of other sites' frames.
CSP: Final = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'; object-src 'none'"
)
SECURITY_HEADERS: Final = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
_RPC_ATTR: Final = "__console_rpc__"
PRINCIPAL: Final = web.RequestKey("principal", Principal)
CSRF: Final = web.RequestKey("csrf", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
H = TypeVar("H", bound=Handler)


def csrf_token(session_token: str) -> str:
    """The CSRF token of a session: derived from its (secret, HttpOnly) session token."""
    return hmac.new(session_token.encode(), b"scheduler-console-csrf", hashlib.sha256).hexdigest()


def csrf_ok(session_token: str, presented: str | None) -> bool:
    """Whether `presented` is the session's CSRF token (compared in constant time)."""
    return presented is not None and hmac.compare_digest(csrf_token(session_token), presented)


def rpc(method: str) -> Callable[[H], H]:
    """Mark a route as the console side of `method` (a full RPC name in `auth.METHOD_ROLES`)."""
    required_role(method)  # a route naming an RPC missing from the table fails at import, not per call

    def mark(handler: H) -> H:
        setattr(handler, _RPC_ATTR, method)
        return handler

    return mark


def route_rpc(handler: object) -> str | None:
    """The RPC a route handler stands for (None: a public route such as the login page)."""
    method = getattr(handler, _RPC_ATTR, None)
    return method if isinstance(method, str) else None


def allows(principal: Principal, method: str) -> bool:
    """Whether `principal` may do what `method` does (the API's role table)."""
    needed = required_role(method)
    return needed is None or principal.role.allows(needed)


def can(role: Role, method: str) -> bool:
    """`allows` for a role alone (templates hide buttons the role may not use)."""
    needed = required_role(method)
    return needed is None or role.allows(needed)


def set_session_cookie(response: web.StreamResponse, token: str, *, secure: bool, max_age: int) -> None:
    response.set_cookie(COOKIE, token, max_age=max_age, path="/", httponly=True, samesite="Strict", secure=secure)


def clear_session_cookie(response: web.StreamResponse, *, secure: bool) -> None:
    response.del_cookie(COOKIE, path="/", secure=secure, httponly=True, samesite="Strict")
