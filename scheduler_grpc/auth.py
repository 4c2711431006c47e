"""Who may call what: sessions, API keys, passwords, roles and the one table of method rights.

* Sessions: `Login` checks an argon2id password hash (in a worker thread, never on the event loop)
  and returns a random token. Redis keeps only the token's SHA-256, under a key that expires with
  the session; `Logout` deletes it. Sessions exist only in Redis: unlike the queue, they are not
  rebuilt from PostgreSQL, so a Redis that loses its data (FLUSHALL, a restart without
  persistence) ends every session and users log in again. API keys are unaffected.
* API keys: random secrets shown once; PostgreSQL keeps only their SHA-256.
* Tokens carry a kind prefix (`st_` session, `sk_` API key) so a call is checked against one store,
  and secret scanners can recognise leaked keys.
* Roles are ordered: viewer < operator < admin. `METHOD_ROLES` maps every full method name to the
  least role that may call it; a method missing from it is refused (deny by default).
* Login failures are counted per username and per peer address in Redis (counters with a TTL);
  past the limit, logins fail with RESOURCE_EXHAUSTED before any hashing is spent on them. Unknown
  users cost one hash verification too, against a dummy hash, so timing does not tell which names
  exist; every failure has the same message.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import hashlib
import logging
import secrets
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final, Literal

import orjson
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from redis.asyncio import Redis

from scheduler_grpc.db.api_keys import ApiKeyRecord, ApiKeyRepository
from scheduler_grpc.db.users import User, UserRepository
from scheduler_grpc.errors import ConfigError, InvalidArgument, SchedulerError

log = logging.getLogger(__name__)

SESSION_PREFIX: Final = "st_"
API_KEY_PREFIX: Final = "sk_"
# Characters of an API key stored (and shown) to tell keys apart: the prefix plus 8 random ones.
KEY_PREFIX_LENGTH: Final = len(API_KEY_PREFIX) + 8
LOGIN_FAILURE_WINDOW: Final = timedelta(minutes=15)
# Per username: stops guessing one account's password. Per peer: stops one client spraying names.
MAX_FAILURES_PER_USERNAME: Final = 10
MAX_FAILURES_PER_PEER: Final = 30
# argon2id with the library's RFC 9106 profile needs 64 MiB per hash: bound how many run at once so a
# login flood queues instead of exhausting memory.
MAX_CONCURRENT_HASHES: Final = 4
MAX_PASSWORD_LENGTH: Final = 1024
DEV_ADMIN_PASSWORD: Final = "admin123"
MIN_PRODUCTION_PASSWORD_LENGTH: Final = 12
_INVALID_CREDENTIALS: Final = "invalid username or password"


class Unauthenticated(SchedulerError):
    """No valid credentials came with the call."""


class PermissionDenied(SchedulerError):
    """The caller is known but its role does not allow the call."""


class ResourceExhausted(SchedulerError):
    """Too many attempts or too much load; the message says when or how to retry."""


class Role(enum.StrEnum):
    """A caller's rights; each role includes the rights of the ones before it."""

    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return _RANKS[self]

    def allows(self, needed: Role) -> bool:
        """Whether this role has the rights of `needed`."""
        return self.rank >= needed.rank


_RANKS: Final = {Role.VIEWER: 1, Role.OPERATOR: 2, Role.ADMIN: 3}

PUBLIC: Final = None
"""The 'least role' of methods any caller may use without credentials."""

_V = Role.VIEWER
_O = Role.OPERATOR
_A = Role.ADMIN

