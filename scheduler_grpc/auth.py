"""Who may call what: sessions, API keys, passwords, roles and the one table of method rights.

* Sessions: `Login` checks an argon2id password hash (in a worker thread, never on the event loop)
  and returns a random token. Redis keeps only the token's SHA-256, under a key that expires with
  the session; `Logout` deletes it. Sessions exist only in Redis: unlike the queue, they are not
  rebuilt from PostgreSQL, so a Redis that loses its data (FLUSHALL, a restart without
  persistence) ends every session and users log in again. API keys are unaffected.
* Changes to a user take effect on its live sessions at once: each user has an index of its
  sessions in Redis (`AuthKeys.user_sessions`), and a change of role rewrites the role held by each
  of them, while disabling or deleting the user (or resetting its password) ends them (a password
  reset keeps the session that made it). The per-call cost is unchanged (one GET of the session).
  Each session remembers the user's `version` it holds, and only older sessions are rewritten, so
  concurrent changes cannot leave a session with a superseded role; a login that raced a change
  reads the user again once its session is indexed, and adopts the change or ends that session.
* API keys: random secrets shown once; PostgreSQL keeps only their SHA-256.
* Tokens carry a kind prefix (`st_` session, `sk_` API key) so a call is checked against one store,
  and secret scanners can recognise leaked keys.
* Roles are ordered: viewer < operator < admin. `METHOD_ROLES` maps every full method name to the
  least role that may call it; a method missing from it is refused (deny by default). The `worker`
  role (API keys only) stands apart from that order: it may call the methods mapped to it
  (`WorkerService.Connect` and its unary fallback) and nothing else, and no other role may call those (an admin key on a
  worker host would be an admin key on every worker host).
* Login throttling (the README's "Login throttling" section is the policy): every attempt is
  reserved in Redis BEFORE its password is hashed, by one script that checks the limits and counts
  the attempt as a failure (`login_reserve.lua`); the right password releases it. Hard limits:
  `MAX_FAILURES_PER_PAIR` per (username, address) and `MAX_FAILURES_PER_PEER` per address, within
  `LOGIN_FAILURE_WINDOW`. Soft limit per username, from anywhere: past `SOFT_FAILURES_PER_USERNAME`
  failures its attempts are spaced by a delay that doubles with each failure up to
  `MAX_LOGIN_SPACING`, in two lanes, so addresses that failed never delay one that did not: guessing
  from elsewhere never locks the right password out of a clean address, and an address that logged
  in as the username within `KNOWN_ADDRESS_TTL` is not spaced at all. Refusals are
  RESOURCE_EXHAUSTED saying when to retry, and cost no hashing.
* At most `MAX_CONCURRENT_HASHES` password checks run at once and `MAX_QUEUED_LOGINS` more wait;
  beyond, a login is refused at once with RESOURCE_EXHAUSTED (a flood is shed, not queued).
* Unknown users cost one hash verification too, against a dummy hash, so timing does not tell
  which names exist; every failure has the same message.
* Every call's bearer token is looked up in its store (Redis for a session, PostgreSQL for an API
  key) at most once per `PRINCIPAL_CACHE_TTL` per server process: a bounded in-process LRU of token
  hash -> principal (`PRINCIPAL_CACHE_SIZE` entries) answers the rest. The trade: a session ended or
  an API key revoked **on another server process** (or a session expiring, or deleted from Redis by
  hand, or a user changed elsewhere) is still accepted as it was by this one for up to
  `PRINCIPAL_CACHE_TTL`; `Logout`, `RevokeApiKey` and a change to a user drop the entries at once
  in the process that served them. Failures are never cached. An API key's
  `last_used_at` is refreshed only when the key is looked up, so at most once per TTL per process.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import enum
import hashlib
import logging
import math
import re
import secrets
import time
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final, Literal

import orjson
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from scheduler_grpc import scripts
from scheduler_grpc.db.api_keys import ApiKeyPage, ApiKeyRepository
from scheduler_grpc.db.api_keys import ApiKeyRecord as ApiKeyRecord  # noqa: PLC0414 - re-exported: what key reads return
from scheduler_grpc.db.users import User, UserRepository
from scheduler_grpc.errors import ConfigError, InvalidArgument, SchedulerError
from scheduler_grpc.keys import AuthKeys

log = logging.getLogger(__name__)

SESSION_PREFIX: Final = "st_"
API_KEY_PREFIX: Final = "sk_"
# Characters of an API key stored (and shown) to tell keys apart: the prefix plus 8 random ones.
KEY_PREFIX_LENGTH: Final = len(API_KEY_PREFIX) + 8
LOGIN_FAILURE_WINDOW: Final = timedelta(minutes=15)
# Per (username, address), hard: stops one client guessing one account's password. Per address,
# hard: stops one client spraying names. Neither touches the same account used from elsewhere.
MAX_FAILURES_PER_PAIR: Final = 10
MAX_FAILURES_PER_PEER: Final = 30
# Per username from anywhere, soft: past this many failures, attempts are spaced (first by
# LOGIN_SPACING, doubling with each failure, up to MAX_LOGIN_SPACING), which slows a guesser spread
# over many addresses without ever locking the account out.
SOFT_FAILURES_PER_USERNAME: Final = 5
LOGIN_SPACING: Final = timedelta(seconds=1)
MAX_LOGIN_SPACING: Final = timedelta(seconds=30)
# An address the right password came from is "known" for that username this long: it is exempt from
# the soft spacing (the way identity services trust a familiar device), so its user always gets in.
KNOWN_ADDRESS_TTL: Final = timedelta(days=30)
# argon2id with the library's RFC 9106 profile needs 64 MiB per hash: bound how many run at once,
# and how many logins may wait for one (a few hashing rounds, ~1 s); a flood beyond is refused at
# once instead of queueing until the call's deadline.
MAX_CONCURRENT_HASHES: Final = 4
MAX_QUEUED_LOGINS: Final = 16
MAX_PASSWORD_LENGTH: Final = 1024
# The users table's CHECK on usernames (migration 0001).
USERNAME: Final = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
DEV_ADMIN_PASSWORD: Final = "admin123"
MIN_PRODUCTION_PASSWORD_LENGTH: Final = 12
# A user whose sessions number more than this in its index has the index pruned of expired ones
# on its next login (the index expires with the newest session; this bounds it in between).
MAX_INDEXED_SESSIONS: Final = 256
# Session keys per call of the re-scoping script (a user may have many sessions).
SESSIONS_PER_SCRIPT: Final = 500
_INVALID_CREDENTIALS: Final = "invalid username or password"
# The per-process cache of authenticated tokens (see the module docstring for what it trades).
# A few seconds: long enough that a busy client's calls skip the store lookup (which cost about a
# tenth of the server's CPU per cheap call), short enough that a logout or revocation elsewhere
# takes effect everywhere within it.
PRINCIPAL_CACHE_TTL: Final = timedelta(seconds=2)
PRINCIPAL_CACHE_SIZE: Final = 10_000


class Unauthenticated(SchedulerError):
    """No valid credentials came with the call."""


class PermissionDenied(SchedulerError):
    """The caller is known but its role does not allow the call."""


class ResourceExhausted(SchedulerError):
    """Too many attempts or too much load; the message says when or how to retry."""


class Role(enum.StrEnum):
    """A caller's rights; each of viewer, operator, admin includes the rights of the ones before it.
    `worker` (API keys only) serves runs (`WorkerService`) and may do nothing else."""

    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"
    WORKER = "worker"

    @property
    def rank(self) -> int:
        return _RANKS[self]

    def allows(self, needed: Role) -> bool:
        """Whether this role has the rights of `needed` (`worker` only those of `worker`, and only
        `worker` has them)."""
        if needed is Role.WORKER or self is Role.WORKER:
            return self is needed
        return self.rank >= needed.rank


# The worker role is outside the order (see `Role.allows`): rank 0, never compared.
_RANKS: Final = {Role.WORKER: 0, Role.VIEWER: 1, Role.OPERATOR: 2, Role.ADMIN: 3}
USER_ROLES: Final = (Role.VIEWER, Role.OPERATOR, Role.ADMIN)
"""The roles a user may have (`worker` is for API keys only)."""

PUBLIC: Final = None
"""The 'least role' of methods any caller may use without credentials."""

_V = Role.VIEWER
_O = Role.OPERATOR
_A = Role.ADMIN
_W = Role.WORKER

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
    "/scheduler.v1.JobService/BatchTriggerJobs": _O,
    "/scheduler.v1.JobService/PreviewSchedule": _V,
    "/scheduler.v1.JobService/BackfillJob": _A,
    "/scheduler.v1.JobService/BatchPauseJobs": _O,
    "/scheduler.v1.JobService/BatchResumeJobs": _O,
    "/scheduler.v1.JobService/BatchDeleteJobs": _A,
    "/scheduler.v1.ExecutionService/GetExecution": _V,
    "/scheduler.v1.ExecutionService/ListExecutions": _V,
    "/scheduler.v1.ExecutionService/CancelExecution": _O,
    "/scheduler.v1.ExecutionService/WatchExecutions": _V,
    "/scheduler.v1.ExecutionService/GetFlowRun": _V,
    "/scheduler.v1.ExecutionService/CancelFlowRun": _O,
    "/scheduler.v1.ExecutionService/BatchCancelExecutions": _O,
    "/scheduler.v1.ExecutionService/BatchRetryExecutions": _O,
    "/scheduler.v1.ExecutionService/ListFlowRuns": _V,
    "/scheduler.v1.QueueService/GetQueueStats": _V,
    "/scheduler.v1.QueueService/ListDeadLetters": _V,
    "/scheduler.v1.QueueService/RequeueDeadLetters": _O,
    "/scheduler.v1.QueueService/PurgeDeadLetters": _A,
    # Shard counts: viewers read them, admins set them (deployment configuration, as limits are).
    "/scheduler.v1.QueueService/GetQueueShards": _V,
    "/scheduler.v1.QueueService/ListQueueShards": _V,
    "/scheduler.v1.QueueService/SetQueueShards": _A,
    "/scheduler.v1.ClusterService/ListWorkers": _V,
    "/scheduler.v1.ClusterService/GetSchedulerStatus": _V,
    "/scheduler.v1.ClusterService/ListHandlers": _V,
    # Users: admins only, reading included (a list of who may log in helps an attacker choose).
    "/scheduler.v1.UserService/CreateUser": _A,
    "/scheduler.v1.UserService/GetUser": _A,
    "/scheduler.v1.UserService/ListUsers": _A,
    "/scheduler.v1.UserService/UpdateUser": _A,
    "/scheduler.v1.UserService/DeleteUser": _A,
    "/scheduler.v1.UserService/DisableUser": _A,
    "/scheduler.v1.UserService/EnableUser": _A,
    "/scheduler.v1.UserService/ResetUserPassword": _A,
    # Limits: viewers read them, admins define them (as they define the jobs that name them).
    "/scheduler.v1.LimitService/CreateLimit": _A,
    "/scheduler.v1.LimitService/GetLimit": _V,
    "/scheduler.v1.LimitService/ListLimits": _V,
    "/scheduler.v1.LimitService/UpdateLimit": _A,
    "/scheduler.v1.LimitService/DeleteLimit": _A,
    "/scheduler.v1.LimitService/SetLimitOverride": _A,
    # Limit keys: viewers read them, operators pause and resume them (as they pause jobs).
    "/scheduler.v1.LimitService/GetLimitKey": _V,
    "/scheduler.v1.LimitService/PauseLimitKey": _O,
    "/scheduler.v1.LimitService/ResumeLimitKey": _O,
    # Remote workers (issue 23): worker API keys only, and they may call nothing else.
    "/scheduler.v1.WorkerService/Connect": _W,
    "/scheduler.v1.WorkerService/OpenWorkerSession": _W,
    "/scheduler.v1.WorkerService/PollWorkerSession": _W,
    "/scheduler.v1.WorkerService/CloseWorkerSession": _W,
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


def parse_bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The token of the one `authorization: Bearer <token>` metadata entry.

    Args:
        metadata: The call's metadata as (key, value) pairs, repeated keys included.

    Raises:
        Unauthenticated: no such entry, more than one (which would win depends on who reads them,
            so a proxy and this server could disagree about the caller), or not a bearer token.
    """
    values = [value for key, value in metadata or () if key.lower() == "authorization"]
    if not values:
        raise Unauthenticated("this call needs `authorization: Bearer <token>` metadata")
    if len(values) > 1:
        raise Unauthenticated(f"the call carries {len(values)} `authorization` metadata entries; send exactly one")
    raw = values[0]
    value = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated("the authorization metadata must be `Bearer <token>`")
    return token


