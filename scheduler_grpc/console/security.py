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
* Host names (`HostPolicy`): the console answers only to the names it is configured for, loopback
  names and IP addresses. A DNS-rebinding page reaches the console under the attacker's own name,
  so its requests carry that name in `Host` and are refused (421) before anything else runs.
* Origins (`origin_ok`): a state-changing request a browser sends from another origin (its `Origin`
  or `Sec-Fetch-Site` says so) is refused, the login form included.
* Login CSRF: the login form carries a pre-session token equal to a cookie set with the form
  (`LOGIN_COOKIE`, a double-submit token), so another site cannot log a browser in to its account.
* `safe_next`: where an action may send the browser back to: same-origin relative paths only.
* `visible`: bidirectional-text controls in user data are shown as escapes (`U+202E` as the six
  characters backslash, `u202E`), never raw: they would reorder what the page shows (a file name
  ending `exe.txt` could read as one ending `txt.exe`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import re
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Final, TypeVar
from urllib.parse import urlsplit

from aiohttp import web

from scheduler_grpc.auth import Principal, Role, required_role

COOKIE: Final = "scheduler_session"
CSRF_FIELD: Final = "csrf"
CSRF_HEADER: Final = "X-CSRF-Token"
LOGIN_COOKIE: Final = "scheduler_login"
LOGIN_FIELD: Final = "login_token"
LOGIN_TOKEN_TTL: Final = 3600
_LOGIN_TOKEN: Final = re.compile(r"[A-Za-z0-9_-]{43}")
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


def set_login_cookie(response: web.StreamResponse, token: str, *, secure: bool) -> None:
    """The login form's pre-session token, as a cookie only the login path receives."""
    response.set_cookie(
        LOGIN_COOKIE, token, max_age=LOGIN_TOKEN_TTL, path="/login", httponly=True, samesite="Strict", secure=secure
    )


def login_token(request: web.Request) -> str:
    """The pre-session token of this browser: its login cookie's, or a new random one."""
    current = request.cookies.get(LOGIN_COOKIE, "")
    return current if _LOGIN_TOKEN.fullmatch(current) else secrets.token_urlsafe(32)


def login_token_ok(request: web.Request, presented: str | None) -> bool:
    """Whether the login form's token matches the browser's login cookie (constant-time)."""
    cookie = request.cookies.get(LOGIN_COOKIE, "")
    return (
        presented is not None
        and _LOGIN_TOKEN.fullmatch(cookie) is not None
        and hmac.compare_digest(cookie.encode(), presented.encode())
    )


# -- host names and origins ----------------------------------------------------------------------

_WILDCARD_BINDS: Final = frozenset({"", "0.0.0.0", "::", "[::]"})
_LOOPBACK_NAMES: Final = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _split_host(value: str) -> tuple[str, int | None] | None:
    """`host[:port]` (a Host header, an Origin's netloc) as (lower-case host, port), None if malformed."""
    value = value.strip().lower()
    if not value or any(c in value for c in "/\\@?# \t"):
        return None
    port_text = ""
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:]
    elif value.count(":") == 1:
        host, _, port_text = value.partition(":")
    elif ":" in value:
        return None  # an IPv6 address must be bracketed in a Host header
    else:
        host = value
    if port_text and not (port_text.isdigit() and int(port_text) <= 65535):
        return None
    host = host.rstrip(".")
    return (host, int(port_text) if port_text else None) if host else None


