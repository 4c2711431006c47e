"""Authentication and authorisation: the role table covers every RPC, tokens, sessions, API keys."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from datetime import timedelta

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from redis.asyncio import Redis
from scheduler_client.v1 import auth_pb2, cluster_pb2, executions_pb2, jobs_pb2, limits_pb2, queue_pb2, users_pb2

from scheduler_grpc import auth
from scheduler_grpc.auth import METHOD_ROLES, PUBLIC, Authenticator, Role, Session
from scheduler_grpc.db.api_keys import ApiKeyRepository
from scheduler_grpc.db.users import User, UserRepository
from scheduler_grpc.errors import ConfigError
from scheduler_grpc.keys import AuthKeys
from tests.engine_helpers import eventually
from tests.test_api_support import (  # noqa: F401 - `api` is a fixture
    ADMIN_PASSWORD,
    FAST_HASHER,
    Harness,
    Metadata,
    api,
    bearer,
)

API_MODULES = (auth_pb2, jobs_pb2, executions_pb2, queue_pb2, cluster_pb2, users_pb2, limits_pb2)


def methods(*modules: object) -> Iterator[MethodDescriptor]:
    for module in modules:
        for service in module.DESCRIPTOR.services_by_name.values():  # type: ignore[attr-defined]
            yield from service.methods


def full_name(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


async def call(harness: Harness, method: MethodDescriptor, metadata: Metadata = ()) -> grpc.StatusCode:
    """Call `method` with an empty request; the status code it ends with (OK if it succeeded)."""
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    kwargs = {"request_serializer": request_class.SerializeToString, "response_deserializer": response_class.FromString}
    try:
        if method.server_streaming:
            stream = harness.channel.unary_stream(full_name(method), **kwargs)(request_class(), metadata=metadata)
            try:
                await stream.read()
            finally:
                stream.cancel()
        else:
            call_ = harness.channel.unary_unary(full_name(method), **kwargs)
            await call_(request_class(), metadata=metadata, timeout=10)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_every_rpc_of_every_service_is_in_the_role_table() -> None:
    served = {full_name(m) for m in methods(*API_MODULES, health_pb2, reflection_pb2)}
    missing = served - METHOD_ROLES.keys()
    assert not missing, f"RPCs without a least role (they would be refused): {sorted(missing)}"
    # Only Login, health and reflection are public.
    public = {name for name, role in METHOD_ROLES.items() if role is PUBLIC}
    assert public & {full_name(m) for m in methods(*API_MODULES)} == {"/scheduler.v1.AuthService/Login"}


def test_a_method_missing_from_the_table_is_refused() -> None:
    with pytest.raises(auth.PermissionDenied):
        auth.required_role("/scheduler.v1.JobService/DropEverything")


async def test_every_rpc_without_a_token_is_unauthenticated(api: Harness) -> None:  # noqa: F811
    codes = {full_name(m): await call(api, m) for m in methods(*API_MODULES) if METHOD_ROLES[full_name(m)]}
    assert codes
    assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    for metadata in (bearer("st_forged"), bearer("sk_forged"), (("authorization", "Basic abc"),)):
        assert await call(api, next(methods(jobs_pb2)), metadata) == grpc.StatusCode.UNAUTHENTICATED


async def test_every_rpc_refuses_a_role_too_small(api: Harness) -> None:  # noqa: F811
    too_small = {Role.OPERATOR: [api.viewer], Role.ADMIN: [api.viewer, api.operator]}
    codes: dict[str, list[grpc.StatusCode]] = {}
    for method in methods(*API_MODULES):
        needed = METHOD_ROLES[full_name(method)]
        for metadata in too_small.get(needed, []) if needed else []:
            codes.setdefault(full_name(method), []).append(await call(api, method, metadata))
    restricted = {full_name(m) for m in methods(*API_MODULES) if METHOD_ROLES[full_name(m)] in too_small}
    assert codes.keys() == restricted
    # CancelFlowRun (operator), the 8 of UserService (admin), the six Batch* methods, the four
    # LimitService writes (admin), its key pause and resume (operator) and SetQueueShards (admin) included
    assert len(restricted) == 35
    assert {code for found in codes.values() for code in found} == {grpc.StatusCode.PERMISSION_DENIED}, codes


async def test_login_whoami_logout(api: Harness, redis: Redis) -> None:  # noqa: F811
    login = await api.auth.Login(auth_pb2.LoginRequest(username="admin", password="admin123"))
    assert login.role == auth_pb2.ROLE_ADMIN
    assert login.token.startswith("st_")
    me = await api.auth.WhoAmI(auth_pb2.WhoAmIRequest(), metadata=bearer(login.token))
    assert (me.principal, me.role) == ("admin", auth_pb2.ROLE_ADMIN)
    # Redis holds the SHA-256 of the token only, never the token.
    keys = [key.decode() async for key in redis.scan_iter("{auth}:session:*")]
    assert f"{{auth}}:session:{hashlib.sha256(login.token.encode()).hexdigest()}" in keys
    for key in keys:
        assert login.token not in key
        assert login.token.encode() not in (await redis.get(key) or b"")
        assert 0 < await redis.ttl(key) <= 12 * 3600
    await api.auth.Logout(auth_pb2.LogoutRequest(), metadata=bearer(login.token))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.auth.WhoAmI(auth_pb2.WhoAmIRequest(), metadata=bearer(login.token))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_failed_logins_share_one_message_and_are_rate_limited(api: Harness) -> None:  # noqa: F811
    details = set()
    for username, password in [("admin", "wrong"), ("nobody", "wrong"), ("nobody", "admin123")]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await api.auth.Login(auth_pb2.LoginRequest(username=username, password=password))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        details.add(caught.value.details())
    assert details == {"invalid username or password"}
    for _ in range(auth.MAX_FAILURES_PER_PAIR - 1):
        with pytest.raises(grpc.aio.AioRpcError):
            await api.auth.Login(auth_pb2.LoginRequest(username="admin", password="wrong"))
    # The limit (of this username from this address) holds even for the right password: guessing
    # stops, whatever the guess.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.auth.Login(auth_pb2.LoginRequest(username="admin", password="admin123"))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_login_failures_are_also_limited_per_peer_address(api: Harness) -> None:  # noqa: F811
    authenticator = api.server.api.auth
    # One address spraying usernames: no single username comes near its own limit.
    for i in range(auth.MAX_FAILURES_PER_PEER):
        with pytest.raises(auth.Unauthenticated):
            await authenticator.login(f"user{i}", "guess", "ipv6:%5B2001:db8::7%5D:50000")
    # The same address from another source port, in either spelling, is the same peer.
    for peer in ("ipv6:%5B2001:db8::7%5D:50001", "ipv6:[2001:db8::7]:50002"):
        with pytest.raises(auth.ResourceExhausted):
            await authenticator.login("admin", ADMIN_PASSWORD, peer)
    # Another address is not held back by it.
    session = await authenticator.login("admin", ADMIN_PASSWORD, "ipv4:203.0.113.9:50000")
    assert session.token.startswith(auth.SESSION_PREFIX)


async def attempt(authenticator: Authenticator, username: str, password: str, peer: str) -> str:
    """One login: `ok`, `wrong` (the password was checked and refused) or `refused` (throttled, unchecked)."""
    try:
        await authenticator.login(username, password, peer)
    except auth.Unauthenticated:
        return "wrong"
    except auth.ResourceExhausted:
        return "refused"
    return "ok"


def wide_admission(harness: Harness) -> Authenticator:
    """An authenticator on the harness's stores that admits any number of logins at once, so only
    the failure limits (not the shedding of a flood) decide which attempts are checked."""
    pool = harness.server.api.control._pool
    return Authenticator(harness.server.api.control._redis, UserRepository(pool), ApiKeyRepository(pool),
                         session_ttl=timedelta(hours=1), hasher=FAST_HASHER, max_queued_logins=10_000)  # fmt: skip


async def test_concurrent_guesses_cannot_race_past_the_login_limits(api: Harness) -> None:  # noqa: F811
    authenticator = wide_admission(api)
    # 40 concurrent wrong passwords for one username from one address: at most its limit is checked.
    one_user = await asyncio.gather(
        *(attempt(authenticator, "admin", "wrong", "ipv4:198.51.100.1:1") for _ in range(40))
    )
    assert set(one_user) == {"wrong", "refused"}
    assert one_user.count("wrong") <= auth.MAX_FAILURES_PER_PAIR, one_user
    # 60 concurrent guesses spraying usernames from one address: exactly the per-address limit.
    spray = await asyncio.gather(
        *(attempt(authenticator, f"user{i}", "guess", "ipv4:198.51.100.2:1") for i in range(60))
    )
    assert spray.count("wrong") == auth.MAX_FAILURES_PER_PEER, spray
    # A burst of 60 guesses with the right password 46th does not get in.
    await api.token_for("carol", Role.VIEWER)  # password "irrelevant-password"
    guesses = ["irrelevant-password" if i == 45 else f"guess-{i}" for i in range(60)]
    burst = await asyncio.gather(*(attempt(authenticator, "carol", guess, "ipv4:198.51.100.3:1") for guess in guesses))
    assert "ok" not in burst
    assert burst.count("wrong") <= auth.MAX_FAILURES_PER_PAIR, burst


async def test_guessing_never_locks_the_right_password_out_of_a_clean_or_known_address(api: Harness) -> None:  # noqa: F811
    authenticator = api.server.api.auth
    attacker, owner = "ipv4:198.51.100.66:4000", "ipv4:203.0.113.5:5000"
    guesses = [await attempt(authenticator, "admin", "wrong", attacker) for _ in range(3 * auth.MAX_FAILURES_PER_PAIR)]
    assert guesses[-1] == "refused"
    assert guesses.count("wrong") <= auth.MAX_FAILURES_PER_PAIR
    assert await attempt(authenticator, "admin", ADMIN_PASSWORD, attacker) == "refused"
    # The same account from an address that has not failed: in at once, not locked out for 15 minutes.
    assert await attempt(authenticator, "admin", ADMIN_PASSWORD, owner) == "ok"
    # Guessing spread over many fresh addresses is slowed: after the soft threshold, one attempt per
    # growing delay is checked and the others are told when to retry (never more than the cap).
    spread: list[str] = []
    waits: list[int] = []
    for i in range(12):
        try:
            await authenticator.login("admin", "wrong", f"ipv4:192.0.2.{i}:1")
            spread.append("ok")
        except auth.Unauthenticated:
            spread.append("wrong")
        except auth.ResourceExhausted as refused:
            waits.append(int(str(refused).rsplit("try again in ", 1)[1].split()[0]))
            spread.append("refused")
    assert "ok" not in spread
    assert spread.count("wrong") <= 2, spread
    assert waits
    assert all(1 <= wait <= auth.MAX_LOGIN_SPACING.total_seconds() for wait in waits), waits
    # The owner's address, known since its login, is not held back by that at all.
    assert await attempt(authenticator, "admin", ADMIN_PASSWORD, owner) == "ok"


@pytest.mark.parametrize(("failures", "spacing"), [(5, 1), (6, 2), (8, 8), (40, 30)])
async def test_the_soft_spacing_doubles_with_each_failure_up_to_its_cap(
    api: Harness,  # noqa: F811
    redis: Redis,
    failures: int,
    spacing: int,
) -> None:
    keys = AuthKeys()
    await redis.set(keys.failures_by_username("dora"), failures, ex=60)  # as if guessed from elsewhere
    authenticator = api.server.api.auth
    assert await attempt(authenticator, "dora", "guess", "ipv4:192.0.2.200:1") == "wrong"
    with pytest.raises(auth.ResourceExhausted, match=f"for this user just now; try again in {spacing} s"):
        await authenticator.login("dora", "guess", "ipv4:192.0.2.201:1")


async def test_a_login_flood_is_shed_at_once_and_not_blamed_on_the_stores(api: Harness) -> None:  # noqa: F811
    authenticator = api.server.api.auth
    began = time.monotonic()
    flood = await asyncio.gather(
        *(attempt(authenticator, f"flood{i}", "guess", f"ipv4:10.1.{i // 250}.{i % 250}:1") for i in range(200))
    )
    assert flood.count("refused") >= 200 - auth.MAX_CONCURRENT_HASHES - auth.MAX_QUEUED_LOGINS, flood
    assert flood.count("wrong") >= auth.MAX_CONCURRENT_HASHES
    assert time.monotonic() - began < 10
    # Over gRPC a flood ends with client-error codes only, never UNAVAILABLE (the stores are up),
    # and a legitimate login goes through right after it.
    calls = [api.auth.Login(auth_pb2.LoginRequest(username=f"grpc{i}", password="guess")) for i in range(25)]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(outcome, grpc.aio.AioRpcError) for outcome in outcomes), outcomes
    codes = {outcome.code() for outcome in outcomes if isinstance(outcome, grpc.aio.AioRpcError)}
    assert codes <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    login = await api.auth.Login(auth_pb2.LoginRequest(username="admin", password=ADMIN_PASSWORD))
    assert login.token


@pytest.mark.parametrize("username", ["nul\x00byte", "x" * 65, "x" * 100_000, "ünïcode", "a b"])
async def test_a_username_no_user_can_have_is_invalid_argument(api: Harness, username: str) -> None:  # noqa: F811
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.auth.Login(auth_pb2.LoginRequest(username=username, password="guess"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("username: ")


async def test_two_authorization_headers_are_refused(api: Harness) -> None:  # noqa: F811
    both = (*api.admin, *api.viewer)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.auth.WhoAmI(auth_pb2.WhoAmIRequest(), metadata=both)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization" in (caught.value.details() or "")
    with pytest.raises(auth.Unauthenticated, match="exactly one"):
        auth.parse_bearer([("authorization", "Bearer a"), ("authorization", "Bearer a")])


async def test_api_keys_are_shown_once_stored_hashed_and_revocable(api: Harness) -> None:  # noqa: F811
    created = await api.auth.CreateApiKey(
        auth_pb2.CreateApiKeyRequest(display_name="ci", role=auth_pb2.ROLE_OPERATOR), metadata=api.admin
    )
    secret = created.secret
    assert secret.startswith("sk_")
    assert secret.startswith(created.api_key.key_prefix)
    pool = api.server.api.control._pool
    stored = await pool.fetchval("SELECT key_hash FROM api_keys WHERE id = $1::uuid", created.api_key.id)
    assert bytes(stored) == hashlib.sha256(secret.encode()).digest()
    me = await api.auth.WhoAmI(auth_pb2.WhoAmIRequest(), metadata=bearer(secret))
    assert (me.principal, me.role) == ("api-key:ci", auth_pb2.ROLE_OPERATOR)
    listed = await api.auth.ListApiKeys(auth_pb2.ListApiKeysRequest(), metadata=api.admin)
    assert [k.id for k in listed.api_keys] == [created.api_key.id]
    assert secret not in str(listed)
    assert listed.api_keys[0].HasField("last_use_time")
    revoked = await api.auth.RevokeApiKey(auth_pb2.RevokeApiKeyRequest(id=created.api_key.id), metadata=api.admin)
    assert revoked.api_key.HasField("revoke_time")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.auth.WhoAmI(auth_pb2.WhoAmIRequest(), metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.auth.CreateApiKey(auth_pb2.CreateApiKeyRequest(display_name="x"), metadata=api.admin)
    assert (caught.value.code(), caught.value.details().split(":")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, "role")


def cached_authenticator(harness: Harness, ttl: timedelta, size: int = 100) -> Authenticator:
    """Another server process's authenticator on the harness's stores, with its own token cache."""
    pool = harness.server.api.control._pool
    return Authenticator(
        harness.server.api.control._redis,
        UserRepository(pool),
        ApiKeyRepository(pool),
        session_ttl=timedelta(hours=1),
        hasher=FAST_HASHER,
        cache_ttl=ttl,
        cache_size=size,
    )


async def refuses(authenticator: Authenticator, token: str) -> bool:
    try:
        await authenticator.authenticate(token)
    except auth.Unauthenticated:
        return True
    return False


async def test_a_revoked_key_or_ended_session_is_refused_here_at_once_and_elsewhere_within_the_cache_ttl(
    api: Harness,  # noqa: F811
) -> None:
    ttl = timedelta(seconds=1)
    here, elsewhere = cached_authenticator(api, ttl), cached_authenticator(api, ttl)
    admin = await UserRepository(api.server.api.control._pool).get_by_username("admin")
    assert admin is not None
    session = await here.open_session(admin)
    creator = await here.authenticate(session.token)
    key = await here.create_api_key(creator, "cached", Role.VIEWER, None)
    for token in (session.token, key.secret):
        assert (await elsewhere.authenticate(token)).name in {"admin", "api-key:cached"}  # now cached there
    await here.revoke_api_key(key.record.id)
    await here.logout(creator)
    for token in (session.token, key.secret):
        assert await refuses(here, token)  # the process that ended it: at once
        # The documented trade: another process trusts its cached entry until the TTL runs out...
        assert not await refuses(elsewhere, token)
    began = time.monotonic()
    for token in (session.token, key.secret):
        await eventually(lambda token=token: refuses(elsewhere, token), within=5 * ttl.total_seconds())  # type: ignore[misc]
    # ... and no longer (the poll's own step aside).
    assert time.monotonic() - began <= ttl.total_seconds() + 1


async def test_the_token_cache_is_bounded_and_drops_the_least_recently_used(api: Harness) -> None:  # noqa: F811
    cache = cached_authenticator(api, timedelta(minutes=5), size=3)
    admin = await UserRepository(api.server.api.control._pool).get_by_username("admin")
    assert admin is not None
    tokens = [(await cache.open_session(admin)).token for _ in range(5)]
    for token in tokens[:3]:
        await cache.authenticate(token)
    await cache.authenticate(tokens[0])  # used again: now the most recent, so 1 and 2 go first
    for token in tokens[3:]:
        await cache.authenticate(token)
    redis = api.server.api.control._redis
    await redis.delete(*(AuthKeys().session(auth.hash_token(token)) for token in tokens))
    # Only the 3 most recently used are still cached (and so still accepted); the rest are asked of Redis.
    assert [await refuses(cache, token) for token in tokens] == [False, True, True, False, False]


async def test_shell_jobs_need_an_admin_even_if_the_table_let_operators_define_jobs(
    api: Harness,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(METHOD_ROLES, "/scheduler.v1.JobService/CreateJob", Role.OPERATOR)  # type: ignore[arg-type]
    shell = jobs_pb2.Job(name="sh", handler="shell.command")
    shell.payload.update({"command": ["true"]})
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=shell), metadata=api.operator)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "shell.command" in (caught.value.details() or "")
    ok = await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=jobs_pb2.Job(name="e", handler="test.echo")),
                                  metadata=api.operator)  # fmt: skip
    assert ok.job.id


@pytest.mark.parametrize(
    ("password", "production", "loopback", "expected"),
    [
        (None, False, True, "admin123"),
        ("s3cret-enough-pw", True, False, "s3cret-enough-pw"),
        (None, True, True, None),
        ("admin123", True, False, None),
        ("short", True, False, None),
        (None, False, False, None),
    ],
)
def test_admin_password_policy(password: str | None, production: bool, loopback: bool, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(ConfigError, match="SCHEDULER_ADMIN_PASSWORD"):
            auth.admin_password(password, production=production, loopback=loopback)
    else:
        assert auth.admin_password(password, production=production, loopback=loopback) == expected


async def test_a_login_survives_another_server_rehashing_the_same_password_meanwhile(
    api: Harness,  # noqa: F811
) -> None:
    """Two servers starting at once both write the admin's password (the same one, each with its own
    salt). A login checked against the first hash while the second lands is still the right password:
    it gets its session (a reset to another password meanwhile still ends it, see test_api_users)."""
    here = wide_admission(api)
    other = cached_authenticator(api, timedelta(seconds=1))
    await other.ensure_admin("admin", "first-password-1")
    opened = here.open_session

    async def rehashed_meanwhile(user: User) -> Session:
        await other._users.upsert("admin", await other.hash_password("first-password-1"), Role.ADMIN.value)
        return await opened(user)

    here.open_session = rehashed_meanwhile  # type: ignore[method-assign]
    session = await here.login("admin", "first-password-1", "ipv4:198.51.100.9:1")
    assert session.role is Role.ADMIN
    assert (await here.authenticate(session.token)).role is Role.ADMIN
