"""UserService: the people who log in (admin only; the rights are in `auth.METHOD_ROLES`)."""

from __future__ import annotations

import re
from typing import Any, Final

import grpc
from google.protobuf import field_mask_pb2
from scheduler_client.v1 import users_pb2, users_pb2_grpc

from scheduler_grpc.application import Api
from scheduler_grpc.auth import Role, current_principal
from scheduler_grpc.control_users import User
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.services import convert

Context = grpc.aio.ServicerContext[Any, Any]

_ETAG: Final = re.compile(r'W/"(\d{1,18})"')
_WRITABLE: Final = ("role",)
_OUTPUT_ONLY: Final = frozenset({"id", "state", "etag", "create_time", "update_time"})


def user_to_proto(user: User) -> users_pb2.User:
    """The API's view of a user (never its password hash)."""
    return users_pb2.User(
        id=user.id,
        username=user.username,
        role=convert.role_to_proto(Role(user.role)),
        state=users_pb2.USER_STATE_DISABLED if user.disabled else users_pb2.USER_STATE_ACTIVE,
        etag=user.etag,
        create_time=convert.timestamp(user.created_at),
        update_time=convert.timestamp(user.updated_at),
    )


def _expected_version(etag: str) -> int | None:
    """The version an etag names (None: no etag, no check).

    Raises:
        InvalidArgument: naming `etag`: not one this server issued.
    """
    if not etag:
        return None
    match = _ETAG.fullmatch(etag.strip())
    if match is None:
        raise InvalidArgument("etag", f"{etag[:40]!r} is not an etag this server issued")
    return int(match.group(1))


def _update_paths(mask: field_mask_pb2.FieldMask) -> list[str]:
    """The writable User fields `mask` names (all of them for an empty mask).

    Raises:
        InvalidArgument: naming `update_mask`: an unknown, output-only or immutable path.
    """
    if not mask.paths:
        return list(_WRITABLE)
    for path in mask.paths:
        if path in _OUTPUT_ONLY:
            hint = "; use DisableUser/EnableUser" if path == "state" else ""
            raise InvalidArgument("update_mask", f"{path!r} is output only{hint}")
        if path == "username":
            raise InvalidArgument("update_mask", "'username' cannot be changed; create another user")
        if path not in _WRITABLE:
            raise InvalidArgument("update_mask", f"unknown field {path!r}")
    return list(dict.fromkeys(mask.paths))


class UserService(users_pb2_grpc.UserServiceServicer):
    """CRUD on users plus disable, enable and password reset, through `Control.users`."""

    def __init__(self, api: Api) -> None:
        self._control = api.control

    async def CreateUser(self, request: users_pb2.CreateUserRequest, context: Context) -> users_pb2.CreateUserResponse:
        if not request.HasField("user"):
            raise InvalidArgument("user", "required")
        role = convert.user_role_from_proto(request.user.role, "user.role")
        with convert.renamed_fields({"username": "user.username"}):
            user = await self._control.users.create_user(
                request.user.username, request.password, role, request_id=request.request_id or None
            )
        return users_pb2.CreateUserResponse(user=user_to_proto(user))

    async def GetUser(self, request: users_pb2.GetUserRequest, context: Context) -> users_pb2.GetUserResponse:
        user = await self._control.users.get_user(convert.resource_id(request.id))
        return users_pb2.GetUserResponse(user=user_to_proto(user))

    async def ListUsers(self, request: users_pb2.ListUsersRequest, context: Context) -> users_pb2.ListUsersResponse:
        page = await self._control.users.list_users(convert.page_size(request.page_size), request.page_token)
        return users_pb2.ListUsersResponse(
            users=[user_to_proto(user) for user in page.users], next_page_token=page.next_page_token
        )

    async def UpdateUser(self, request: users_pb2.UpdateUserRequest, context: Context) -> users_pb2.UpdateUserResponse:
        if not request.HasField("user"):
            raise InvalidArgument("user", "required")
        user_id = convert.resource_id(request.user.id, "user.id")
        _update_paths(request.update_mask)  # `role`, the only writable field, whatever the mask names
        role = convert.user_role_from_proto(request.user.role, "user.role")
        user = await self._control.users.set_role(user_id, role, expected_version=_expected_version(request.etag))
        return users_pb2.UpdateUserResponse(user=user_to_proto(user))

    async def DeleteUser(self, request: users_pb2.DeleteUserRequest, context: Context) -> users_pb2.DeleteUserResponse:
        await self._control.users.delete_user(
            convert.resource_id(request.id), expected_version=_expected_version(request.etag)
        )
        return users_pb2.DeleteUserResponse()

    async def DisableUser(
        self, request: users_pb2.DisableUserRequest, context: Context
    ) -> users_pb2.DisableUserResponse:
        user = await self._control.users.disable_user(
            convert.resource_id(request.id), expected_version=_expected_version(request.etag)
        )
        return users_pb2.DisableUserResponse(user=user_to_proto(user))

    async def EnableUser(self, request: users_pb2.EnableUserRequest, context: Context) -> users_pb2.EnableUserResponse:
        user = await self._control.users.enable_user(
            convert.resource_id(request.id), expected_version=_expected_version(request.etag)
        )
        return users_pb2.EnableUserResponse(user=user_to_proto(user))

    async def ResetUserPassword(
        self, request: users_pb2.ResetUserPasswordRequest, context: Context
    ) -> users_pb2.ResetUserPasswordResponse:
        user = await self._control.users.reset_password(
            current_principal(),
            convert.resource_id(request.id),
            request.new_password,
            expected_version=_expected_version(request.etag),
        )
        return users_pb2.ResetUserPasswordResponse(user=user_to_proto(user))