METHOD_ROLES: Final[Mapping[str, Role | None]] = {
    # Login hands out credentials, Health is for load balancers, reflection describes the public
    # protos (without it grpcurl/buf curl could not even call Login): all three need none.
    "/scheduler.v1.AuthService/Login": PUBLIC,
    "/grpc.health.v1.Health/Check": PUBLIC,
    "/grpc.health.v1.Health/Watch": PUBLIC,
    "/grpc.health.v1.Health/List": PUBLIC,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": PUBLIC,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": PUBLIC,
    "/scheduler.v1.AuthService/Logout": _V,
    "/scheduler.v1.AuthService/WhoAmI": _V,
    "/scheduler.v1.AuthService/CreateApiKey": _A,
    "/scheduler.v1.AuthService/ListApiKeys": _A,
    "/scheduler.v1.AuthService/RevokeApiKey": _A,
    "/scheduler.v1.JobService/CreateJob": _A,
    "/scheduler.v1.JobService/GetJob": _V,
    "/scheduler.v1.JobService/ListJobs": _V,
    "/scheduler.v1.JobService/UpdateJob": _A,
    "/scheduler.v1.JobService/DeleteJob": _A,
    "/scheduler.v1.JobService/PauseJob": _O,
    "/scheduler.v1.JobService/ResumeJob": _O,
    "/scheduler.v1.JobService/TriggerJob": _O,
    "/scheduler.v1.JobService/PreviewSchedule": _V,
    "/scheduler.v1.JobService/BackfillJob": _A,
    "/scheduler.v1.ExecutionService/GetExecution": _V,
    "/scheduler.v1.ExecutionService/ListExecutions": _V,
    "/scheduler.v1.ExecutionService/CancelExecution": _O,
    "/scheduler.v1.ExecutionService/WatchExecutions": _V,
    "/scheduler.v1.QueueService/GetQueueStats": _V,
    "/scheduler.v1.QueueService/ListDeadLetters": _V,
    "/scheduler.v1.QueueService/RequeueDeadLetters": _O,
    "/scheduler.v1.QueueService/PurgeDeadLetters": _A,
    "/scheduler.v1.ClusterService/ListWorkers": _V,
    "/scheduler.v1.ClusterService/GetSchedulerStatus": _V,
    "/scheduler.v1.ClusterService/ListHandlers": _V,
}


def required_role(method: str) -> Role | None:
    """The least role that may call `method` (None: public).

    Raises:
        PermissionDenied: the method is not in `METHOD_ROLES` (deny by default).
    """
    try:
        return METHOD_ROLES[method]
    except KeyError:
        raise PermissionDenied(f"{method} is not open to any role") from None


@dataclass(frozen=True)
class Principal:
    """An authenticated caller.

    Attributes:
        name: The username, or `api-key:<name>` for an API key.
        role: What it may do.
        kind: How it authenticated.
        subject_id: The user's or the API key's id.
        token_hash: SHA-256 of the credential it presented (Logout deletes the session by it).
    """

    name: str
    role: Role
    kind: Literal["session", "api_key"]
    subject_id: str
    token_hash: bytes

    def require(self, needed: Role, what: str) -> None:
        """Raise PermissionDenied unless this caller has `needed`; `what` says what was refused."""
        if not self.role.allows(needed):
            raise PermissionDenied(f"{what} needs the {needed.value} role (you are {self.role.value})")


_CURRENT: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("scheduler_principal", default=None)


def current_principal() -> Principal:
    """The caller of the RPC being served (set by the auth interceptor).

    Raises:
        Unauthenticated: no caller was authenticated for this call (a public method).
    """
    principal = _CURRENT.get()
    if principal is None:
        raise Unauthenticated("this call needs `authorization: Bearer <token>` metadata")
    return principal


def set_current_principal(principal: Principal | None) -> contextvars.Token[Principal | None]:
    """Make `principal` the caller of the RPC being served; returns a token to reset it."""
    return _CURRENT.set(principal)


def reset_current_principal(token: contextvars.Token[Principal | None]) -> None:
    _CURRENT.reset(token)


@dataclass(frozen=True)
class AuthKeys:
    """Redis keys of sessions and login rate limits (one hash tag: a Cluster slot of their own)."""

    def session(self, token_hash: bytes) -> str:
        """STRING: the session's principal as JSON, expiring with the session."""
        return f"{{auth}}:session:{token_hash.hex()}"

    def failures_by_username(self, username: str) -> str:
        """STRING counter of failed logins for one username, expiring after the window."""
        return f"{{auth}}:login-failures:user:{username.lower()}"

    def failures_by_peer(self, peer: str) -> str:
        """STRING counter of failed logins from one peer address, expiring after the window."""
        return f"{{auth}}:login-failures:peer:{peer}"


@dataclass(frozen=True)
class Session:
    """What `Login` returns."""

    token: str
    expire_time: datetime
    role: Role


@dataclass(frozen=True)
class NewApiKey:
    """What `create_api_key` returns: the record and its secret (shown this once)."""

    record: ApiKeyRecord
    secret: str


def hash_token(token: str) -> bytes:
    """SHA-256 of a token: what the stores keep (a random 256-bit secret needs no slow hash)."""
    return hashlib.sha256(token.encode()).digest()


def peer_address(peer: str) -> str:
    """The address part of a gRPC peer string (`ipv4:1.2.3.4:5678` -> `1.2.3.4`), for rate limits.

    gRPC percent-encodes an IPv6 peer's brackets (`ipv6:%5B::1%5D:5678`); both spellings give `::1`.
    """
    kind, _, rest = peer.partition(":")
    if kind in {"ipv4", "ipv6"}:
        rest = urllib.parse.unquote(rest)
        address = rest.rsplit(":", 1)[0] if ":" in rest else rest
        return address.strip("[]") or "unknown"
    return kind or "unknown"


