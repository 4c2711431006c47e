"""User management: the application logic behind UserService and the console's Users page.

Every change is written to PostgreSQL first (`db/users.py`, which refuses to leave no enabled
admin), then applied to the user's live sessions at once (`Authenticator`): a new role re-scopes
them, disabling or deleting the user ends them, and a password reset ends every other session of
the user (the caller's own session stays when it reset its own password).

Passwords set here follow the production rule of the start-up admin's password in every mode:
at least `MIN_PRODUCTION_PASSWORD_LENGTH` characters, at most `MAX_PASSWORD_LENGTH`, and never the
dev password (a user created through the API is a real account, even on a laptop).
"""

from __future__ import annotations

from scheduler_grpc.auth import (
    DEV_ADMIN_PASSWORD,
    MAX_PASSWORD_LENGTH,
    MIN_PRODUCTION_PASSWORD_LENGTH,
    USER_ROLES,
    USERNAME,
    Authenticator,
    Principal,
    Role,
)
from scheduler_grpc.control import _check_request_id
from scheduler_grpc.db.users import User as User  # noqa: PLC0414  (re-exported: the doors see no db)
from scheduler_grpc.db.users import UserPage, UserRepository
from scheduler_grpc.errors import InvalidArgument


def check_username(username: str, field: str = "username") -> str:
    """`username` if the users table can hold it.

    Raises:
        InvalidArgument: naming `field`.
    """
    if not USERNAME.fullmatch(username):
        raise InvalidArgument(field, "must be 1-64 characters among A-Z a-z 0-9 _ . @ -")
    return username


def check_password(password: str, field: str = "password") -> str:
    """`password` if it may be set (see the module docstring for the rule).

    Raises:
        InvalidArgument: naming `field` (the message never repeats the password).
    """
    if len(password) < MIN_PRODUCTION_PASSWORD_LENGTH:
        raise InvalidArgument(field, f"must be at least {MIN_PRODUCTION_PASSWORD_LENGTH} characters")
    if len(password) > MAX_PASSWORD_LENGTH:
        raise InvalidArgument(field, f"must be at most {MAX_PASSWORD_LENGTH} characters")
    if password == DEV_ADMIN_PASSWORD or not password.strip():
        raise InvalidArgument(field, "is too easy to guess; choose another")
    return password


class UserAdmin:
    """Creates, lists, changes and deletes users, and keeps their sessions in step.

    Args:
        users: The users table.
        auth: Hashes passwords and re-scopes or ends sessions.
    """

    def __init__(self, users: UserRepository, auth: Authenticator) -> None:
        self._users = users
        self._auth = auth

    async def list_users(self, page_size: int = 0, page_token: str = "") -> UserPage:
        """Users by username, disabled ones included."""
        return await self._users.list_page(page_size, page_token)

    async def get_user(self, user_id: str) -> User:
        """One user.

        Raises:
            InvalidArgument: `id` is not a UUID.
            NotFound: no such user.
        """
        return await self._users.get(user_id)

    async def create_user(self, username: str, password: str, role: Role, *, request_id: str | None = None) -> User:
        """Create an enabled user; a repeated `request_id` returns the user its first call created.

        Raises:
            InvalidArgument: naming `username`, `password` or `request_id`.
            AlreadyExists: a user has this username.
        """
        check_username(username)
        check_password(password)
        _check_role(role)
        request_id = _check_request_id(request_id)
        password_hash = await self._auth.hash_password(password)
        return await self._users.create(username, password_hash, role.value, request_id)

    async def set_role(self, user_id: str, role: Role, *, expected_version: int | None = None) -> User:
        """Give a user another role; its live sessions have it from their next call.

        Raises:
            NotFound, Aborted (stale etag), FailedPrecondition (the last enabled admin).
        """
        _check_role(role)
        user = await self._users.change(user_id, role=role.value, expected_version=expected_version)
        await self._auth.rescope_sessions(user)
        return user

    async def disable_user(self, user_id: str, *, expected_version: int | None = None) -> User:
        """Stop a user logging in, and end its sessions at once.

        Raises:
            NotFound, Aborted (stale etag), FailedPrecondition (the last enabled admin).
        """
        user = await self._users.change(user_id, disabled=True, expected_version=expected_version)
        await self._auth.end_sessions(user.id, user.version)
        return user

    async def enable_user(self, user_id: str, *, expected_version: int | None = None) -> User:
        """Let a disabled user log in again (with its password as it was).

        Raises:
            NotFound, Aborted (stale etag).
        """
        return await self._users.change(user_id, disabled=False, expected_version=expected_version)

    async def reset_password(
        self, caller: Principal, user_id: str, password: str, *, expected_version: int | None = None
    ) -> User:
        """Set a user's password and end its other sessions (the caller's own one stays).

        Raises:
            InvalidArgument: naming `new_password`.
            NotFound, Aborted (stale etag).
        """
        check_password(password, "new_password")
        password_hash = await self._auth.hash_password(password)
        user = await self._users.change(user_id, password_hash=password_hash, expected_version=expected_version)
        await self._auth.end_sessions(user.id, user.version, keep=caller)
        return user

    async def delete_user(self, user_id: str, *, expected_version: int | None = None) -> User:
        """Delete a user and end its sessions; returns the user as it was.

        Raises:
            NotFound, Aborted (stale etag), FailedPrecondition (the last enabled admin).
        """
        user = await self._users.delete(user_id, expected_version=expected_version)
        await self._auth.end_sessions(user.id, user.version + 1)
        return user


def _check_role(role: Role) -> None:
    """Users are viewers, operators or admins (`worker` is a role of API keys only)."""
    if role not in USER_ROLES:
        raise InvalidArgument("role", "a user is a viewer, operator or admin (worker is for API keys)")
