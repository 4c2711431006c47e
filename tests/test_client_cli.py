"""schedctl against a real server: the README walk-through, JSON output, and one-line errors."""

from __future__ import annotations

import http.server
import io
import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from scheduler_client import _output as show
from scheduler_client.cli import flag_message, main

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


@pytest.fixture
async def unscheduled_api(roles: Roles, redis: aioredis.Redis, pool: asyncpg.Pool) -> Api:
    """A worker and the server: for tests whose runs are all triggered (no cron job, no scheduler)."""
    return await start_api(roles, redis, scheduler=False)


@pytest.fixture
async def server_api(roles: Roles, redis: aioredis.Redis, pool: asyncpg.Pool) -> Api:
    """The server process alone: for tests that run nothing."""
    return await start_api(roles, redis, scheduler=False, workers=0)


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
    assert "--depends-on: would create a cycle: extract → load → extract" in cycle
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
        (["--server", "", "status"], "--server"),
        (["--server", "host name:1", "status"], "--server"),
        (["jobs", "create", "--name", "x", "--handler", "h", "--cron", "* * * * *", "--run-at", "now"], "--run-at"),
        (["jobs", "update", "x", "--cron", "* * * * *", "--run-at", "now"], "--cron, --run-at"),
        (["jobs", "create", "--name", "x", "--handler", "h", "--priority", "99999999999999"], "--priority"),
        (["jobs", "create", "--name", "x", "--handler", "h", "--max-retries", "-99999999999999"], "--max-retries"),
        (["jobs", "create", "--name", "x", "--handler", "h", "--timeout", "99999999999d"], "--timeout"),
        (["jobs", "create", "--name", "x", "--handler", "h", "--run-at", "+3000000d"], "--run-at"),
        (["jobs", "preview", "--cron", "* * * * *", "--start", "+3000000d"], "--start"),
        (
            ["jobs", "create", "--name", "x", "--handler", "h", "--payload", '{"a":' * 40 + "1" + "}" * 40],
            "--payload: nested deeper than 32",
        ),
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


def _login(api: Api, tmp_path: Path) -> Schedctl:
    cli = Schedctl(api.target, tmp_path / "schedctl")
    cli.ok("login", "--username", ADMIN, "--password", ADMIN_PASSWORD)
    return cli


def test_trigger_wait_waits_for_the_run_through_its_retries(unscheduled_api: Api, tmp_path: Path) -> None:
    api = unscheduled_api
    cli = _login(api, tmp_path)
    # (Four test.fail calls in all: a fifth with these failures would open its circuit breaker.)
    # The first attempt fails, its retry succeeds: the run succeeded, exit 0.
    cli.ok("jobs", "create", "--name", "flaky", "--handler", "test.fail", "--payload", '{"fail_attempts": 1}',
           "--max-retries", "1", "--initial-backoff", "100ms")  # fmt: skip
    out = cli.ok("jobs", "trigger", "flaky", "--wait", "--wait-timeout", "30s").splitlines()
    assert re.fullmatch(r"Triggered flaky: run \S+; waiting for it to finish", out[0]), out
    assert re.fullmatch(r"Run \S+ succeeded in \S+ \(attempt 2, execution \S+\)", out[-1]), out
    # Every attempt fails: the run is dead, exit 1, and its last attempt is shown.
    cli.ok("jobs", "create", "--name", "doomed", "--handler", "test.fail", "--max-retries", "1",
           "--initial-backoff", "100ms")  # fmt: skip
    result = cli("--json", "jobs", "trigger", "doomed", "--wait", "--wait-timeout", "30s")
    assert result.returncode == 1, result.stdout + result.stderr
    last = json.loads(result.stdout)
    assert (last["state"], last["attempt"]) == ("EXECUTION_STATE_DEAD", 2)
    assert last["runId"] != last["id"]  # the retry, not the first attempt
    assert "(retry budget of 1 spent)" in last["error"]