def parse_bearer(metadata: Mapping[str, str | bytes] | None) -> str:
    """The token of the `authorization: Bearer <token>` metadata entry.

    Raises:
        Unauthenticated: no such entry, or not a bearer token.
    """
    raw = (metadata or {}).get("authorization")
    if raw is None:
        raise Unauthenticated("this call needs `authorization: Bearer <token>` metadata")
    value = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated("the authorization metadata must be `Bearer <token>`")
    return token


class Authenticator:
    """Checks credentials and issues sessions and API keys.

    Args:
        redis: Where sessions and login counters live.
        users: The users table.
        api_keys: The API keys table.
        session_ttl: How long a session lasts.
        timeout: Bound on each Redis call.
        hasher: The argon2id hasher (tests may pass cheaper parameters).
    """

    def __init__(
        self,
        redis: Redis,
        users: UserRepository,
        api_keys: ApiKeyRepository,
        *,
        session_ttl: timedelta,
        timeout: timedelta = timedelta(seconds=5),
        hasher: PasswordHasher | None = None,
    ) -> None:
        self._redis = redis
        self._users = users
        self.api_keys = api_keys
        self._session_ttl = session_ttl
        self._timeout = timeout.total_seconds()
        self._hasher = hasher or PasswordHasher()
        self._hashing = asyncio.Semaphore(MAX_CONCURRENT_HASHES)
        self._keys = AuthKeys()
        self._dummy_hash: str | None = None

    # -- passwords ------------------------------------------------------------------------------

    async def hash_password(self, password: str) -> str:
        """An argon2id hash of `password`, computed in a worker thread."""
        async with self._hashing:
            return await asyncio.to_thread(self._hasher.hash, password)

    async def _verify(self, password_hash: str, password: str) -> bool:
        def verify() -> bool:
            try:
                return self._hasher.verify(password_hash, password)
            except (VerificationError, InvalidHashError):
                return False

        async with self._hashing:
            return await asyncio.to_thread(verify)

    async def _dummy(self) -> str:
        if self._dummy_hash is None:
            self._dummy_hash = await self.hash_password(secrets.token_urlsafe(16))
        return self._dummy_hash

    async def ensure_admin(self, username: str, password: str) -> User:
        """Create the admin user, or give an existing one the admin role and this password.

        The stored hash is kept when it already matches `password` (no needless rehash at every start).
        """
        await self._dummy()  # computed now so the first failed login is not slower than the others
        existing = await self._users.get_by_username(username)
        if existing is not None and await self._verify(existing.password_hash, password):
            if existing.role != Role.ADMIN.value or existing.disabled:
                await self._users.set_role(existing.id, Role.ADMIN.value)
            return existing
        return await self._users.upsert(username, await self.hash_password(password), Role.ADMIN.value)

    # -- sessions -------------------------------------------------------------------------------

    async def login(self, username: str, password: str, peer: str) -> Session:
        """Check a username and password and open a session.

        Raises:
            InvalidArgument: an empty username or an oversized password.
            ResourceExhausted: too many recent failures for this username or from this peer.
            Unauthenticated: wrong credentials (one message for every cause).
        """
        if not username:
            raise InvalidArgument("username", "must not be empty")
        if len(password) > MAX_PASSWORD_LENGTH:
            raise InvalidArgument("password", f"must be at most {MAX_PASSWORD_LENGTH} characters")
        address = peer_address(peer)
        user_key, peer_key = self._keys.failures_by_username(username), self._keys.failures_by_peer(address)
        async with asyncio.timeout(self._timeout):
            by_user, by_peer = await self._redis.mget([user_key, peer_key])
        if int(by_user or 0) >= MAX_FAILURES_PER_USERNAME or int(by_peer or 0) >= MAX_FAILURES_PER_PEER:
            raise ResourceExhausted("too many failed logins; try again later")
        user = await self._users.get_by_username(username)
        if user is None or user.disabled:
            # The same work as a real check, so the answer's timing does not reveal the name.
            await self._verify(await self._dummy(), password)
            ok = False
        else:
            ok = await self._verify(user.password_hash, password)
        if not ok or user is None:
            await self._count_failure(user_key, peer_key)
            log.info("login failed", extra={"username": username[:64], "peer": address})
            raise Unauthenticated(_INVALID_CREDENTIALS)
        if self._hasher.check_needs_rehash(user.password_hash):
            await self._users.set_password_hash(user.id, await self.hash_password(password))
        async with asyncio.timeout(self._timeout):
            await self._redis.delete(user_key)
        return await self.open_session(user)

    async def _count_failure(self, *keys: str) -> None:
        window = int(LOGIN_FAILURE_WINDOW.total_seconds())
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.incr(key)
            pipe.expire(key, window, nx=True)
        async with asyncio.timeout(self._timeout):
            await pipe.execute()

    async def open_session(self, user: User) -> Session:
        """A new session for `user` (after its password was checked)."""
        token = SESSION_PREFIX + secrets.token_urlsafe(32)
        value = orjson.dumps({"user_id": user.id, "username": user.username, "role": user.role})
        ttl_ms = int(self._session_ttl.total_seconds() * 1000)
        async with asyncio.timeout(self._timeout):
            await self._redis.set(self._keys.session(hash_token(token)), value, px=ttl_ms)
        return Session(token, datetime.now(UTC) + self._session_ttl, Role(user.role))

    async def logout(self, principal: Principal) -> None:
        """End the caller's session at once.

        Raises:
            InvalidArgument: the caller used an API key (revoke it with RevokeApiKey instead).
        """
        if principal.kind != "session":
            raise InvalidArgument("authorization", "Logout ends sessions; revoke an API key with RevokeApiKey")
        async with asyncio.timeout(self._timeout):
            await self._redis.delete(self._keys.session(principal.token_hash))

    # -- every call -----------------------------------------------------------------------------

    async def authenticate(self, token: str) -> Principal:
        """The caller a bearer token stands for.

        Raises:
            Unauthenticated: unknown, expired, revoked or malformed token.
        """
        digest = hash_token(token)
        if token.startswith(API_KEY_PREFIX):
            record = await self.api_keys.find_active(digest)
            if record is None:
                raise Unauthenticated("invalid, expired or revoked API key")
            return Principal(f"api-key:{record.name}", Role(record.role), "api_key", record.id, digest)
        if token.startswith(SESSION_PREFIX):
            async with asyncio.timeout(self._timeout):
                raw = await self._redis.get(self._keys.session(digest))
            if raw is not None:
                data = orjson.loads(raw)
                return Principal(data["username"], Role(data["role"]), "session", data["user_id"], digest)
        raise Unauthenticated("invalid or expired session token; log in again")

    # -- API keys -------------------------------------------------------------------------------

    async def create_api_key(self, creator: Principal, name: str, role: Role, expires_at: datetime | None) -> NewApiKey:
        """Create an API key; its secret is in the result and nowhere else.

        Raises:
            InvalidArgument: naming `display_name` or `expire_time`.
        """
        name = name.strip()
        if not 1 <= len(name) <= 100:
            raise InvalidArgument("display_name", "must be 1-100 characters")
        if expires_at is not None and expires_at <= datetime.now(UTC):
            raise InvalidArgument("expire_time", "must be in the future")
        secret = API_KEY_PREFIX + secrets.token_urlsafe(32)
        record = await self.api_keys.create(
            name=name,
            key_hash=hash_token(secret),
            key_prefix=secret[:KEY_PREFIX_LENGTH],
            role=role.value,
            created_by=creator.subject_id if creator.kind == "session" else None,
            expires_at=expires_at,
        )
        return NewApiKey(record, secret)


def admin_password(settings_password: str | None, *, production: bool, loopback: bool) -> str:
    """The start-up admin's password.

    Only in dev, listening on loopback only, may it fall back to `DEV_ADMIN_PASSWORD` (the caller
    logs a warning then).

    Raises:
        ConfigError: the setting is missing or too weak for where the server runs (names
            SCHEDULER_ADMIN_PASSWORD and says what to do).
    """
    if production:
        if not settings_password or settings_password == DEV_ADMIN_PASSWORD:
            raise ConfigError("SCHEDULER_ADMIN_PASSWORD must be set to a real password in production")
        if len(settings_password) < MIN_PRODUCTION_PASSWORD_LENGTH:
            raise ConfigError(
                f"SCHEDULER_ADMIN_PASSWORD must be at least {MIN_PRODUCTION_PASSWORD_LENGTH} characters in production"
            )
        return settings_password
    if settings_password:
        return settings_password
    if not loopback:
        raise ConfigError(
            "SCHEDULER_ADMIN_PASSWORD must be set when the gRPC server listens beyond loopback (SCHEDULER_GRPC_HOST)"
        )
    return DEV_ADMIN_PASSWORD