def is_wildcard(bind_host: str) -> bool:
    """Whether `bind_host` is a wildcard address (every interface of this machine)."""
    return bind_host.strip().strip("[]") in _WILDCARD_BINDS


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class HostPolicy:
    """Which `Host` names the console answers to.

    Attributes:
        names: Exact names accepted (lower case).
        suffixes: Domains whose subdomains are accepted too (`.example.com`).
        any_host: `*` was configured: every name is accepted.
        configured: The names configured explicitly (an `Origin` of those is trusted like the Host).
    """

    names: frozenset[str]
    suffixes: tuple[str, ...]
    any_host: bool
    configured: frozenset[str]

    @classmethod
    def build(cls, bind_host: str, allowed: Iterable[str], *, machine_names: Iterable[str] = ()) -> HostPolicy:
        """The policy of a console bound to `bind_host`, with SCHEDULER_HTTP_ALLOWED_HOSTS `allowed`."""
        names = set(_LOOPBACK_NAMES)
        suffixes = [".localhost"]  # RFC 6761: always loopback; browsers resolve it themselves
        bind = bind_host.strip().strip("[]").lower().rstrip(".")
        if is_wildcard(bind):
            names.update(name.lower().rstrip(".") for name in machine_names if name)
        elif not _is_ip(bind):
            names.add(bind)
        configured = set()
        any_host = False
        for entry in allowed:
            if entry == "*":
                any_host = True
            elif entry.startswith("."):
                suffixes.append(entry)
                configured.add(entry)
            else:
                names.add(entry)
                configured.add(entry)
        return cls(frozenset(names), tuple(suffixes), any_host, frozenset(configured))

    def _named(self, host: str) -> bool:
        return host in self.names or any(host.endswith(suffix) or host == suffix[1:] for suffix in self.suffixes)

    def host_ok(self, header: str | None) -> bool:
        """Whether a request's `Host` header names this console.

        IP addresses are always accepted: DNS rebinding needs a name the attacker controls, and a
        page loaded from an address is that address's own origin. So is a request without `Host`
        (HTTP/1.0 from a script or a probe): every browser sends one.
        """
        if header is None:
            return True
        parsed = _split_host(header)
        if parsed is None:
            return False
        return self.any_host or _is_ip(parsed[0]) or self._named(parsed[0])

    def origin_ok(self, origin: str | None, fetch_site: str | None, host_header: str | None) -> bool:
        """Whether a state-changing request comes from the console's own pages.

        `Origin` (which browsers send with every POST) must be the console as the request reached
        it (`Host`), or a configured name; without it, `Sec-Fetch-Site` must not say another site.
        A request with neither is not from a browser, so not a cross-site forgery.
        """
        if origin is None:
            return fetch_site is None or fetch_site in ("same-origin", "none")
        parts = urlsplit(origin.strip())
        if parts.scheme not in ("http", "https") or parts.path or parts.query or not parts.netloc:
            return False  # `null` (a sandboxed frame, a data: URL) and anything else odd
        claimed = _split_host(parts.netloc)
        reached = _split_host(host_header or "")
        if claimed is None or reached is None:
            return False
        origin_port = claimed[1] or (443 if parts.scheme == "https" else 80)
        if claimed[0] == reached[0] and (reached[1] is None or reached[1] == origin_port):
            return True
        return any(
            claimed[0] == name or (name.startswith(".") and claimed[0].endswith(name)) for name in self.configured
        )


def machine_names() -> list[str]:
    """This machine's host names (what a console bound to a wildcard address is reached by)."""
    found = [socket.gethostname()]
    with contextlib.suppress(OSError):
        found.append(socket.getfqdn())
    return found


# -- redirects -----------------------------------------------------------------------------------

_UNSAFE_IN_PATH: Final = re.compile(r"[\x00-\x20\x7f\\]")


def safe_next(target: str, default: str) -> str:
    """`target` if it is a relative path on this origin, else `default`.

    Browsers ignore tabs and line breaks in URLs and read a backslash as a slash, so
    `/%09/evil.example` (decoded: a tab) or `/%5Cevil.example` would leave the site: any control
    character, space or backslash refuses it, as does a second leading slash.
    """
    if not target.startswith("/") or target.startswith("//") or _UNSAFE_IN_PATH.search(target):
        return default
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return default
    return target


# -- bidirectional text --------------------------------------------------------------------------

BIDI_CONTROLS: Final = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_BIDI_TABLE: Final = {ord(c): f"\\u{ord(c):04X}" for c in BIDI_CONTROLS}


def visible(text: str) -> str:
    """`text` with each bidirectional-text control written as its escape (backslash, `u202E`)."""
    return text.translate(_BIDI_TABLE)
