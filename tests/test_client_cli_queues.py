"""`schedctl queues shards show|set` against a real server process (issue 24): a count set and read
back, one-line errors naming the argument (exit 2, nothing written), admins only set."""

from __future__ import annotations

import re
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as aioredis

from tests.api_helpers import ADMIN, ADMIN_PASSWORD, Api, start_server, wait_for_server
from tests.engine_helpers import Roles
from tests.test_client_cli import Schedctl

PASSWORD = "correct-horse-battery"
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ"


@pytest.fixture
async def api(roles: Roles, redis: aioredis.Redis, pool: asyncpg.Pool) -> Api:
    """A server process alone (shard counts need no scheduler or worker)."""
    api = start_server(roles)
    await wait_for_server(api)
    return api


async def test_queues_shards_set_and_show(api: Api, tmp_path: Path, pool: asyncpg.Pool) -> None:
    admin = Schedctl(api.target, tmp_path / "admin")
    admin.ok("login", "--username", ADMIN, "--password", ADMIN_PASSWORD)
    assert admin.ok("queues", "shards", "show").splitlines() == ["QUEUE  SHARDS  SERVED  CHANGES"]

    out = admin.ok("queues", "shards", "set", "reports", "3")
    assert re.fullmatch(rf"reports: 3 shards for the runs made from {STAMP}\n", out), out
    change = admin.json("queues", "shards", "set", "mail", "1")
    assert change["shards"] == 1
    assert isinstance(change["effectiveTime"], str)
    assert await pool.fetch("SELECT queue, shards FROM queue_shards ORDER BY queue") == [("mail", 1), ("reports", 3)]

    lines = admin.ok("queues", "shards", "show").splitlines()
    assert lines[0].split() == ["QUEUE", "SHARDS", "SERVED", "CHANGES"]
    # Not in effect yet (SCHEDULER_QUEUE_SHARD_LEAD ahead), but served at once.
    assert re.fullmatch(rf"mail +1 +1 +1 from {STAMP}", lines[1]), lines[1]
    assert re.fullmatch(rf"reports +1 +3 +3 from {STAMP}", lines[2]), lines[2]
    one = admin.json("queues", "shards", "show", "reports")
    assert (one["queue"], one["shards"], one["servedShards"]) == ("reports", 1, 3)
    assert [c["shards"] for c in one["changes"]] == [3]  # type: ignore[index, union-attr]
    unsharded = admin.ok("queues", "shards", "show", "other").splitlines()
    assert unsharded[1].split() == ["other", "1", "1", "-"]

    # Bad input: one line naming the argument, exit 2, nothing written.
    assert admin.fails("queues", "shards", "set", "reports", "0", code=2).startswith("schedctl: N: must be ")
    assert admin.fails("queues", "shards", "set", "reports", "65", code=2).startswith("schedctl: N: must be ")
    assert admin.fails("queues", "shards", "set", "bad#q", "2", code=2).startswith("schedctl: QUEUE: expected ")
    assert "N" in admin.fails("queues", "shards", "set", "reports", "three", code=2)
    assert admin.fails("queues", "shards", "show", "no spaces", code=2).startswith("schedctl: QUEUE: ")
    admin.fails("queues", "shards", "set", "reports", code=2)  # N missing
    assert await pool.fetchval("SELECT count(*) FROM queue_shards") == 2

    # A viewer reads the counts but cannot set one.
    admin.ok("users", "create", "vera", "--role", "viewer", "--password", PASSWORD)
    viewer = Schedctl(api.target, tmp_path / "vera")
    viewer.ok("login", "--username", "vera", "--password", PASSWORD)
    assert "reports" in viewer.ok("queues", "shards", "show")
    assert "needs the admin role" in viewer.fails("queues", "shards", "set", "reports", "2", code=1)
    assert await pool.fetchval("SELECT count(*) FROM queue_shards") == 2
