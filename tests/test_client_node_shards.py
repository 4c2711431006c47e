"""The Node.js client's shard counts against a real server (GetQueueShards, ListQueueShards,
SetQueueShards): set and read back, bad input INVALID_ARGUMENT naming the field, a viewer refused."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from tests.test_api_support import Harness, api  # noqa: F401 - `api` is a fixture
from tests.test_client_node import NODE, NODE_DIR, NPM, node_modules  # noqa: F401 - `node_modules` is a fixture

NODE_SCRIPT = """
const { SchedulerClient, fromTimestamp } = require('./client');
(async () => {
  const admin = new SchedulerClient(process.env.ADDRESS, { token: process.env.ADMIN });
  const viewer = new SchedulerClient(process.env.ADDRESS, { token: process.env.VIEWER });
  const refused = async (call) => {
    try { await call(); return 'OK'; } catch (error) { return `${error.codeName} ${error.message}`; }
  };
  const change = await admin.setQueueShards('reports', 3);
  await admin.setQueueShards('mail', 2);
  const one = await viewer.getQueueShards('reports');
  const every = await viewer.listQueueShards({ pageSize: 1 });
  console.log(JSON.stringify({
    change: [change.shards, fromTimestamp(change.effective_time) > new Date()],
    one: [one.queue, one.shards, one.served_shards, one.changes.map((c) => c.shards)],
    every: every.map((q) => [q.queue, q.served_shards]),
    tooMany: await refused(() => admin.setQueueShards('reports', 65)),
    badQueue: await refused(() => admin.setQueueShards('bad#queue', 2)),
    viewer: (await refused(() => viewer.setQueueShards('reports', 2))).split(' ')[0],
  }));
  admin.close();
  viewer.close();
})().catch((error) => { console.error(error); process.exit(1); });
"""


@pytest.mark.skipif(NODE is None or NPM is None, reason="node and npm are needed")
async def test_node_client_sets_and_reads_shard_counts(api: Harness, node_modules: None) -> None:  # noqa: F811
    assert NODE is not None
    env = {
        **os.environ,
        "ADDRESS": api.server.address,
        "ADMIN": api.admin[0][1].removeprefix("Bearer "),
        "VIEWER": api.viewer[0][1].removeprefix("Bearer "),
    }
    process = await asyncio.create_subprocess_exec(
        NODE, "-e", NODE_SCRIPT, cwd=NODE_DIR, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    result = json.loads(stdout)
    assert result.pop("tooMany").startswith("INVALID_ARGUMENT shards: must be an integer from 1 to 64")
    assert result.pop("badQueue").startswith("INVALID_ARGUMENT queue: expected 1-64 letters")
    assert result == {
        "change": [3, True],  # effective a lead time ahead (SCHEDULER_QUEUE_SHARD_LEAD)
        "one": ["reports", 1, 3, [3]],
        "every": [["mail", 2], ["reports", 3]],
        "viewer": "PERMISSION_DENIED",
    }
    rows = await api.server.api.control._pool.fetch("SELECT queue, shards FROM queue_shards ORDER BY queue")
    assert [tuple(row) for row in rows] == [("mail", 2), ("reports", 3)]