# What login_reserve.lua's first reply element means when the attempt is refused.
_REFUSALS: Final = {
    1: "too many failed logins for this user from your address",
    2: "too many failed logins from your address",
    3: "too many failed logins for this user just now",
}


def _retry_after(milliseconds: int) -> str:
    return f"try again in {max(1, math.ceil(milliseconds / 1000))} s"


class Authenticator:
    """Checks credentials and issues sessions and API keys.

    Args:
        redis: Where sessions and login counters live.
        users: The users table.
        api_keys: The API keys table.
        session_ttl: How long a session lasts.
        timeout: Bound on each Redis call.
        hasher: The argon2id hasher (tests may pass cheaper parameters).
        max_queued_logins: Logins that may wait for a hashing slot; more are refused at once.
        cache_ttl: How long an authenticated token is trusted without asking its store again.
        cache_size: Most tokens cached at once (least recently used ones are dropped first).
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
        max_queued_logins: int = MAX_QUEUED_LOGINS,
        cache_ttl: timedelta = PRINCIPAL_CACHE_TTL,
        cache_size: int = PRINCIPAL_CACHE_SIZE,
    ) -> None:
        self._redis = redis
        self._users = users
        self.api_keys = api_keys
        self._session_ttl = session_ttl
        self._timeout = timeout.total_seconds()
        self._hasher = hasher or PasswordHasher()
        self._hashing = asyncio.Semaphore(MAX_CONCURRENT_HASHES)
        # Logins admitted (hashing or waiting to): taken without waiting, or the login is shed.
        self._admitted = asyncio.Semaphore(MAX_CONCURRENT_HASHES + max_queued_logins)
        self._keys = AuthKeys()
        self._dummy_hash: str | None = None
        self._reserve: AsyncScript = redis.register_script(scripts.source("login_reserve"))
        self._release: AsyncScript = redis.register_script(scripts.source("login_release"))
        self._sessions: AsyncScript = redis.register_script(scripts.source("auth_sessions"))
        self._cache_ttl = cache_ttl.total_seconds()
        self._cache_size = cache_size
        # token hash -> (monotonic time the entry stops being trusted, principal); oldest use first.
        self._cache: collections.OrderedDict[bytes, tuple[float, Principal]] = collections.OrderedDict()

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
                promoted = await self._users.set_role(existing.id, Role.ADMIN.value)
                await self.rescope_sessions(promoted)
                return promoted
            return existing
        user = await self._users.upsert(username, await self.hash_password(password), Role.ADMIN.value)
        if existing is not None:  # a new password from the environment: the old one's sessions end
            await self.end_sessions(user.id, user.version)
        return user

    # -- sessions -------------------------------------------------------------------------------

    async def login(self, username: str, password: str, peer: str) -> Session:
        """Check a username and password and open a session.

        Raises:
            InvalidArgument: an empty username or an oversized password.
            ResourceExhausted: a throttle refused the attempt (too many recent failures for this
                username from this address, from this address, or for this username just now), or
                too many logins are being checked already; the message says when to retry.
            Unauthenticated: wrong credentials (one message for every cause).
        """
        if not username:
            raise InvalidArgument("username", "must not be empty")
        if not USERNAME.fullmatch(username):
            # No such user can exist (the users table has the same rule), and a NUL or a megabyte
            # of name must reach neither PostgreSQL nor a Redis key.
            raise InvalidArgument("username", "must be 1-64 characters among A-Z a-z 0-9 _ . @ -")
        if len(password) > MAX_PASSWORD_LENGTH:
            raise InvalidArgument("password", f"must be at most {MAX_PASSWORD_LENGTH} characters")
        if self._admitted.locked():
            raise ResourceExhausted("too many logins are being checked right now; try again in 1 s")
        async with self._admitted:
            address = peer_address(peer)
            keys = [
                self._keys.failures_by_pair(username, address),
                self._keys.failures_by_peer(address),
                self._keys.failures_by_username(username),
            ]
            await self._reserve_attempt(keys, username, address)
            try:
                user = await self._users.get_by_username(username)
                if user is None or user.disabled:
                    # The same work as a real check, so the answer's timing does not reveal the name.
                    await self._verify(await self._dummy(), password)
                    ok = False
                else:
                    ok = await self._verify(user.password_hash, password)
            except Exception:
                # No password was judged (a store failed): the attempt is not a failure.
                await self._release_attempt(keys, username, address, succeeded=False)
                raise
            if not ok or user is None:
                log.info("login failed", extra={"username": username[:64], "peer": address})
                raise Unauthenticated(_INVALID_CREDENTIALS)
            await self._release_attempt(keys, username, address, succeeded=True)
        verified = {user.password_hash}
        if self._hasher.check_needs_rehash(user.password_hash):
            rehash = await self.hash_password(password)
            await self._users.set_password_hash(user.id, rehash)
            verified.add(rehash)
        session = await self.open_session(user)
        return await self._settle(session, user, verified, password)

    async def _settle(self, session: Session, user: User, verified: set[str], password: str) -> Session:
        """`session` as the user now stands, read again once the session is in the user's index.

        A change made while the password was being checked re-scoped the sessions indexed before it
        (not this one, maybe): a change that came later than that read is seen here and applied. A
        new hash of the same password (another server writing the admin's password at start-up, with
        its own salt) is not a reset: the password checked is still the user's.

        Raises:
            Unauthenticated: the user was meanwhile disabled or deleted, or its password reset.
        """
        fresh = await self._users.find(user.id)
        if fresh is not None and fresh.version == user.version:
            return session
        digest = hash_token(session.token)
        if (
            fresh is not None
            and fresh.password_hash not in verified
            and await self._verify(fresh.password_hash, password)
        ):
            verified.add(fresh.password_hash)
        if fresh is None or fresh.disabled or fresh.password_hash not in verified:
            async with asyncio.timeout(self._timeout):
                await self._redis.delete(self._keys.session(digest))
            raise Unauthenticated(_INVALID_CREDENTIALS)
        await self._run_sessions(fresh.id, [digest.hex()], "role", fresh.version, role=fresh.role)
        return Session(session.token, session.expire_time, Role(fresh.role))

    async def _reserve_attempt(self, keys: list[str], username: str, address: str) -> None:
        """Count the attempt as a failure before its password is checked, or refuse it."""
        args = [
            MAX_FAILURES_PER_PAIR,
            MAX_FAILURES_PER_PEER,
            SOFT_FAILURES_PER_USERNAME,
            int(LOGIN_SPACING.total_seconds() * 1000),
            int(MAX_LOGIN_SPACING.total_seconds() * 1000),
            int(LOGIN_FAILURE_WINDOW.total_seconds() * 1000),
        ]
        async with asyncio.timeout(self._timeout):
            refusal, wait_ms = await self._reserve(
                keys=[*keys, self._keys.login_slots(username), self._keys.known_address(username, address)], args=args
            )
        if refusal:
            raise ResourceExhausted(f"{_REFUSALS[int(refusal)]}; {_retry_after(int(wait_ms))}")

    async def _release_attempt(self, keys: list[str], username: str, address: str, *, succeeded: bool) -> None:
        """Undo the reservation (the attempt was no failure); on success remember the address."""
        known = self._keys.known_address(username, address)
        ttl_ms = int(KNOWN_ADDRESS_TTL.total_seconds() * 1000)
        async with asyncio.timeout(self._timeout):
            await self._release(keys=[*keys, known], args=[int(succeeded), ttl_ms])

    async def open_session(self, user: User) -> Session:
        """A new session for `user` (after its password was checked)."""
        token = SESSION_PREFIX + secrets.token_urlsafe(32)
        digest = hash_token(token)
        value = orjson.dumps({"user_id": user.id, "username": user.username, "role": user.role, "v": user.version})
        ttl_ms = int(self._session_ttl.total_seconds() * 1000)
        index = self._keys.user_sessions(user.id)
        async with asyncio.timeout(self._timeout):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self._keys.session(digest), value, px=ttl_ms)
                pipe.sadd(index, digest.hex())
                # Every session lasts the same: the index outlives each one by living as long as the newest.
                pipe.pexpire(index, ttl_ms)
                pipe.scard(index)
                indexed = (await pipe.execute())[-1]
        if int(indexed) > MAX_INDEXED_SESSIONS:
            await self._run_sessions(user.id, await self._indexed(user.id), "prune", 0)
        return Session(token, datetime.now(UTC) + self._session_ttl, Role(user.role))

    # -- a user's sessions after a change -------------------------------------------------------

    async def rescope_sessions(self, user: User) -> int:
        """Give every live session of `user` its current role (at once: in this process's cache too).

        Returns:
            How many sessions were re-scoped (those already at `user.version` are not counted).
        """
        return await self._run_sessions(user.id, await self._indexed(user.id), "role", user.version, role=user.role)

    async def end_sessions(self, user_id: str, version: int, *, keep: Principal | None = None) -> int:
        """End every session of a user older than `version` (the user's version after the change),
        except `keep`'s (the caller's own session, after it reset its own password).

        Returns:
            How many sessions were ended.
        """
        kept = self._keys.session(keep.token_hash) if keep is not None and keep.kind == "session" else ""
        return await self._run_sessions(user_id, await self._indexed(user_id), "end", version, keep=kept)

    async def _indexed(self, user_id: str) -> list[str]:
        async with asyncio.timeout(self._timeout):
            members = await self._redis.smembers(self._keys.user_sessions(user_id))
        return sorted(scripts.text(member) for member in members)

    async def _run_sessions(
        self, user_id: str, members: list[str], mode: str, version: int, *, role: str = "", keep: str = ""
    ) -> int:
        """`auth_sessions.lua` over `members` (in bounded batches), then forget the user's cached
        principals in this process, so its next call here reads the session as it now is."""
        changed = 0
        index = self._keys.user_sessions(user_id)
        for start in range(0, len(members), SESSIONS_PER_SCRIPT):
            batch = members[start : start + SESSIONS_PER_SCRIPT]
            keys = [index, *(self._keys.session(bytes.fromhex(member)) for member in batch if _is_hex(member))]
            async with asyncio.timeout(self._timeout):
                changed += int(await self._sessions(keys=keys, args=[mode, version, role, keep]))
        if mode != "prune":
            self._forget_user(user_id)
        return changed

    def _forget_user(self, user_id: str) -> None:
        """Drop this process's cached principals of the user's sessions (O(cache size): admin actions only)."""
        stale = [
            digest
            for digest, (_, principal) in self._cache.items()
            if principal.kind == "session" and principal.subject_id == user_id
        ]
        for digest in stale:
            del self._cache[digest]

    async def logout(self, principal: Principal) -> None:
        """End the caller's session at once.

        Raises:
            InvalidArgument: the caller used an API key (revoke it with RevokeApiKey instead).
        """
        if principal.kind != "session":
            raise InvalidArgument("authorization", "Logout ends sessions; revoke an API key with RevokeApiKey")
        self._cache.pop(principal.token_hash, None)
        async with asyncio.timeout(self._timeout):
            await self._redis.delete(self._keys.session(principal.token_hash))

    async def list_api_keys(self, page_size: int, page_token: str) -> ApiKeyPage:
        """A page of API keys, newest first (`next_page_token` resumes after it).

        Raises:
            InvalidArgument: `page_size` out of range or a malformed `page_token`.
        """
        return await self.api_keys.list_page(page_size, page_token)

    async def revoke_api_key(self, key_id: str) -> ApiKeyRecord:
        """Revoke an API key at once (in this process; elsewhere within `PRINCIPAL_CACHE_TTL`).

        Raises:
            InvalidArgument: `key_id` is not a UUID.
            NotFound: no such key.
        """
        record = await self.api_keys.revoke(key_id)
        stale = [
            digest
            for digest, (_, principal) in self._cache.items()
            if principal.kind == "api_key" and principal.subject_id == record.id
        ]
        for digest in stale:
            del self._cache[digest]
        return record

    # -- every call -----------------------------------------------------------------------------

    async def authenticate(self, token: str) -> Principal:
        """The caller a bearer token stands for (from the cache while its entry is fresh).

        Raises:
            Unauthenticated: unknown, expired, revoked or malformed token.
        """
        digest = hash_token(token)
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None:
            if cached[0] > now:
                self._cache.move_to_end(digest)
                return cached[1]
            del self._cache[digest]
        principal = await self._lookup(token, digest)
        self._cache[digest] = (now + self._cache_ttl, principal)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return principal

    async def _lookup(self, token: str, digest: bytes) -> Principal:
        """The caller `token` stands for, asked of its store."""
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


def _is_hex(value: str) -> bool:
    """Whether an index member is a token hash (anything else in the set is ignored)."""
    try:
        return len(bytes.fromhex(value)) == hashlib.sha256().digest_size
    except ValueError:
        return False


def admin_password(
    settings_password: str | None, *, production: bool, loopback: bool, exposed_by: Sequence[str] = ()
) -> str:
    """The start-up admin's password.

    Only in dev, listening on loopback only (the gRPC API and the web console alike), may it fall
    back to `DEV_ADMIN_PASSWORD` (the caller logs a warning then). `exposed_by` names the settings
    that listen beyond loopback, for the error.

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
        where = " and ".join(exposed_by) or "SCHEDULER_GRPC_HOST"
        raise ConfigError(f"SCHEDULER_ADMIN_PASSWORD must be set when the server listens beyond loopback ({where})")
    return DEV_ADMIN_PASSWORD
