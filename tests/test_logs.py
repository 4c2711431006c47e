"""Logs are one JSON object per line, with role, pid and the execution's context where it applies."""

from __future__ import annotations

import json

import asyncpg
import redis.asyncio as aioredis

from scheduler_grpc.control import Control
from scheduler_grpc.jobs import JobSpec
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
