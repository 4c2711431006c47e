"""Real servers for every test: embedded Valkey and PostgreSQL unless REDIS_URL / DATABASE_URL are set.

With URLs set, the tests create (and drop) their own PostgreSQL database on that server and FLUSH
the Redis database of REDIS_URL before each test: point them at a server you can wipe.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import redis.asyncio as aioredis
import uvloop

from scheduler_grpc.connections import redis_client
from scheduler_grpc.control import Control
from scheduler_grpc.db.migrate import migrate
from scheduler_grpc.db.pool import create_pool
from scheduler_grpc.embedded import EmbeddedValkeyCluster, ServerUrls, embedded_servers, make_run_dir
from scheduler_grpc.handlers import HandlerSettings, default_registry
from tests.engine_helpers import Roles

ROOT = Path(__file__).resolve().parent.parent
_TIMEOUT = timedelta(seconds=10)


# Test tiers (registered in pyproject.toml; `pytest -m pure` runs one, plain `pytest` runs all).
# A file's own tier wins; otherwise a test is `engine` when it needs the session's servers (any
# fixture built on `servers`), or when its file starts servers or role processes of its own.
_FILE_TIERS = {
    "test_console_browser.py": "browser",
    "test_chaos.py": "chaos",
    "test_client_node.py": "node",
    "test_client_node_bulk.py": "node",
    "test_remote_worker_node.py": "node",
}
# Files that start servers of their own: `scheduler-grpc up` (topology), an embedded Valkey Cluster.
_ENGINE_FILES = {"test_topology.py", "test_valkey_cluster.py"}
TIERS = ("pure", "engine", "browser", "chaos", "node")
BROWSER_TIMEOUT_S = 300
# The process groups of the running Chromiums (tests/test_console_browser.py's `chromium` adds each):
# what a browser test's watchdog kills.
CHROMIUM_GROUPS: set[int] = set()


def tier(item: pytest.Item) -> str:
    """The one tier of a test: browser, chaos, node, engine (Redis/PostgreSQL), else pure."""
    name = item.path.name
    if name in _FILE_TIERS:
        return _FILE_TIERS[name]
    if name.endswith("_browser.py"):  # every file that drives Chromium
        return "browser"
    fixtures = getattr(item, "fixturenames", ())
    if "servers" in fixtures or "cluster_url" in fixtures or name in _ENGINE_FILES:
        return "engine"
    return "pure"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier, so `-m` selects by it. A browser test drives Chromium against a
    whole topology (`up`) on the same 2 cores: it gets 300 s, not the default 120 (a fresh clone's CI
    once ran the flow-run page's test past 120 s while other work loaded the machine)."""
    for item in items:
        kind = tier(item)
        item.add_marker(kind)
        if kind == "browser" and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(BROWSER_TIMEOUT_S))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A browser test still running 10 s before its timeout (in its setup, call or teardown, its
    module's fixtures' included) kills the Chromiums. Playwright's sync calls that wait on the browser
    have no bound of their own (Page.close, BrowserContext.close and Browser.close wait forever on a
    close that meets a navigation commit; page.evaluate on a promise that never settles): with the
    browser gone, the pending call fails at once ("... has been closed") and so does this test, where
    pytest-timeout's thread method would end the whole session. Armed here, around the whole protocol
    like pytest-timeout's own timer, since no fixture's span covers a module's teardown."""
    if tier(item) != "browser":
        return (yield)
    marker = item.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker is not None and marker.args else BROWSER_TIMEOUT_S
    after = max(timeout - 10, timeout / 2)
    watchdog = threading.Timer(after, _kill_chromiums, (item.nodeid, after))
    watchdog.daemon = True
    watchdog.start()
    try:
        return (yield)
    finally:
        watchdog.cancel()


