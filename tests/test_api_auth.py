"""Authentication and authorisation: the role table covers every RPC, tokens, sessions, API keys."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from redis.asyncio import Redis
from scheduler_client.v1 import auth_pb2, cluster_pb2, executions_pb2, jobs_pb2, queue_pb2

from scheduler_grpc import auth
from scheduler_grpc.auth import METHOD_ROLES, PUBLIC, Role
from scheduler_grpc.errors import ConfigError
from tests.test_api_support import ADMIN_PASSWORD, Harness, Metadata, api, bearer  # noqa: F401 - `api` is a fixture

API_MODULES = (auth_pb2, jobs_pb2, executions_pb2, queue_pb2, cluster_pb2)


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
    assert len(restricted) == 13
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
    for _ in range(auth.MAX_FAILURES_PER_USERNAME - 1):
        with pytest.raises(grpc.aio.AioRpcError):
            await api.auth.Login(auth_pb2.LoginRequest(username="admin", password="wrong"))
    # The limit holds even for the right password: guessing stops, whatever the guess.
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


async def test_api_keys_are_shown_once_stored_hashed_and_revocable(api: Harness) -> None:  # noqa: F811
    created = await api.auth.CreateApiKey(
        auth_pb2.CreateApiKeyRequest(display_name="ci", role=auth_pb2.ROLE_OPERATOR), metadata=api.admin
    )
    secret = created.secret
    assert secret.startswith("sk_")
    assert secret.startswith(created.api_key.key_prefix)
    pool = api.server.api.control.jobs._pool
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
