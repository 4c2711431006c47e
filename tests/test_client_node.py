"""The Node.js client: its example logs in, creates a job, triggers it and watches it succeed."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess

import asyncpg
import pytest
import redis.asyncio as aioredis

from tests.api_helpers import Api, start_api
from tests.conftest import ROOT
from tests.engine_helpers import Roles

NODE_DIR = ROOT / "clients" / "node"
NODE = shutil.which("node")
NPM = shutil.which("npm")

pytestmark = pytest.mark.skipif(NODE is None or NPM is None, reason="node and npm are needed")


@pytest.fixture(scope="module")
def node_modules() -> None:
    """`npm ci` (from the committed lock file) when node_modules is missing."""
    if (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return
    assert NPM is not None
    result = subprocess.run([NPM, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True, text=True,
                            timeout=300, check=False)  # fmt: skip
    if result.returncode != 0:
        pytest.fail(f"npm ci failed ({result.returncode}):\n{result.stderr[-2000:]}")


@pytest.fixture
async def api(node_modules: None, roles: Roles, redis: aioredis.Redis, pool: asyncpg.Pool) -> Api:
    return await start_api(roles, redis)


async def test_node_example_watches_its_execution_succeed(api: Api) -> None:
    assert NODE is not None
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SCHEDCTL_")},
        "SCHEDCTL_SERVER": api.target,
        "EXAMPLE_TIMEOUT_MS": "30000",
    }
    process = await asyncio.create_subprocess_exec(
        NODE, "example.js", cwd=NODE_DIR, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    out, err = stdout.decode(), stderr.decode()
    assert process.returncode == 0, f"exit {process.returncode}\n{out}\n{err}"
    lines = out.splitlines()
    assert any("logged in to" in line for line in lines), out
    assert any("created job node-example-" in line for line in lines), out
    assert any("triggered: execution" in line for line in lines), out
    assert any("event EVENT_TYPE_SUCCEEDED" in line for line in lines), out
    success = [line for line in lines if line.startswith("OK: execution ")]
    assert len(success) == 1, out
    assert success[0].endswith("SUCCEEDED")
