"""The Node.js client's batchTriggerJobs against a real server (BatchTriggerJobs)."""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import pytest
from scheduler_client.v1 import jobs_pb2

from tests.test_api_support import Harness, api, echo_job  # noqa: F401 - `api` is a fixture
from tests.test_client_node import NODE, NODE_DIR, NPM, node_modules  # noqa: F401 - `node_modules` is a fixture

NODE_SCRIPT = """
const { SchedulerClient } = require('./client');
(async () => {
  const client = new SchedulerClient(process.env.ADDRESS, { token: process.env.TOKEN });
  const job = process.env.JOB;
  const items = Array.from({ length: 1200 }, (_, n) => ({ id: job, requestId: `node-${n}`, payload: { n } }));
  items.push(process.env.MISSING, job);
  const results = await client.batchTriggerJobs(items);
  const again = await client.batchTriggerJobs(items.slice(0, 1200));
  let invalid = '';
  try {
    await client.batchTriggerJobs([...Array(1000).fill(job), 'nope']);
  } catch (error) {
    invalid = `${error.codeName} ${error.message}`;
  }
  const one = await client.triggerJob(job, '', { k: 'v' });
  console.log(JSON.stringify({
    ok: results.filter((r) => r.execution).length,
    errors: results.filter((r) => r.error).map((r) => [results.indexOf(r), r.error.codeName]),
    same: again.every((r, i) => r.execution.id === results[i].execution.id),
    invalid,
    one: one.job_id,
  }));
  client.close();
})().catch((error) => { console.error(error); process.exit(1); });
"""


@pytest.mark.skipif(NODE is None or NPM is None, reason="node and npm are needed")
async def test_node_client_trigger_jobs(api: Harness, node_modules: None) -> None:  # noqa: F811
    assert NODE is not None
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    missing = str(uuid.uuid4())
    env = {**os.environ, "ADDRESS": api.server.address, "TOKEN": api.operator[0][1].removeprefix("Bearer "),
           "JOB": job.id, "MISSING": missing}  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        NODE, "-e", NODE_SCRIPT, cwd=NODE_DIR, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    assert json.loads(stdout) == {
        "ok": 1201,
        "errors": [[1200, "NOT_FOUND"]],
        "same": True,
        "invalid": "INVALID_ARGUMENT requests[1000].id: 'nope' is not a valid id",
        "one": job.id,
    }
    count = await api.server.api.control._pool.fetchval("SELECT count(*) FROM job_executions")
    assert count == 1201 + 1000 + 1
