"""Logs are one JSON object per line, with role, pid and the execution's context where it applies."""

from __future__ import annotations

import asyncio
import json
import sys

import asyncpg
import redis.asyncio as aioredis

from scheduler_grpc import logs
from scheduler_grpc.control import Control
from scheduler_grpc.jobs import JobSpec
from tests.conftest import ROOT
from tests.engine_helpers import Roles, eventually, wait_until_ready

BASE_FIELDS = {"time", "level", "role", "pid", "logger", "message"}


async def test_role_logs_are_json_lines_with_context(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    roles.env["SCHEDULER_LOG_LEVEL"] = "DEBUG"
    scheduler = roles.start("scheduler")
    worker = roles.start("worker")
    await wait_until_ready(redis, workers=1)
    job = await control.create_job(JobSpec(name="say", handler="test.log", payload={"message": "hello logs"}))
    run = (await control.trigger_job(job.id))[0]

    async def logged() -> list[dict[str, object]]:
        entries = [json.loads(line) for line in worker.log_lines() if line.startswith("{")]
        messages = {entry.get("message") for entry in entries}
        return entries if {"hello logs", "attempt finished"} <= messages else []

    entries = await eventually(logged, within=15)
    for role in (scheduler, worker):
        lines = [line for line in role.log_lines() if line.strip()]
        assert lines, role.name
        for line in lines:
            entry = json.loads(line)  # every line is one JSON object
            assert entry.keys() >= BASE_FIELDS, entry
            assert entry["role"] == role.name.split("-")[0]
            assert entry["pid"] == role.pid
    said = next(entry for entry in entries if entry["message"] == "hello logs")
    assert said["execution_id"] == run.run_id
    assert said["job_id"] == job.id
    assert said["attempt"] == 1
    assert said["worker_id"]
    finished = [entry for entry in entries if entry["message"] == "attempt finished"]
    assert finished
    assert {"execution_id", "job_id", "worker_id", "attempt"} <= finished[0].keys()


_FLOOD = """
import logging, sys, time
from scheduler_grpc import logs
logs.setup("probe", "INFO", "json")
log = logging.getLogger("probe")
began = time.monotonic()
for i in range(50_000):
    log.info("line %d", i, extra={"filler": "x" * 150})
print(f"done {time.monotonic() - began:.3f}", flush=True)
sys.stdin.readline()  # the parent drains stderr from now on
deadline = time.monotonic() + 30
while logs.pending() and time.monotonic() < deadline:
    time.sleep(0.01)
try:
    raise ValueError("boom")
except ValueError:
    log.exception("after")
"""


async def test_a_stuck_stderr_never_blocks_logging_and_the_queue_is_flushed_at_exit() -> None:
    """Nobody reads the child's stderr (a 64 KiB pipe, full after a few hundred lines): logging goes on,
    the lines beyond the queue are dropped and counted, and what was queued is written at exit."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FLOOD, cwd=ROOT,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert child.stdin is not None
    assert child.stdout is not None
    assert child.stderr is not None
    try:
        # A synchronous write to stderr would block the child here for good.
        done = await asyncio.wait_for(child.stdout.readline(), timeout=60)
        assert done.startswith(b"done"), done
        drained = asyncio.create_task(child.stderr.read())
        child.stdin.write(b"go\n")
        await child.stdin.drain()
        assert await asyncio.wait_for(child.wait(), timeout=60) == 0
        entries = [json.loads(line) for line in (await drained).decode().splitlines()]
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    lines = [entry for entry in entries if entry["message"].startswith("line ")]
    notices = [entry for entry in entries if entry["message"] == "log lines dropped"]
    assert notices
    assert {entry["level"] for entry in notices} == {"WARNING"}
    assert len(lines) + sum(entry["dropped"] for entry in notices) == 50_000
    assert len(lines) >= logs.QUEUE_SIZE  # the queue was written, in order
    numbers = [int(entry["message"].split()[1]) for entry in lines]
    assert numbers == sorted(set(numbers))
    after = entries[-1]
    assert (after["message"], after["role"]) == ("after", "probe")
    assert "ValueError: boom" in after["exception"]