def test_whole_numbers_print_as_integers(unscheduled_api: Api, tmp_path: Path) -> None:
    api = unscheduled_api
    cli = _login(api, tmp_path)
    payload = '{"n": 42, "ratio": 1.5, "list": [1, 2.5, -3], "nested": {"zero": 0}}'
    cli.ok("jobs", "create", "--name", "numbers", "--handler", "test.echo", "--payload", payload)
    shown = cli.ok("jobs", "get", "numbers")
    assert 'payload:             {"list": [1, 2.5, -3], "n": 42, "nested": {"zero": 0}, "ratio": 1.5}' in shown
    assert "retries:             3 (backoff 1s to 5m00s, jitter)" in shown
    raw = cli.ok("--json", "jobs", "get", "numbers")
    assert sorted(re.findall(r'"(?:n|zero)": [^,\n]+', raw)) == ['"n": 42', '"zero": 0'], raw
    assert re.search(r"\[\s+1,\s+2\.5,\s+-3\s+\]", raw), raw
    cli.ok("jobs", "create", "--name", "counted", "--handler", "test.fail", "--payload", '{"fail_attempts": 0}')
    run = cli.json("jobs", "trigger", "counted", "--wait", "--wait-timeout", "30s")
    assert run["result"] == {"attempt": 1, "failed_attempts": 0}
    assert 'result:         {"attempt": 1, "failed_attempts": 0}' in cli.ok("executions", "get", str(run["id"]))


def test_watch_and_depends_on_show_job_names(api: Api, tmp_path: Path) -> None:
    cli = _login(api, tmp_path)
    cli.ok("jobs", "create", "--name", "upstream-job", "--handler", "test.echo")
    cli.ok("jobs", "create", "--name", "downstream-job", "--handler", "test.echo", "--depends-on", "upstream-job")
    assert "depends on:          upstream-job\n" in cli.ok("jobs", "get", "downstream-job")
    assert "depends on:          upstream-job\n" in cli.ok("jobs", "update", "downstream-job", "--priority", "5")
    cli.ok("jobs", "create", "--name", "tick", "--handler", "test.echo", "--cron", "* * * * * *")
    tick = cli.json("jobs", "get", "tick")["id"]
    lines = cli.ok("executions", "watch", "--job", "tick", "--type", "succeeded", "--count", "2").splitlines()
    assert lines[0].split()[:5] == ["TIME", "EVENT", "EXECUTION", "JOB", "ATTEMPT"]
    assert [line.split()[4] for line in lines[1:]] == ["tick", "tick"], lines
    assert not [line for line in lines if str(tick) in line]
    # Executions of every job, and one execution, name their jobs too.
    rows = cli.ok("executions", "list", "--limit", "2").splitlines()
    assert [row.split()[1] for row in rows[1:]] == ["tick", "tick"], rows
    execution = rows[1].split()[0]
    assert re.search(r"^job:\s+tick$", cli.ok("executions", "get", execution), re.MULTILINE)


def test_dlq_requeue_names_the_runs_not_in_the_queue(unscheduled_api: Api, tmp_path: Path) -> None:
    api = unscheduled_api
    cli = _login(api, tmp_path)
    unknown = "00000000-0000-4000-8000-000000000000"
    assert cli.fails("dlq", "requeue", unknown, code=1) == (
        f"schedctl: not in the dead-letter queue default: {unknown}"
    )
    assert unknown in cli.fails("dlq", "purge", unknown, code=1)
    cli.ok("jobs", "create", "--name", "dies", "--handler", "test.fail", "--max-retries", "0")
    dead = cli("--json", "jobs", "trigger", "dies", "--wait", "--wait-timeout", "30s")
    assert dead.returncode == 1, dead.stderr
    run_id = json.loads(dead.stdout)["runId"]
    # One found, one not: the found one is requeued and shown, the other named, exit 1.
    result = cli("dlq", "requeue", run_id, unknown.upper())
    assert result.returncode == 1
    assert result.stdout.splitlines() == ["Requeued 1 dead run", f"  {run_id}"]
    assert result.stderr == f"schedctl: not in the dead-letter queue default: {unknown.upper()}\n"
    result = cli("--json", "dlq", "requeue", unknown)
    assert result.returncode == 1
    assert json.loads(result.stdout) == {"runIds": [], "notFound": [unknown]}


