"""A viewer cannot grow the server's memory by naming queues (issue 19, defect 8).

The server kept a `Queue` (with its 16 registered scripts, ~41 KB) for every valid queue name a
request mentioned, forever: 20,000 names took a server from 84 MB to 902 MB. Queue objects now share
their scripts per Redis client and the server keeps a bounded number of them.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import asyncpg
import grpc
from redis.asyncio import Redis
from scheduler_client.v1 import auth_pb2, auth_pb2_grpc, queue_pb2, queue_pb2_grpc

from scheduler_grpc.db.users import UserRepository
from scheduler_grpc.dispatch import Queues
from tests.api_helpers import start_server, wait_for_server
from tests.engine_helpers import Roles
from tests.test_api_support import FAST_HASHER, Metadata, bearer

NAMES = 6_000  # the defect took ~41 KB a name (246 MB here), ten times the bound
WARM_UP = 2_000  # more than the server keeps: its cache is full and evicting before the measure
IN_FLIGHT = 32
LIMIT_KIB = 20 * 1024


def rss_kib(pid: int) -> int:
    """The resident set size of process `pid`, from /proc (VmRSS, in KiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")


async def ask_about(stub: queue_pb2_grpc.QueueServiceStub, metadata: Metadata, names: list[str]) -> None:
    """GetQueueStats of half the names, ListDeadLetters of the other half, `IN_FLIGHT` at a time."""
    pending = iter(names)

    async def asker() -> None:
        for name in pending:
            if hash(name) % 2:
                await stub.GetQueueStats(queue_pb2.GetQueueStatsRequest(queue=name), metadata=metadata, timeout=30)
            else:
                request = queue_pb2.ListDeadLettersRequest(queue=name, page_size=10)
                await stub.ListDeadLetters(request, metadata=metadata, timeout=30)

    await asyncio.gather(*(asker() for _ in range(IN_FLIGHT)))


async def test_a_viewer_naming_thousands_of_queues_does_not_grow_the_servers_memory(
    roles: Roles, redis: Redis, pool: asyncpg.Pool
) -> None:
    api = start_server(roles)
    await wait_for_server(api)
    await UserRepository(pool).upsert("victor", FAST_HASHER.hash("viewer-password"), "viewer")
    async with grpc.aio.insecure_channel(api.target) as channel:
        login = await auth_pb2_grpc.AuthServiceStub(channel).Login(
            auth_pb2.LoginRequest(username="victor", password="viewer-password")
        )
        viewer = bearer(login.token)
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        names = (f"viewer-{i}" for i in itertools.count())
        await ask_about(stub, viewer, list(itertools.islice(names, WARM_UP)))
        before = rss_kib(api.server.pid)
        await ask_about(stub, viewer, list(itertools.islice(names, NAMES)))
        after = rss_kib(api.server.pid)
    assert after - before < LIMIT_KIB, f"RSS grew by {(after - before) / 1024:.1f} MiB for {NAMES} queue names"


def test_a_bounded_cache_keeps_the_most_recently_used_queues(redis: Redis) -> None:
    queues = Queues(redis, capacity=3)
    first = queues.get("a")
    queues.get("b")
    queues.get("c")
    assert queues.get("a") is first  # used again: now the most recent
    queues.get("d")  # evicts "b", the least recently used
    assert [queue.name for queue in queues.known()] == ["c", "a", "d"]
    assert queues.get("b").name == "b"  # made again when asked for
    unbounded = Queues(redis)
    for name in map(str, range(100)):
        unbounded.get(name)
    assert len(unbounded.known()) == 100  # the leader's: every queue its jobs name


def test_queues_on_one_client_share_their_scripts(redis: Redis) -> None:
    queues = Queues(redis)
    first, second = queues.get("one"), queues.get("two")
    assert first._enqueue.script is second._enqueue.script
    assert first._dequeue.script is second._dequeue.script
    assert first._enqueue.keys != second._enqueue.keys
