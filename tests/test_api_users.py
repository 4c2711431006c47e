"""User management over gRPC (issue 21, defect 3): CRUD, admin-only rights, the last-admin guard,
and changes reaching the user's live sessions at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2
from redis.asyncio import Redis
from scheduler_client.v1 import auth_pb2, users_pb2, users_pb2_grpc

from scheduler_grpc import auth
from scheduler_grpc.auth import METHOD_ROLES
from scheduler_grpc.keys import AuthKeys
from tests.test_api_auth import call, full_name, methods
from tests.test_api_support import (  # noqa: F401 - `api` is a fixture
    ADMIN_PASSWORD,
    Harness,
    Metadata,
    api,
    bearer,
)

PASSWORD = "correct-horse-battery"
NEW_PASSWORD = "another-long-password"


def users(harness: Harness) -> users_pb2_grpc.UserServiceStub:
    return users_pb2_grpc.UserServiceStub(harness.channel)


async def status_of(call_: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    """The status code and message a call ends with (OK and '' if it succeeded)."""
    try:
        await call_
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


async def create(harness: Harness, username: str, role: int, password: str = PASSWORD) -> users_pb2.User:
    request = users_pb2.CreateUserRequest(user=users_pb2.User(username=username, role=role), password=password)
    return (await users(harness).CreateUser(request, metadata=harness.admin)).user


async def log_in(harness: Harness, username: str, password: str = PASSWORD) -> Metadata:
    login = await harness.auth.Login(auth_pb2.LoginRequest(username=username, password=password))
    return bearer(login.token)


async def whoami(harness: Harness, metadata: Metadata) -> tuple[grpc.StatusCode, int]:
    try:
        me = await harness.auth.WhoAmI(auth_pb2.WhoAmIRequest(), metadata=metadata)
    except grpc.aio.AioRpcError as error:
        return error.code(), 0
    return grpc.StatusCode.OK, me.role


def list_users(harness: Harness, metadata: Metadata) -> Awaitable[users_pb2.ListUsersResponse]:
    return users(harness).ListUsers(users_pb2.ListUsersRequest(), metadata=metadata)  # type: ignore[no-any-return]


async def test_every_user_rpc_is_admin_only(api: Harness) -> None:  # noqa: F811
    user_methods = list(methods(users_pb2))
    assert {m.name for m in user_methods} == {
        "CreateUser", "GetUser", "ListUsers", "UpdateUser", "DeleteUser", "DisableUser", "EnableUser",
        "ResetUserPassword",
    }  # fmt: skip
    for method in user_methods:
        assert METHOD_ROLES[full_name(method)] is auth.Role.ADMIN
        for metadata in (api.viewer, api.operator):
            assert await call(api, method, metadata) == grpc.StatusCode.PERMISSION_DENIED, method.name
        assert await call(api, method) == grpc.StatusCode.UNAUTHENTICATED, method.name


async def test_create_get_list_update_disable_enable_and_delete(api: Harness) -> None:  # noqa: F811
    stub = users(api)
    request = users_pb2.CreateUserRequest(
        user=users_pb2.User(username="ops.anna", role=auth_pb2.ROLE_OPERATOR), password=PASSWORD, request_id="r-1"
    )
    created = (await stub.CreateUser(request, metadata=api.admin)).user
    assert (created.username, created.role, created.state) == (
        "ops.anna",
        auth_pb2.ROLE_OPERATOR,
        users_pb2.USER_STATE_ACTIVE,
    )
    assert created.etag
    assert created.HasField("create_time")
    # The same request_id: the same user, nothing created twice.
    assert (await stub.CreateUser(request, metadata=api.admin)).user.id == created.id
    code, message = await status_of(
        stub.CreateUser(
            users_pb2.CreateUserRequest(user=users_pb2.User(username="ops.anna", role=1), password=PASSWORD),
            metadata=api.admin,
        )
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS, message
    # The password is never in any answer, nor in the table in clear.
    got = (await stub.GetUser(users_pb2.GetUserRequest(id=created.id), metadata=api.admin)).user
    assert got == created
    assert PASSWORD not in str(got)
    listed = await list_users(api, api.admin)
    assert [u.username for u in listed.users] == sorted(["admin", "ops.anna", "olivia", "victor"])
    # Paging by username.
    first = await stub.ListUsers(users_pb2.ListUsersRequest(page_size=3), metadata=api.admin)
    rest = await stub.ListUsers(
        users_pb2.ListUsersRequest(page_size=3, page_token=first.next_page_token), metadata=api.admin
    )
    assert [u.username for u in [*first.users, *rest.users]] == [u.username for u in listed.users]
    assert rest.next_page_token == ""

    update = users_pb2.UpdateUserRequest(
        user=users_pb2.User(id=created.id, role=auth_pb2.ROLE_VIEWER),
        update_mask=field_mask_pb2.FieldMask(paths=["role"]),
        etag=created.etag,
    )
    updated = (await stub.UpdateUser(update, metadata=api.admin)).user
    assert updated.role == auth_pb2.ROLE_VIEWER
    assert updated.etag != created.etag
    # The etag it was read with is stale now.
    code, message = await status_of(stub.UpdateUser(update, metadata=api.admin))
    assert (code, message.split(":")[0]) == (grpc.StatusCode.ABORTED, "etag")

    disabled = (await stub.DisableUser(users_pb2.DisableUserRequest(id=created.id), metadata=api.admin)).user
    assert disabled.state == users_pb2.USER_STATE_DISABLED
    code, _ = await status_of(log_in(api, "ops.anna"))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    enabled = (await stub.EnableUser(users_pb2.EnableUserRequest(id=created.id), metadata=api.admin)).user
    assert enabled.state == users_pb2.USER_STATE_ACTIVE
    assert await whoami(api, await log_in(api, "ops.anna")) == (grpc.StatusCode.OK, auth_pb2.ROLE_VIEWER)

    await stub.DeleteUser(users_pb2.DeleteUserRequest(id=created.id, etag=enabled.etag), metadata=api.admin)
    code, _ = await status_of(stub.GetUser(users_pb2.GetUserRequest(id=created.id), metadata=api.admin))
    assert code == grpc.StatusCode.NOT_FOUND


SOME_ID = "00000000-0000-0000-0000-000000000001"


def new_user(
    username: str = "a", role: int = 1, password: str = PASSWORD, **fields: Any
) -> users_pb2.CreateUserRequest:
    return users_pb2.CreateUserRequest(user=users_pb2.User(username=username, role=role), password=password, **fields)


def role_update(*paths: str, **fields: Any) -> users_pb2.UpdateUserRequest:
    mask = field_mask_pb2.FieldMask(paths=list(paths))
    return users_pb2.UpdateUserRequest(user=users_pb2.User(id=SOME_ID, role=1), update_mask=mask, **fields)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (new_user("x y"), "user.username"),
        (new_user(""), "user.username"),
        (new_user(password="short"), "password"),
        (new_user(password="x" * 1025), "password"),
        (new_user(role=0), "user.role"),
        (users_pb2.CreateUserRequest(password=PASSWORD), "user"),
        (new_user(request_id="r" * 129), "request_id"),
        (users_pb2.GetUserRequest(id="nope"), "id"),
        (users_pb2.ListUsersRequest(page_token="forged"), "page_token"),
        (users_pb2.ListUsersRequest(page_size=1001), "page_size"),
        (role_update("username"), "update_mask"),
        (role_update("state"), "update_mask"),
        (role_update(etag="v1"), "etag"),
        (users_pb2.ResetUserPasswordRequest(id=SOME_ID, new_password="admin123"), "new_password"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(api: Harness, request_: Any, field: str) -> None:  # noqa: F811
    stub = users(api)
    method: Callable[..., Awaitable[Any]] = getattr(stub, type(request_).__name__.removesuffix("Request"))
    code, message = await status_of(method(request_, metadata=api.admin))
    assert (code, message.split(":")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, field), message
    assert "admin123" not in message
    assert PASSWORD not in message


async def test_a_demoted_admins_live_session_loses_admin_rights_at_once(api: Harness) -> None:  # noqa: F811
    ada = await create(api, "ada", auth_pb2.ROLE_ADMIN)
    session = await log_in(api, "ada")
    await list_users(api, session)  # an admin now (and the principal is cached in the server)
    stub = users(api)
    demote = users_pb2.UpdateUserRequest(user=users_pb2.User(id=ada.id, role=auth_pb2.ROLE_VIEWER))
    await stub.UpdateUser(demote, metadata=api.admin)
    # The very next call of the same session, within the token cache's lifetime: a viewer.
    code, _ = await status_of(list_users(api, session))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert await whoami(api, session) == (grpc.StatusCode.OK, auth_pb2.ROLE_VIEWER)
    # Promotion reaches the live session the same way.
    promote = users_pb2.UpdateUserRequest(user=users_pb2.User(id=ada.id, role=auth_pb2.ROLE_OPERATOR))
    await stub.UpdateUser(promote, metadata=api.admin)
    assert await whoami(api, session) == (grpc.StatusCode.OK, auth_pb2.ROLE_OPERATOR)


async def test_another_process_sees_the_new_role_within_the_cache_ttl(api: Harness) -> None:  # noqa: F811
    from datetime import timedelta

    from tests.test_api_auth import cached_authenticator

    ttl = timedelta(seconds=1)
    elsewhere = cached_authenticator(api, ttl)
    ada = await create(api, "ada", auth_pb2.ROLE_ADMIN)
    token = (await api.auth.Login(auth_pb2.LoginRequest(username="ada", password=PASSWORD))).token
    assert (await elsewhere.authenticate(token)).role is auth.Role.ADMIN  # cached there now
    demote = users_pb2.UpdateUserRequest(user=users_pb2.User(id=ada.id, role=auth_pb2.ROLE_VIEWER))
    await users(api).UpdateUser(demote, metadata=api.admin)

    async def demoted() -> bool:
        return (await elsewhere.authenticate(token)).role is auth.Role.VIEWER

    from tests.engine_helpers import eventually

    await eventually(demoted, within=5 * ttl.total_seconds())


async def test_disabling_or_deleting_a_user_ends_all_its_sessions_at_once(api: Harness, redis: Redis) -> None:  # noqa: F811
    bob = await create(api, "bob", auth_pb2.ROLE_OPERATOR)
    sessions = [await log_in(api, "bob") for _ in range(3)]
    for session in sessions:
        assert await whoami(api, session) == (grpc.StatusCode.OK, auth_pb2.ROLE_OPERATOR)
    await users(api).DisableUser(users_pb2.DisableUserRequest(id=bob.id), metadata=api.admin)
    for session in sessions:
        assert (await whoami(api, session))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert [key async for key in redis.scan_iter("{auth}:session:*")] != []  # other users' sessions stay
    assert await whoami(api, api.admin) == (grpc.StatusCode.OK, auth_pb2.ROLE_ADMIN)

    carl = await create(api, "carl", auth_pb2.ROLE_VIEWER)
    session = await log_in(api, "carl")
    assert (await whoami(api, session))[0] == grpc.StatusCode.OK
    await users(api).DeleteUser(users_pb2.DeleteUserRequest(id=carl.id), metadata=api.admin)
    assert (await whoami(api, session))[0] == grpc.StatusCode.UNAUTHENTICATED


async def test_a_password_reset_ends_the_users_other_sessions(api: Harness) -> None:  # noqa: F811
    dora = await create(api, "dora", auth_pb2.ROLE_VIEWER)
    old = [await log_in(api, "dora") for _ in range(2)]
    reset = users_pb2.ResetUserPasswordRequest(id=dora.id, new_password=NEW_PASSWORD)
    await users(api).ResetUserPassword(reset, metadata=api.admin)
    for session in old:
        assert (await whoami(api, session))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert (await status_of(log_in(api, "dora")))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert (await whoami(api, await log_in(api, "dora", NEW_PASSWORD)))[0] == grpc.StatusCode.OK
    # An admin resetting its own password keeps the session it did it with; its others end.
    admin = (await list_users(api, api.admin)).users[0]
    assert admin.username == "admin"
    other = await log_in(api, "admin", ADMIN_PASSWORD)
    own = users_pb2.ResetUserPasswordRequest(id=admin.id, new_password=NEW_PASSWORD)
    await users(api).ResetUserPassword(own, metadata=api.admin)
    assert (await whoami(api, api.admin))[0] == grpc.StatusCode.OK
    assert (await whoami(api, other))[0] == grpc.StatusCode.UNAUTHENTICATED


async def test_the_last_enabled_admin_cannot_be_demoted_disabled_or_deleted(api: Harness) -> None:  # noqa: F811
    stub = users(api)
    admin = (await list_users(api, api.admin)).users[0]
    assert (admin.username, admin.role) == ("admin", auth_pb2.ROLE_ADMIN)
    demote = users_pb2.UpdateUserRequest(user=users_pb2.User(id=admin.id, role=auth_pb2.ROLE_OPERATOR))
    for attempt in (
        stub.UpdateUser(demote, metadata=api.admin),
        stub.DisableUser(users_pb2.DisableUserRequest(id=admin.id), metadata=api.admin),
        stub.DeleteUser(users_pb2.DeleteUserRequest(id=admin.id), metadata=api.admin),
    ):
        code, message = await status_of(attempt)
        assert code == grpc.StatusCode.FAILED_PRECONDITION, message
        assert "last enabled admin" in message
    assert await whoami(api, api.admin) == (grpc.StatusCode.OK, auth_pb2.ROLE_ADMIN)
    # A disabled admin does not count: with only a disabled second admin, the first stays protected.
    eve = await create(api, "eve", auth_pb2.ROLE_ADMIN)
    await stub.DisableUser(users_pb2.DisableUserRequest(id=eve.id), metadata=api.admin)
    assert (await status_of(stub.UpdateUser(demote, metadata=api.admin)))[0] == grpc.StatusCode.FAILED_PRECONDITION
    # Two enabled admins demoting each other at once: exactly one of them wins.
    await stub.EnableUser(users_pb2.EnableUserRequest(id=eve.id), metadata=api.admin)
    eve_session = await log_in(api, "eve")
    demote_eve = users_pb2.UpdateUserRequest(user=users_pb2.User(id=eve.id, role=auth_pb2.ROLE_VIEWER))
    codes = await asyncio.gather(
        status_of(stub.UpdateUser(demote, metadata=eve_session)),
        status_of(stub.UpdateUser(demote_eve, metadata=api.admin)),
    )
    assert sorted(code.name for code, _ in codes) == ["FAILED_PRECONDITION", "OK"], codes
    page = await api.server.api.control.users.list_users()
    roles = {user.username: user.role for user in page.users}
    assert sorted([roles["admin"], roles["eve"]]) == ["admin", "operator" if codes[0][0] == grpc.StatusCode.OK
                                                      else "viewer"]  # fmt: skip


async def test_a_login_racing_a_change_adopts_it_or_ends(api: Harness, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A change committed while the password is being checked (after the user was read) still
    reaches the session that login opens."""
    authenticator = api.server.api.auth
    control = api.server.api.control
    fay = await create(api, "fay", auth_pb2.ROLE_ADMIN)
    real_verify = authenticator._verify
    change: list[Callable[[], Awaitable[Any]]] = []

    async def verify_then_change(password_hash: str, password: str) -> bool:
        ok = await real_verify(password_hash, password)
        while change:
            await change.pop()()
        return ok

    monkeypatch.setattr(authenticator, "_verify", verify_then_change)
    change.append(lambda: control.users.set_role(fay.id, auth.Role.VIEWER))
    session = await authenticator.login("fay", PASSWORD, "ipv4:192.0.2.1:1")
    assert session.role is auth.Role.VIEWER
    assert (await authenticator.authenticate(session.token)).role is auth.Role.VIEWER

    change.append(lambda: control.users.disable_user(fay.id))
    with pytest.raises(auth.Unauthenticated):
        await authenticator.login("fay", PASSWORD, "ipv4:192.0.2.1:1")
    await control.users.enable_user(fay.id)
    change.append(lambda: control.users.reset_password(api_principal(api), fay.id, NEW_PASSWORD))
    with pytest.raises(auth.Unauthenticated):
        await authenticator.login("fay", PASSWORD, "ipv4:192.0.2.1:1")
    sessions = [key async for key in control._redis.scan_iter("{auth}:session:*")]
    for key in sessions:
        raw = await control._redis.get(key)
        assert raw is None or b'"fay"' not in raw or b'"viewer"' in raw


def api_principal(harness: Harness) -> auth.Principal:
    """A principal standing for no session (a reset made outside any session keeps none)."""
    return auth.Principal("admin", auth.Role.ADMIN, "api_key", "", b"")


async def test_the_session_index_is_bounded_and_expires_with_the_sessions(api: Harness, redis: Redis) -> None:  # noqa: F811
    gus = await create(api, "gus", auth_pb2.ROLE_VIEWER)
    authenticator = api.server.api.auth
    user = await authenticator._users.get(gus.id)
    index = AuthKeys().user_sessions(gus.id)
    tokens = [(await authenticator.open_session(user)).token for _ in range(5)]
    assert await redis.scard(index) == 5
    assert 0 < await redis.pttl(index) <= 12 * 3600 * 1000
    # Members whose session expired are pruned once the index grows past its bound.
    await redis.delete(*(AuthKeys().session(auth.hash_token(token)) for token in tokens))
    await redis.sadd(index, *(f"{i:064x}" for i in range(auth.MAX_INDEXED_SESSIONS)))
    await authenticator.open_session(user)
    assert await redis.scard(index) == 1