def _kill_chromiums(nodeid: str, after: float) -> None:
    groups = sorted(CHROMIUM_GROUPS)
    # Captured as the running phase's stderr: the failing test's report shows why its browser died.
    sys.stderr.write(f"\n+++ watchdog: {nodeid} still running after {after:.0f} s: SIGKILL to Chromium {groups}\n")
    sys.stderr.flush()
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], object]]:
    """Every async test runs on uvloop, as the service does."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def servers() -> Iterator[ServerUrls]:
    data_dir = Path(os.environ.get("SCHEDULER_DATA_DIR") or ROOT / ".data")
    with embedded_servers(
        data_dir,
        redis_url=os.environ.get("REDIS_URL") or None,
        database_url=os.environ.get("DATABASE_URL") or None,
        throwaway=True,
    ) as urls:
        yield urls


@pytest.fixture(scope="session")
def cluster_url() -> Iterator[str]:
    """A Valkey Cluster (3 masters, 3 replicas) for this session: REDIS_CLUSTER_URL if set (a
    `redis+cluster://` URL of a cluster the tests may wipe), else an embedded one on loopback."""
    if os.environ.get("REDIS_CLUSTER_URL"):
        yield os.environ["REDIS_CLUSTER_URL"]
        return
    data_dir = Path(os.environ.get("SCHEDULER_DATA_DIR") or ROOT / ".data").resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    run_dir = make_run_dir(data_dir, "-cluster")
    cluster = EmbeddedValkeyCluster(run_dir)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def _with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + database))


@pytest.fixture(scope="session")
def database_url(servers: ServerUrls) -> Iterator[str]:
    """A database of this test session's own, migrated once."""
    name = f"scheduler_test_{os.getpid()}_{time.time_ns() % 10**9}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(servers.database_url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    async def create() -> None:
        await admin(f'CREATE DATABASE "{name}"')
        pool = await create_pool(_with_database(servers.database_url, name), size=2, connect_timeout=_TIMEOUT)
        try:
            await migrate(pool)
        finally:
            await pool.close()

    uvloop.run(create())
    yield _with_database(servers.database_url, name)
    uvloop.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


_TABLES = ("job_executions", "jobs", "leader_state", "api_keys", "users", "limits", "queue_shards")
# The tables `TRUNCATE _TABLES CASCADE` empties (_TABLES and every table referencing one of them,
# transitively: the foreign keys PostgreSQL's CASCADE follows), each with the tables it references;
# partitions are emptied with their partitioned table (and come and go: retention drops them).
_CASCADE = """
WITH RECURSIVE closure(rel) AS (
    SELECT oid FROM pg_class WHERE relnamespace = 'public'::regnamespace AND relname = ANY($1::text[])
    UNION
    SELECT con.conrelid FROM pg_constraint con JOIN closure ON con.confrelid = closure.rel WHERE con.contype = 'f'
)
SELECT c.relname, array(SELECT DISTINCT con.confrelid::regclass::text FROM pg_constraint con
                        WHERE con.conrelid = c.oid AND con.contype = 'f' AND con.confrelid <> c.oid) AS parents
FROM pg_class c WHERE c.oid IN (SELECT rel FROM closure) AND NOT c.relispartition ORDER BY c.relname
"""
# A table holding at most this many rows is emptied by DELETE, else by TRUNCATE.
_FEW_ROWS = 1000
_empty_order: list[str] = []


async def _tables_children_first(pool: asyncpg.Pool) -> list[str]:
    """The tables `TRUNCATE _TABLES CASCADE` empties, each after every table referencing it (read
    once: the schema does not change during a session)."""
    if not _empty_order:
        parents = {row["relname"]: set(row["parents"]) for row in await pool.fetch(_CASCADE, list(_TABLES))}
        while parents:
            leaves = sorted(t for t in parents if not any(t in others for others in parents.values()))
            assert leaves, f"a cycle of foreign keys among {sorted(parents)}"
            _empty_order.extend(leaves)
            for table in leaves:
                del parents[table]
    return _empty_order


