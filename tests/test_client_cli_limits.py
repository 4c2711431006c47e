"""`schedctl limits ...` and `jobs create/update --limit` against a real server process (issue 22):
every action, viewers read and admins define, one-line errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as aioredis
from google.protobuf import timestamp_pb2
from scheduler_client import _output as show
from scheduler_client.cli import limit_ref_arg, override_arg
from scheduler_client.v1 import executions_pb2

from tests.api_helpers import ADMIN, ADMIN_PASSWORD, Api, start_server, wait_for_server
from tests.engine_helpers import Roles
from tests.test_client_cli import Schedctl

PASSWORD = "correct-horse-battery"


@pytest.fixture
async def api(roles: Roles, redis: aioredis.Redis, pool: asyncpg.Pool) -> Api:
    """A server process alone (limits need no scheduler or worker)."""
    api = start_server(roles)
    await wait_for_server(api)
    return api


def test_limit_flags_parse() -> None:
    parsed = limit_ref_arg("per-customer:payload.customer_id:2")
    assert (parsed.limit, parsed.key, parsed.units) == ("per-customer", "payload.customer_id", 2)
    constant = limit_ref_arg("hosts:api.example.com:443:1")  # a key with colons; the last :digits are units
    assert (constant.limit, constant.key, constant.units) == ("hosts", "api.example.com:443", 1)
    plain = limit_ref_arg("billing:billing-api")
    assert (plain.limit, plain.key, plain.HasField("units")) == ("billing", "billing-api", False)
    for bad in ("nokey", ":key", "name:", "name::3"):
        with pytest.raises(argparse.ArgumentTypeError):
            limit_ref_arg(bad)
    assert override_arg("acme=5") == ("acme", (5, 0))
    assert override_arg("a=b=7/2") == ("a=b", (7, 2))
    for bad in ("acme", "=5", "acme=x", "acme=5/y"):
        with pytest.raises(argparse.ArgumentTypeError):
            override_arg(bad)


def test_limits_commands(api: Api, tmp_path: Path) -> None:
    admin = Schedctl(api.target, tmp_path / "admin")
    admin.ok("login", "--username", ADMIN, "--password", ADMIN_PASSWORD)
    created = admin.ok("limits", "create", "per-customer", "--kind", "concurrency", "--limit", "2",
                       "--override", "acme=5")  # fmt: skip
    assert created.strip() == "Created limit per-customer (2 at once per key)"
    rate = admin.ok("limits", "create", "billing-api", "--kind", "rate", "--limit", "100", "--period", "1s",
                    "--burst", "10")  # fmt: skip
    assert rate.strip() == "Created limit billing-api (100 per 1s (+10 burst) per key)"
    listing = admin.ok("limits", "list")
    assert listing.splitlines()[0].split() == ["NAME", "KIND", "LIMIT", "OVERRIDES", "ID"]
    assert [line.split()[:2] for line in listing.splitlines()[1:]] == [
        ["billing-api", "rate"],
        ["per-customer", "concurrency"],
    ]
    shown = admin.json("limits", "get", "per-customer")
    assert (shown["kind"], shown["limit"], shown["overrides"]) == (
        "LIMIT_KIND_CONCURRENCY",
        2,
        {"acme": {"limit": 5, "burst": 0}},
    )
    assert admin.json("limits", "get", str(shown["id"]))["name"] == "per-customer"
    assert "acme=5" in admin.ok("limits", "get", "per-customer")

    # Overrides one key at a time; updates of the given fields only.
    admin.ok("limits", "override", "per-customer", "globex", "--limit", "7")
    admin.ok("limits", "override", "per-customer", "acme", "--clear")
    assert admin.json("limits", "get", "per-customer")["overrides"] == {"globex": {"limit": 7, "burst": 0}}
    assert "--clear" in admin.fails("limits", "override", "per-customer", "x", code=2)
    updated = admin.ok("limits", "update", "billing-api", "--limit", "50")
    assert updated.strip() == "Updated limit billing-api (50 per 1s (+10 burst) per key)"
    assert "etag" in admin.fails(
        "limits", "update", "billing-api", "--limit", "60", "--etag", str(shown["etag"]), code=1
    )

    # Jobs take limits with --limit NAME:KEY[:UNITS], and show them.
    admin.ok("jobs", "create", "--name", "sync", "--handler", "test.echo",
             "--limit", "per-customer:payload.customer_id", "--limit", "billing-api:billing:3")  # fmt: skip
    job = admin.json("jobs", "get", "sync")
    assert job["limits"] == [
        {"limit": "per-customer", "key": "payload.customer_id", "units": 1},
        {"limit": "billing-api", "key": "billing", "units": 3},
    ]
    assert "per-customer:payload.customer_id:1, billing-api:billing:3" in admin.ok("jobs", "get", "sync")
    # A limit in use cannot be deleted; the message names the jobs.
    assert "sync" in admin.fails("limits", "delete", "billing-api", code=1)
    admin.ok("jobs", "update", "sync", "--limit", "per-customer:payload.customer_id")
    assert [ref["limit"] for ref in admin.json("jobs", "get", "sync")["limits"]] == ["per-customer"]  # type: ignore[index, union-attr]
    admin.ok("limits", "delete", "billing-api")
    assert "not found" in admin.fails("limits", "get", "billing-api", code=1)
    admin.ok("jobs", "update", "sync", "--no-limits")
    assert not admin.json("jobs", "get", "sync").get("limits")

    # Bad input exits 2 naming the field; an unknown limit on a job too.
    assert "job.limits[0].limit" in admin.fails("jobs", "create", "--name", "x", "--handler", "test.echo",
                                                "--limit", "nope:k", code=2)  # fmt: skip
    assert "--limit" in admin.fails("limits", "create", "z", "--kind", "concurrency", "--limit", "0", code=2)
    assert "limit.period" in admin.fails("limits", "create", "z", "--kind", "rate", "--limit", "5", code=2)
    assert "limit.period" in admin.fails("limits", "create", "z", "--kind", "concurrency", "--limit", "5",
                                         "--period", "1s", code=2)  # fmt: skip
    assert "--limit" in admin.fails("jobs", "create", "--name", "x", "--handler", "test.echo", "--limit", "nokey",
                                    code=2)  # fmt: skip

    # A viewer reads limits but cannot define them.
    admin.ok("users", "create", "vera", "--role", "viewer", "--password", PASSWORD)
    viewer = Schedctl(api.target, tmp_path / "vera")
    viewer.ok("login", "--username", "vera", "--password", PASSWORD)
    assert "per-customer" in viewer.ok("limits", "list")
    assert "needs the admin role" in viewer.fails("limits", "create", "v", "--kind", "concurrency", "--limit", "1",
                                                  code=1)  # fmt: skip


def test_limit_key_commands(api: Api, tmp_path: Path) -> None:
    admin = Schedctl(api.target, tmp_path / "admin")
    admin.ok("login", "--username", ADMIN, "--password", ADMIN_PASSWORD)
    admin.ok("limits", "create", "per-customer", "--kind", "concurrency", "--limit", "2")
    admin.ok("jobs", "create", "--name", "sync", "--handler", "test.echo", "--queue", "limq",
             "--limit", "per-customer:payload.customer_id")  # fmt: skip
    shown = admin.ok("limits", "key", "per-customer", "c1")
    assert shown.splitlines()[0].split() == ["QUEUE", "RUNNING", "QUEUED", "NEXT", "ADMISSION", "PAUSED", "UNTIL"]
    assert shown.splitlines()[1].split()[:3] == ["limq", "0", "0"]
    assert shown.splitlines()[1].split()[-1] == "-"  # not paused
    assert [entry["queue"] for entry in admin.json("limits", "key", "per-customer", "c1")["queues"]] == ["limq"]  # type: ignore[index, union-attr]

    # Operators pause and resume; a viewer reads only.
    admin.ok("users", "create", "olga", "--role", "operator", "--password", PASSWORD)
    admin.ok("users", "create", "vera", "--role", "viewer", "--password", PASSWORD)
    operator = Schedctl(api.target, tmp_path / "olga")
    operator.ok("login", "--username", "olga", "--password", PASSWORD)
    viewer = Schedctl(api.target, tmp_path / "vera")
    viewer.ok("login", "--username", "vera", "--password", PASSWORD)
    paused = operator.ok("limits", "pause", "per-customer", "c1", "--for", "30s")
    assert paused.startswith("Paused until ")
    assert paused.strip().endswith("key c1 of limit per-customer on limq")
    assert viewer.ok("limits", "key", "per-customer", "c1").splitlines()[1].split()[-1] != "-"
    assert "needs the operator role" in viewer.fails("limits", "pause", "per-customer", "c1", "--for", "1m", code=1)
    assert "needs the operator role" in viewer.fails("limits", "resume", "per-customer", "c1", code=1)
    assert operator.ok("limits", "resume", "per-customer", "c1").strip() == (
        "Resumed key c1 of limit per-customer on limq"
    )
    assert viewer.ok("limits", "key", "per-customer", "c1").splitlines()[1].split()[-1] == "-"
    operator.ok("limits", "pause", "per-customer", "c1", "--until", "+5m", "--queue", "other")
    assert admin.json("limits", "key", "per-customer", "c1", "--queue", "other")["queues"][0]["pauseEndTime"]  # type: ignore[index]

    # One-line errors, non-zero exits: bad input 2 (naming the field), an unknown limit 1.
    assert "--for" in operator.fails("limits", "pause", "per-customer", "c1", code=2)
    assert "duration" in operator.fails("limits", "pause", "per-customer", "c1", "--for", "0s", code=2)
    assert "key" in operator.fails("limits", "key", "per-customer", "", code=2)
    missing = operator.fails("limits", "key", "nope", "c1", code=1)
    assert "not found" in missing
    assert len(missing.strip().splitlines()) == 1


def test_executions_show_why_they_wait() -> None:
    blocked = executions_pb2.Execution(
        id="e1",
        job_id="j",
        state=executions_pb2.EXECUTION_STATE_QUEUED,
        blocked_by=executions_pb2.BlockedBy(
            limit="per-customer", key="c1", reason="concurrency", since=timestamp_pb2.Timestamp(seconds=1_800_000_000)
        ),
    )
    plain = executions_pb2.Execution(id="e2", job_id="j", state=executions_pb2.EXECUTION_STATE_QUEUED)
    why = "waits for limit per-customer key c1 (concurrency) since 2027-01-15 08:00:00Z"
    assert ("blocked", why) in show.execution_fields(blocked)
    assert "blocked" not in dict(show.execution_fields(plain))
    _, rows = show.execution_rows([blocked, plain], {})
    assert rows[0][3] == f"queued ({why})"
    assert rows[1][3] == "queued"