def test_api_field_errors_name_the_flag(server_api: Api, tmp_path: Path) -> None:
    api = server_api
    cli = _login(api, tmp_path)
    create = ["jobs", "create", "--name", "bad", "--handler", "test.echo"]
    cron = cli.fails(*create, "--cron", "61 * * * *", code=2)
    assert cron.startswith("schedctl: --cron: invalid cron expression '61 * * * *': minute field: 61 is outside")
    assert cli.fails("jobs", "preview", "--cron", "* * * * 9", code=2).startswith("schedctl: --cron: ")
    assert cli.fails(*create, "--priority", "5000", code=2).startswith("schedctl: --priority: must be between")
    assert cli.fails(*create, "--max-retries", "-1", code=2).startswith("schedctl: --max-retries: ")
    assert cli.fails(*create, "--time-zone", "Mars/X", "--cron", "* * * * *", code=2).startswith(
        "schedctl: --time-zone: unknown time zone"
    )
    assert cli.fails("jobs", "create", "--name", "log", "--handler", "test.log", "--payload", "{}", code=2).startswith(
        "schedctl: --payload: message: is required"
    )
    assert cli.fails(*create, "--depends-on", "nojob", code=2) == "schedctl: --depends-on: no job 'nojob'"
    assert cli.fails("executions", "get", "nope", code=2) == "schedctl: EXECUTION: 'nope' is not a valid id"
    assert cli.fails("dlq", "requeue", "nope", code=2) == "schedctl: RUN_ID: 'nope' is not a valid id"
    # `jobs delete` of an upstream suggests the flag, not the API's field.
    cli.ok("jobs", "create", "--name", "base", "--handler", "test.echo")
    cli.ok("jobs", "create", "--name", "leaf", "--handler", "test.echo", "--depends-on", "base")
    refused = cli.fails("jobs", "delete", "base", code=1)
    assert re.search(r"other jobs depend on job \S+ \(leaf\)", refused), refused
    assert refused.endswith("or run `schedctl jobs delete base --detach-dependents`")
    assert "detach_dependents" not in refused
    cli.ok("jobs", "delete", "base", "--detach-dependents")


@pytest.mark.parametrize(
    ("message", "command", "expected"),
    [
        ("job.schedule.cron: minute field: 61 is outside 0-59", "jobs", "--cron: minute field: 61 is outside 0-59"),
        ("schedule.time_zone: unknown", "jobs", "--time-zone: unknown"),
        ("job.retry_policy.max_backoff: must be at least initial_backoff", "jobs",
         "--max-backoff: must be at least initial_backoff"),
        ("job.payload.headers.x: not a string", "jobs", "--payload: headers.x: not a string"),
        ("job.depends_on[3]: no job 'x'", "jobs", "--depends-on: no job 'x'"),
        ("id: 'x' is not a valid id", "flows", "FLOW_RUN_ID: 'x' is not a valid id"),
        ("update_mask: unknown field 'x'", "jobs", "update_mask: unknown field 'x'"),
        ("no colon here", "jobs", "no colon here"),
        ("shards: must be an integer from 1 to 64, got 0", "queues", "N: must be an integer from 1 to 64, got 0"),
        ("queue: expected 1-64 letters", "queues", "QUEUE: expected 1-64 letters"),
        ("queue: expected 1-64 letters", "dlq", "--queue: expected 1-64 letters"),
    ],
)  # fmt: skip
def test_flag_message_names_the_flag_of_an_api_field(message: str, command: str, expected: str) -> None:
    assert flag_message(message, command) == expected


_JSON = st.recursive(
    st.none() | st.booleans() | st.text(max_size=5) | st.integers(-(2**60), 2**60).map(float)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


@given(_JSON)
def test_whole_numbers_come_out_as_ints_and_nothing_else_changes(value: object) -> None:
    """What a Struct gives back (every number a float) prints whole numbers without `.0`, and the
    values stay the same numbers (large ones, inexact as ints, stay floats)."""
    shown = show.integral(value)
    assert shown == value

    def floats(item: object) -> list[float]:
        if isinstance(item, float):
            return [item]
        if isinstance(item, dict):
            return [f for child in item.values() for f in floats(child)]
        if isinstance(item, list):
            return [f for child in item for f in floats(child)]
        return []

    assert [f for f in floats(shown) if f.is_integer() and abs(f) <= 2**53] == []
    assert json.dumps(show.integral({"n": 42.0, "r": 1.5, "big": 1e20})) == '{"n": 42, "r": 1.5, "big": 1e+20}'


def test_tls_to_a_plaintext_server_is_one_line(tmp_path: Path) -> None:
    """gRPC's core logs a failed TLS handshake to stderr itself; schedctl keeps it to its one line."""
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler) as plain:
        threading.Thread(target=plain.serve_forever, daemon=True).start()
        try:
            cli = Schedctl(f"127.0.0.1:{plain.server_address[1]}", tmp_path / "schedctl")
            assert "cannot reach" in cli.fails("--tls", "--deadline", "5", "status", code=1)
        finally:
            plain.shutdown()
