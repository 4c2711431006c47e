"""schedctl's flow runs: `flows list` with its filters and paging (ListFlowRuns), and `jobs trigger`
of a job with dependents saying which flow run it started, against real server processes."""

from __future__ import annotations

import re
import time
from pathlib import Path

from tests.api_helpers import ADMIN, ADMIN_PASSWORD, Api
from tests.test_client_cli import Schedctl
from tests.test_client_cli import api as api  # noqa: PLC0414 (the fixture, shared)


def test_flows_list_and_the_flow_run_a_trigger_started(api: Api, tmp_path: Path) -> None:
    cli = Schedctl(api.target, tmp_path / "schedctl")
    cli.ok("login", "--username", ADMIN, "--password", ADMIN_PASSWORD)
    cli.ok("jobs", "create", "--name", "extract", "--handler", "test.echo")
    cli.ok("jobs", "create", "--name", "load", "--handler", "test.echo", "--depends-on", "extract")
    cli.ok("jobs", "create", "--name", "alone", "--handler", "test.echo")
    # A job without dependents starts no flow run, and its trigger says nothing of one.
    assert "Flow run" not in cli.ok("jobs", "trigger", "alone")
    said = cli.ok("jobs", "trigger", "extract")
    match = re.search(r"^Flow run ([0-9a-f-]{36}) started \(2 jobs\): schedctl flows get \1$", said, re.M)
    assert match, said
    flow_run = match.group(1)
    second = cli.ok("jobs", "trigger", "extract", "--wait")
    assert "Flow run " in second
    deadline = time.monotonic() + 30
    while any(f["state"] == "FLOW_RUN_STATE_RUNNING" for f in cli.json("flows", "list")["flow_runs"]):
        assert time.monotonic() < deadline, "the flow runs did not finish"
    listed = cli.json("flows", "list")["flow_runs"]
    assert len(listed) == 2
    assert listed[1]["id"] == flow_run  # newest first
    assert {(f["rootJobName"], f["nodeCount"], f["finishedNodeCount"]) for f in listed} == {("extract", 2, 2)}
    table = cli.ok("flows", "list", "--job", "extract", "--state", "succeeded").splitlines()
    assert table[0].split() == ["ID", "STARTED", "BY", "STATE", "JOBS", "DONE", "STARTED", "TOOK"]
    assert len(table) == 3
    assert flow_run in table[2]
    assert "succeeded" in table[2]
    assert "2/2" in table[2]
    assert cli.json("flows", "list", "--state", "failed")["flow_runs"] == []
    assert cli.json("flows", "list", "--job", "load")["flow_runs"] == []
    # Paging: one per page, both found, newest first.
    assert [f["id"] for f in cli.json("flows", "list", "--limit", "1")["flow_runs"]] == [listed[0]["id"]]
    assert "--state" in cli.fails("flows", "list", "--state", "sideways", code=2)
