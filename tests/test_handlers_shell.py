"""shell.command: off by default, no shell, scrubbed environment, and no orphans on cancel or timeout."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.handlers import ExecutionContext, HandlerError, HandlerSettings, PermanentHandlerError, ShellHandler
from scheduler_grpc.handlers.shell import TERM_GRACE_SECONDS, scrubbed_env

ENABLED = HandlerSettings(shell_enabled=True)
SHELL = ShellHandler()

# A parent that dies on SIGTERM and a child that ignores it. "parent child" pids are written to
# the file "$1" once the child has set up its trap.
STUBBORN_TREE = """
sh -c 'trap "" TERM; echo child-started; echo $$ > "$0"; sleep 30' "$1.child" &
while [ ! -s "$1.child" ]; do sleep 0.01; done
echo "$$ $(cat "$1.child")" > "$1"
wait
"""


def make_ctx(settings: HandlerSettings = ENABLED) -> ExecutionContext:
    return ExecutionContext(
        execution_id="exec-1",
        job_id="job-1",
        job_name="shell-job",
        attempt=1,
        scheduled_for=datetime(2025, 1, 1, tzinfo=UTC),
        timeout=timedelta(seconds=30),
        settings=settings,
        maintenance=None,
        log=logging.getLogger("test.shell"),
    )


async def run(payload: dict[str, Any]) -> Any:
    return await SHELL.run(make_ctx(), SHELL.validate(payload, ENABLED))


def gone(pid: int) -> bool:
    """True when `pid` no longer runs (absent, or a zombie waiting for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


async def wait_for_pids(path: Path, until: float) -> list[int]:
    while True:
        text = path.read_text() if path.exists() else ""  # noqa: ASYNC240 - a tiny local file
        if text.endswith("\n"):
            return [int(pid) for pid in text.split()]
        assert time.monotonic() < until, "the command never wrote its pids"
        await asyncio.sleep(0.01)


async def wait_until_gone(pids: list[int], until: float) -> None:
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < until, f"orphans left: {[pid for pid in pids if not gone(pid)]}"
        await asyncio.sleep(0.01)


async def test_disabled_by_default() -> None:
    with pytest.raises(InvalidArgument) as err:
        SHELL.validate({"argv": ["true"]}, HandlerSettings())
    assert err.value.field == "handler"
    assert err.value.message == "shell.command is disabled; set SCHEDULER_SHELL_ENABLED=true"
    with pytest.raises(PermanentHandlerError, match="SCHEDULER_SHELL_ENABLED"):
        await SHELL.run(make_ctx(HandlerSettings()), {"argv": ["true"]})
    assert ShellHandler.admin_only is True


async def test_argv_runs_without_a_shell() -> None:
    result = await run({"argv": ["echo", "$HOME;id", "`id`", "a b"]})
    assert result["exit_code"] == 0
    assert result["stdout_tail"] == "$HOME;id `id` a b\n"
    assert result["stderr_tail"] == ""
    assert result["elapsed_ms"] >= 0
    explicit = await run({"argv": ["sh", "-c", "echo $((6 * 7))"]})
    assert explicit["stdout_tail"] == "42\n"


async def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCHEDULER_TEST_SECRET", "hunter2")
    monkeypatch.setenv("TZ", "UTC")
    result = await run({"argv": ["env"], "env": {"JOB_VAR": "x=1"}})
    variables = dict(line.split("=", 1) for line in result["stdout_tail"].splitlines())
    assert "SCHEDULER_TEST_SECRET" not in variables
    assert "hunter2" not in result["stdout_tail"]
    assert variables["JOB_VAR"] == "x=1"
    assert variables["TZ"] == "UTC"
    assert set(variables) <= {"PATH", "LANG", "LC_ALL", "TZ", "HOME", "JOB_VAR", "PWD", "SHLVL", "_"}
    assert scrubbed_env({}, {"AWS_SECRET_ACCESS_KEY": "k", "HOME": "/root"}) == {"HOME": "/root", "PATH": os.defpath}


async def test_cwd(tmp_path: Path) -> None:
    result = await run({"argv": ["pwd"], "cwd": str(tmp_path)})
    assert result["stdout_tail"].strip() == os.path.realpath(tmp_path)  # noqa: ASYNC240
    with pytest.raises(HandlerError, match="not an existing directory"):
        await run({"argv": ["pwd"], "cwd": str(tmp_path / "missing")})


async def test_non_zero_exit_is_a_handler_error() -> None:
    with pytest.raises(HandlerError) as err:
        await run({"argv": ["sh", "-c", "echo out; echo 'disk full' >&2; exit 3"]})
    assert not isinstance(err.value, PermanentHandlerError)
    assert "exit code 3" in err.value.message
    assert "disk full" in err.value.message
    details: Any = err.value.details
    assert details["exit_code"] == 3
    assert (details["stdout_tail"], details["stderr_tail"]) == ("out\n", "disk full\n")
    assert details["elapsed_ms"] >= 0


async def test_missing_program_is_a_handler_error() -> None:
    with pytest.raises(HandlerError, match="no such program"):
        await run({"argv": ["definitely-not-a-program-xyz"]})


async def test_output_is_bounded_to_the_tail() -> None:
    result = await run({"argv": ["sh", "-c", "head -c 300000 /dev/zero | tr '\\0' a; printf END"]})
    assert len(result["stdout_tail"]) == 4096
    assert result["stdout_tail"].endswith("aaaEND")


async def test_cancel_kills_the_whole_group(tmp_path: Path, deadline: Callable[[float], float]) -> None:
    pids_file = tmp_path / "pids"
    task = asyncio.ensure_future(run({"argv": ["sh", "-c", STUBBORN_TREE, "tree", str(pids_file)]}))
    pids = await wait_for_pids(pids_file, deadline(5))
    assert len(pids) == 2
    assert not any(gone(pid) for pid in pids)
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < TERM_GRACE_SECONDS + 0.5  # SIGTERM ignored: SIGKILL after the grace
    await wait_until_gone(pids, deadline(1))


async def test_timeout_kills_the_whole_group(tmp_path: Path, deadline: Callable[[float], float]) -> None:
    pids_file = tmp_path / "pids"
    started = time.monotonic()
    with pytest.raises(HandlerError, match=r"timed out after 0\.3s") as err:
        await run({"argv": ["sh", "-c", STUBBORN_TREE, "tree", str(pids_file)], "timeout_seconds": 0.3})
    assert time.monotonic() - started < 0.3 + TERM_GRACE_SECONDS + 0.5
    details: Any = err.value.details
    assert "child-started" in details["stdout_tail"]
    await wait_until_gone(await wait_for_pids(pids_file, deadline(1)), deadline(1))


async def test_leftover_background_processes_are_killed(tmp_path: Path, deadline: Callable[[float], float]) -> None:
    pids_file = tmp_path / "pids"
    started = time.monotonic()
    result = await run({"argv": ["sh", "-c", 'sleep 30 & echo "$!" > "$1"; echo done', "bg", str(pids_file)]})
    assert result["exit_code"] == 0
    assert result["stdout_tail"] == "done\n"
    assert time.monotonic() - started < 2
    await wait_until_gone(await wait_for_pids(pids_file, deadline(1)), deadline(1))


async def test_a_second_cancel_does_not_cut_cleanup_short(tmp_path: Path, deadline: Callable[[float], float]) -> None:
    pids_file = tmp_path / "pids"
    task = asyncio.ensure_future(run({"argv": ["sh", "-c", STUBBORN_TREE, "tree", str(pids_file)]}))
    pids = await wait_for_pids(pids_file, deadline(5))
    task.cancel()
    await wait_until_gone(pids[:1], deadline(1))  # SIGTERM took the parent; the child is in its grace period
    assert not gone(pids[1])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until_gone(pids, deadline(1))


def live_pids_mentioning(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if token.encode() in cmdline and not gone(int(entry.name)):
                found.append(int(entry.name))
    return found


async def test_cancel_at_any_point_leaves_no_process(tmp_path: Path, deadline: Callable[[float], float]) -> None:
    token = str(tmp_path / "tree")
    for yields in range(6):  # cancel during the spawn, right after it, and while running
        task = asyncio.ensure_future(run({"argv": ["sh", "-c", STUBBORN_TREE, "tree", f"{token}{yields}"]}))
        for _ in range(yields):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        until = deadline(1)
        while live := live_pids_mentioning(token):
            assert time.monotonic() < until, f"orphans left after cancel at yield {yields}: {live}"
            await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({}, "payload.argv"),
        ({"argv": []}, "payload.argv"),
        ({"argv": "ls -l"}, "payload.argv"),
        ({"argv": ["ls", 3]}, "payload.argv[1]"),
        ({"argv": [""]}, "payload.argv[0]"),
        ({"argv": ["ls", "a\0b"]}, "payload.argv[1]"),
        ({"argv": ["ls", "x" * 4097]}, "payload.argv[1]"),
        ({"argv": ["ls"] * 257}, "payload.argv"),
        ({"argv": ["ls"], "cwd": "relative/dir"}, "payload.cwd"),
        ({"argv": ["ls"], "env": {"BAD-NAME": "x"}}, "payload.env"),
        ({"argv": ["ls"], "env": {"OK": 1}}, "payload.env.OK"),
        ({"argv": ["ls"], "timeout_seconds": 0}, "payload.timeout_seconds"),
        ({"argv": ["ls"], "shell": True}, "payload.shell"),
    ],
)
def test_validation_errors_name_the_field(payload: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        SHELL.validate(payload, ENABLED)
    assert err.value.field == field


def test_validate_normalises() -> None:
    assert SHELL.validate({"argv": ["ls", "-l"], "cwd": "/tmp", "timeout_seconds": 5}, ENABLED) == {
        "argv": ["ls", "-l"],
        "cwd": "/tmp",
        "env": {},
        "timeout_seconds": 5.0,
    }