async def empty_tables(pool: asyncpg.Pool) -> None:
    """Leave every table `TRUNCATE _TABLES CASCADE` empties empty, at a fraction of its cost.

    A TRUNCATE recreates the files of every table and index it names, rows or not (30-150 ms for
    these ~50 relations on the loaded 2-core machine, before each of ~530 tests), while a test
    leaves most tables empty and the others with a few rows. So: one statement counts each table's
    rows (up to `_FEW_ROWS` + 1); tables holding none are left alone; if those holding rows hold
    few, they are emptied by DELETE (children first: ~1 ms), else by TRUNCATE ... CASCADE as before.
    """
    tables = await _tables_children_first(pool)
    if not tables:
        return
    limit = _FEW_ROWS + 1
    counts = await pool.fetchrow(
        "SELECT " + ", ".join(f'(SELECT count(*) FROM (SELECT FROM "{t}" LIMIT {limit}) x) AS "{t}"' for t in tables)
    )
    assert counts is not None
    dirty = [table for table in tables if counts[table]]
    if not dirty:
        return
    if all(counts[table] <= _FEW_ROWS for table in dirty):
        await pool.execute("; ".join(f'DELETE FROM "{table}"' for table in dirty))
    else:
        await pool.execute(f"TRUNCATE {', '.join(dirty)} CASCADE")


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool on the session database, emptied before the test."""
    pool = await create_pool(database_url, size=10, connect_timeout=_TIMEOUT)
    await empty_tables(pool)
    try:
        yield pool
    finally:
        await pool.close()


# The files whose Redis tests run twice, against the single server and against the embedded Valkey
# Cluster (issue 24): the queue's and the leader's; engine tests elsewhere opt in with `cluster_too`.
CLUSTER_FILES = frozenset({"test_valkey_cluster.py", "test_queue.py", "test_leader.py", "test_sharded_queue.py"})


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each test of a `CLUSTER_FILES` file, or marked `cluster_too`, that uses Redis runs on `single`
    and on `cluster`."""
    chosen = metafunc.definition.path.name in CLUSTER_FILES or metafunc.definition.get_closest_marker("cluster_too")
    if chosen and "redis_backend" in metafunc.fixturenames:
        metafunc.parametrize("redis_backend", ["single", "cluster"], indirect=True)


@pytest.fixture
def redis_backend(request: pytest.FixtureRequest) -> str:
    """`single` (the session's one server) or `cluster` (the session's Valkey Cluster)."""
    return str(getattr(request, "param", "single"))


@pytest.fixture
def redis_url(redis_backend: str, servers: ServerUrls, request: pytest.FixtureRequest) -> str:
    if redis_backend == "cluster":
        return str(request.getfixturevalue("cluster_url"))
    return servers.redis_url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client on a flushed Redis database (every master of a cluster flushed), made as the roles
    make theirs (`connections.redis_client`): without a socket timeout. With one, redis-py sends each
    command under `asyncio.wait_for`, which on Python 3.11 can swallow the cancellation of a call
    bounded by `asyncio.timeout`: a queue's timed wait for a due time then sleeps its whole block."""
    client = redis_client(redis_url)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def deadline() -> Callable[[float], float]:
    """`deadline(5)` -> a monotonic instant 5 s from now, for poll-until loops."""
    return lambda seconds: time.monotonic() + seconds


@pytest.fixture
def roles(redis_url: str, database_url: str, tmp_path: Path) -> Iterator[Roles]:
    """Role processes (scheduler, worker) against the test servers; stopped after the test."""
    started = Roles(redis_url, database_url, tmp_path)
    try:
        yield started
    finally:
        started.stop_all()
        print(started.dump_logs())  # shown by pytest only when the test failed


@pytest.fixture
async def control(redis: aioredis.Redis, pool: asyncpg.Pool) -> AsyncIterator[Control]:
    registry = default_registry(
        HandlerSettings(shell_enabled=True, dev_mode=True, webhook_allowlist=(ipaddress.ip_network("127.0.0.1/32"),))
    )
    try:
        yield Control(redis, pool, registry)
    finally:
        await registry.aclose()
