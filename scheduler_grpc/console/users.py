"""The console's Users page (admins only): list, create, change role, disable/enable, reset the
password of and delete users.

Each handler is the console side of a UserService RPC (`security.rpc`), so the API's role table
decides who may use it, and each action calls `Control.users` as the servicer does: the same
validation, the same last-admin guard, and the same at-once effect on the user's live sessions.
A form the server refuses comes back with the error under its field and what was typed kept (the
password excepted).
"""

from __future__ import annotations

import urllib.parse
import uuid
from typing import Any, Final

from aiohttp import web

from scheduler_grpc.auth import USER_ROLES, Role
from scheduler_grpc.console.context import CONSOLE, render
from scheduler_grpc.console.security import PRINCIPAL, rpc
from scheduler_grpc.control_users import UserAdmin
from scheduler_grpc.errors import AlreadyExists, FailedPrecondition, InvalidArgument

_V: Final = "/scheduler.v1.UserService/"
ROLES: Final = [role.value for role in USER_ROLES]


def _users(request: web.Request) -> UserAdmin:
    return request.app[CONSOLE].api.control.users


def _user_id(request: web.Request) -> str:
    try:
        return str(uuid.UUID(request.match_info["id"]))
    except ValueError:
        raise InvalidArgument("id", "must be a UUID") from None


async def _form(request: web.Request) -> dict[str, str]:
    data = await request.post()
    return {key: value for key, value in data.items() if isinstance(value, str)}


def _role(value: str) -> Role:
    try:
        role = Role(value)
    except ValueError:
        role = None
    if role not in USER_ROLES:
        raise InvalidArgument("role", "must be viewer, operator or admin")
    return role


def _done(message: str) -> web.HTTPSeeOther:
    """Back to the list with a flash message saying what was done."""
    return web.HTTPSeeOther("/users?" + urllib.parse.urlencode({"done": message}))


async def _page(request: web.Request, status: int = 200, **values: Any) -> web.StreamResponse:
    page = await _users(request).list_users(100, request.query.get("token", ""))
    context = {
        "page": page,
        "roles": ROLES,
        "message": request.query.get("done", ""),
        "form": {"username": "", "role": Role.VIEWER.value},
        "errors": {},
        "row_error": None,
        **values,
    }
    return await render(request, "users.html", context, status=status)


@rpc(_V + "ListUsers")
async def users(request: web.Request) -> web.StreamResponse:
    return await _page(request)


@rpc(_V + "CreateUser")
async def create_user(request: web.Request) -> web.StreamResponse:
    form = await _form(request)
    username, role = form.get("username", "").strip(), form.get("role", "")
    try:
        created = await _users(request).create_user(
            username, form.get("password", ""), _role(role), request_id=form.get("request_id") or None
        )
    except InvalidArgument as exc:
        return await _page(request, 400, form={"username": username, "role": role}, errors={exc.field: exc.message})
    except AlreadyExists as exc:
        message = str(exc).removeprefix("username: ")
        return await _page(request, 409, form={"username": username, "role": role}, errors={"username": message})
    raise _done(f"created {created.username} ({created.role})")


async def _act(request: web.Request, action: Any, *, may_demote_caller: bool = True) -> web.StreamResponse:
    """Run `action(user_id, form)`; a refused change shows its reason on the page, by its row."""
    user_id = _user_id(request)
    form = await _form(request)
    try:
        message: str = await action(user_id, form)
    except (InvalidArgument, FailedPrecondition) as exc:
        status = 400 if isinstance(exc, InvalidArgument) else 409
        return await _page(request, status, row_error={"id": user_id, "message": str(exc)})
    if may_demote_caller and user_id == request[PRINCIPAL].subject_id:
        # The caller changed itself: it may no longer be an admin (or logged in) to see the list.
        raise web.HTTPSeeOther("/")
    raise _done(message)


@rpc(_V + "UpdateUser")
async def set_role(request: web.Request) -> web.StreamResponse:
    async def change(user_id: str, form: dict[str, str]) -> str:
        user = await _users(request).set_role(user_id, _role(form.get("role", "")))
        return f"{user.username} is now {user.role}"

    return await _act(request, change)


@rpc(_V + "DisableUser")
async def disable_user(request: web.Request) -> web.StreamResponse:
    async def change(user_id: str, form: dict[str, str]) -> str:
        user = await _users(request).disable_user(user_id)
        return f"disabled {user.username} (its sessions ended)"

    return await _act(request, change)


@rpc(_V + "EnableUser")
async def enable_user(request: web.Request) -> web.StreamResponse:
    async def change(user_id: str, form: dict[str, str]) -> str:
        user = await _users(request).enable_user(user_id)
        return f"enabled {user.username}"

    return await _act(request, change, may_demote_caller=False)


@rpc(_V + "ResetUserPassword")
async def reset_password(request: web.Request) -> web.StreamResponse:
    async def change(user_id: str, form: dict[str, str]) -> str:
        user = await _users(request).reset_password(request[PRINCIPAL], user_id, form.get("new_password", ""))
        return f"reset the password of {user.username} (its other sessions ended)"

    return await _act(request, change, may_demote_caller=False)


@rpc(_V + "DeleteUser")
async def delete_user(request: web.Request) -> web.StreamResponse:
    async def change(user_id: str, form: dict[str, str]) -> str:
        user = await _users(request).delete_user(user_id)
        return f"deleted {user.username} (its sessions ended)"

    return await _act(request, change)


ROUTES: Final = [
    web.get("/users", users),
    web.post("/users", create_user),
    web.post("/users/{id}/role", set_role),
    web.post("/users/{id}/disable", disable_user),
    web.post("/users/{id}/enable", enable_user),
    web.post("/users/{id}/password", reset_password),
    web.post("/users/{id}/delete", delete_user),
]
"""The page's routes, added to the console's table by `app.build_app`."""
