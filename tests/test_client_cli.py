"""schedctl against a real server: the README walk-through, JSON output, and one-line errors."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as aioredis
from scheduler_client.cli import main

from tests.api_helpers import ADMIN, ADMIN_PASSWORD, Api, free_port, start_api
from tests.conftest import ROOT
from tests.engine_helpers import Roles


class Schedctl:
    def __init__(self, server: str, config: Path) -> None:
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SCHEDCTL_")},
            "SCHEDCTL_SERVER": server,
            "SCHEDCTL_CONFIG": str(config),
        }

    def __call__(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "scheduler_client.cli", *args],
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=ROOT,
        )

    def ok(self, *args: str) -> str:
        result = self(*args)
        assert result.returncode == 0, f"schedctl {' '.join(args)}: {result.returncode}\n{result.stderr}"
        assert "Traceback" not in result.stderr
        return result.stdout

    def json(self, *args: str) -> dict[str, object]:
        value = json.loads(self.ok("--json", *args))
        assert isinstance(value, dict)
        return value

    def fails(self, *args: str, code: int) -> str:
        """The one stderr line of a failing command."""
        result = self(*args)
        assert result.returncode == code, f"{result.returncode}: {result.stdout}{result.stderr}"
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("schedctl: "), lines[0]
        return lines[0]


@pytest.fixture
async def api(roles: Roles, redis: aioredis.Redis, pool: asyncpg.Pool) -> Api:
    """Scheduler, worker and server processes on clean test servers."""
    return await start_api(roles, redis)


def test_cli_walk_through(api: Api, tmp_path: Path) -> None:
    config = tmp_path / "schedctl"
    cli = Schedctl(api.target, config)

    cli.fails("jobs", "list", code=1)  # not logged in yet
    assert "Logged in" in cli.ok("login", "--username", ADMIN, "--password", ADMIN_PASSWORD)
    credentials = config / "credentials.json"
    assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
    assert json.loads(credentials.read_text())["servers"][api.target]["token"]

    created = cli.json("jobs", "create", "--name", "hello", "--handler", "test.echo", "--payload", '{"greeting": "hi"}',
                       "--max-retries", "1", "--timeout", "30s")  # fmt: skip
    assert created["name"] == "hello"
    assert created["payload"] == {"greeting": "hi"}
    # The proto3 JSON mapping, as buf curl and grpcurl print it: lowerCamelCase names.
    assert created["retryPolicy"]["maxRetries"] == 1
    assert "createTime" in created
    assert not [key for key in created if "_" in key]
    table = cli.ok("jobs", "list").splitlines()
    assert table[0].split()[:3] == ["NAME", "ID", "HANDLER"]
    assert table[1].split()[0] == "hello"
    assert "id:" in cli.ok("jobs", "get", "hello")

    assert "succeeded" in cli.ok("jobs", "trigger", "hello", "--wait", "--wait-timeout", "20s")
    listed = cli.ok("executions", "list", "--job", "hello").splitlines()
    assert listed[0].split()[:4] == ["ID", "JOB", "ATTEMPT", "STATE"]
    assert listed[1].split()[1:4] == ["hello", "1", "succeeded"]
    executions = cli.json("executions", "list", "--job", "hello")["executions"]
    assert isinstance(executions, list)
    assert [e["state"] for e in executions] == ["EXECUTION_STATE_SUCCEEDED"]
    assert cli.json("executions", "get", executions[0]["id"])["workerId"]

    assert "Paused job hello" in cli.ok("jobs", "pause", "hello")
    assert cli.json("jobs", "get", "hello")["state"] == "JOB_STATE_PAUSED"
    assert "Resumed job hello" in cli.ok("jobs", "resume", "hello")

    assert cli.ok("dlq", "list").split() == ["RUN", "ID", "HANDLER", "PRIORITY", "DEAD", "SINCE", "REASON"]
    assert cli.json("dlq", "list") == {"deadLetters": []}
    workers = cli.ok("workers").splitlines()
    assert workers[0].split()[0] == "ID"
    assert len(workers) == 2
    status = cli.ok("status")
    assert "leader:" in status
    assert "term:" in status
    scheduler = cli.json("status")["scheduler"]
    assert isinstance(scheduler, dict)
    assert scheduler["hasLeader"] is True
    assert "test.echo" in cli.ok("handlers")
    assert cli.json("whoami")["principal"] == ADMIN

    # A cron job every second gives `executions watch` events without any race.
    cli.ok("jobs", "create", "--name", "tick", "--handler", "test.echo", "--cron", "* * * * * *")
    watched = cli.ok("--json", "executions", "watch", "--job", "tick", "--type", "succeeded", "--count", "2")
    events = [json.loads(line) for line in watched.splitlines()]
    assert [e["type"] for e in events] == ["EVENT_TYPE_SUCCEEDED"] * 2
    assert all(e["cursor"] for e in events)
    cli.ok("jobs", "delete", "tick")

    # Errors: one line, exit 2 for usage and INVALID_ARGUMENT, 1 otherwise.
    assert "--payload" in cli.fails("jobs", "create", "--name", "x", "--handler", "test.echo", "--payload", "{", code=2)
    assert "required" in cli.fails("jobs", "create", "--name", "x", code=2)
    assert "cron" in cli.fails("jobs", "create", "--name", "bad", "--handler", "test.echo", "--cron", "nope", code=2)
    assert "not found" in cli.fails("jobs", "get", "00000000-0000-4000-8000-000000000000", code=1).lower()
    assert "no job named" in cli.fails("jobs", "trigger", "no-such-job", code=1)
    assert "invalid choice" in cli.fails("frobnicate", code=2)
    assert "run ids or --all" in cli.fails("dlq", "purge", code=2)
    unreachable = cli.fails("--server", f"127.0.0.1:{free_port()}", "status", code=1)
    assert "cannot reach" in unreachable

    cli.ok("jobs", "delete", "hello")
    assert "Logged out" in cli.ok("logout")
    assert api.target not in json.loads(credentials.read_text())["servers"]
    assert "schedctl login" in cli.fails("jobs", "list", code=1)


def test_cli_flows(api: Api, tmp_path: Path) -> None:
    cli = Schedctl(api.target, tmp_path / "schedctl")
    cli.ok("login", "--username", ADMIN, "--password", ADMIN_PASSWORD)
    # Job dependencies: --depends-on / --trigger-rule, a cycle refused, a flow run drawn with states.
    cli.ok("jobs", "create", "--name", "extract", "--handler", "test.echo")
    cli.ok("jobs", "create", "--name", "transform", "--handler", "test.echo", "--depends-on", "extract")
    load = cli.json("jobs", "create", "--name", "load", "--handler", "test.echo", "--depends-on", "transform",
                    "--depends-on", "extract", "--trigger-rule", "all_done")  # fmt: skip
    assert load["triggerRule"] == "TRIGGER_RULE_ALL_DONE"
    assert len(load["dependsOn"]) == 2
    cycle = cli.fails("jobs", "update", "extract", "--depends-on", "load", code=2)
    assert "job.depends_on: would create a cycle: extract → load → extract" in cycle
    flow_run = cli.json("jobs", "trigger", "extract", "--wait")["runId"]
    deadline = time.monotonic() + 30
    while cli.json("flows", "get", flow_run)["state"] == "FLOW_RUN_STATE_RUNNING":
        assert time.monotonic() < deadline, "the flow run did not finish"
    assert cli.ok("flows", "get", flow_run).splitlines() == [
        f"flow run {flow_run}: succeeded",
        "extract [succeeded]",
        "├─▶ load [succeeded]  ← transform, extract",
        "└─▶ transform [succeeded]",
        "    └─▶ load (see above)",
    ]
    assert len(cli.json("executions", "list", "--flow-run", flow_run)["executions"]) == 3
    watched = cli.ok(
        "--json",
        "executions",
        "watch",
        "--flow-run",
        flow_run,
        "--cursor",
        "0-0",
        "--type",
        "succeeded",
        "--count",
        "3",
    )  # fmt: skip (the earlier `hello` run is left out)
    assert sorted(json.loads(line)["jobId"] for line in watched.splitlines()) == sorted(
        cli.json("jobs", "get", name)["id"] for name in ("extract", "transform", "load")
    )
    assert "load" in cli.fails("jobs", "delete", "transform", code=1)
    cli.ok("jobs", "delete", "transform", "--detach-dependents")
    cli.ok("jobs", "update", "load", "--no-depends-on")
    for name in ("load", "extract"):
        cli.ok("jobs", "delete", name)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["jobs"], "ACTION"),
        (["jobs", "create", "--name", "x", "--handler", "h", "--run-at", "tomorrow-ish"], "--run-at"),
        (["jobs", "create", "--name", "x", "--handler", "h", "--timeout", "5 parsecs"], "--timeout"),
        (["executions", "list", "--state", "sleeping"], "--state"),
        (["login"], "--username"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SCHEDCTL_USERNAME", raising=False)
    monkeypatch.delenv("SCHEDCTL_PASSWORD", raising=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # not a terminal: no prompt
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("schedctl: ")
    assert needle in err
