"""`schedctl users ...` against a real server process: every action, admin-only, one-line errors."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as aioredis

from tests.api_helpers import ADMIN, ADMIN_PASSWORD, Api, start_server, wait_for_server
from tests.engine_helpers import Roles
from tests.test_client_cli import Schedctl

PASSWORD = "correct-horse-battery"
NEW_PASSWORD = "another-long-password"


@pytest.fixture
async def api(roles: Roles, redis: aioredis.Redis, pool: asyncpg.Pool) -> Api:
    """A server process alone (users need no scheduler or worker)."""
    api = start_server(roles)
    await wait_for_server(api)
    return api


def test_users_commands(api: Api, tmp_path: Path) -> None:
    admin = Schedctl(api.target, tmp_path / "admin")
    admin.ok("login", "--username", ADMIN, "--password", ADMIN_PASSWORD)
    created = admin("users", "create", "ana", "--role", "operator", "--password-stdin", stdin=PASSWORD + "\n")
    assert created.returncode == 0, created.stderr
    assert created.stdout.strip() == "Created user ana (role operator, active)"
    listing = admin.ok("users", "list")
    assert listing.splitlines()[0].split() == ["USERNAME", "ROLE", "STATE", "CREATED", "ID"]
    assert [line.split()[:3] for line in listing.splitlines()[1:]] == [
        ["admin", "admin", "active"],
        ["ana", "operator", "active"],
    ]
    ana = admin.json("users", "get", "ana")
    assert ana["role"] == "ROLE_OPERATOR"
    assert admin.json("users", "get", str(ana["id"]))["username"] == "ana"
    assert "etag" in admin.ok("users", "get", "ana")

    # Ana's own session: not an admin, so no user management.
    own = Schedctl(api.target, tmp_path / "ana")
    own.ok("login", "--username", "ana", "--password", PASSWORD)
    assert "needs the admin role" in own.fails("users", "list", code=1)
    # A new role reaches her live session at once; disabling ends it.
    assert admin.ok("users", "update", "ana", "--role", "viewer").strip() == "Updated user ana (role viewer, active)"
    assert own.ok("whoami").startswith("ana (role viewer)")
    admin.ok("users", "disable", "ana")
    assert "log in again" in own.fails("whoami", code=1)
    assert "invalid username or password" in own.fails("login", "--username", "ana", "--password", PASSWORD, code=1)
    admin.ok("users", "enable", "ana")
    own.ok("login", "--username", "ana", "--password", PASSWORD)
    admin.ok("users", "reset-password", "ana", "--password", NEW_PASSWORD)
    assert "log in again" in own.fails("whoami", code=1)
    own.ok("login", "--username", "ana", "--password", NEW_PASSWORD)
    stale = str(ana["etag"])
    assert "etag" in admin.fails("users", "disable", "ana", "--etag", stale, code=1)
    admin.ok("users", "delete", "ana")
    assert admin.fails("users", "get", "ana", code=1) == "schedctl: no user named 'ana'"
    assert "log in again" in own.fails("whoami", code=1)

    # One-line errors: bad input exits 2 naming the field, refusals exit 1.
    assert "password" in admin.fails("users", "create", "bob", "--role", "viewer", "--password", "short", code=2)
    assert "--password" in admin.fails("users", "create", "bob", "--role", "viewer", code=2)  # no terminal: no prompt
    assert "username" in admin.fails("users", "create", "b o b", "--role", "viewer", "--password", PASSWORD, code=2)
    assert "--role" in admin.fails("users", "create", "bob", "--role", "root", code=2)
    assert "last enabled admin" in admin.fails("users", "update", "admin", "--role", "viewer", code=1)
    assert "last enabled admin" in admin.fails("users", "delete", "admin", code=1)
    assert "ACTION" in admin.fails("users", code=2)
