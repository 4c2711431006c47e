"""Only real store failures are faults (issue 19, defect 9): `stores.is_fault` on real errors.

A fault is ridden out (logged, retried); anything else ends the role after logging. Each error here
is raised by a real client against the real servers where one can be made to; the others are
instances of the clients' own classes, as they raise them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import timedelta

import asyncpg
import pytest
import redis.asyncio as aioredis
from asyncpg.exceptions import CannotConnectNowError, DeadlockDetectedError, TooManyConnectionsError
from redis.exceptions import BusyLoadingError, DataError, ReadOnlyError

from scheduler_grpc import stores
from scheduler_grpc.connections import redis_client
from scheduler_grpc.embedded import free_port
from scheduler_grpc.errors import Unavailable
from tests.engine_helpers import eventually


async def raised(call: Awaitable[object]) -> BaseException:
    try:
        await call
    except Exception as exc:  # the error a real client raised
        return exc
    raise AssertionError("expected the call to fail")


async def test_redis_faults_and_redis_bugs(redis: aioredis.Redis, redis_url: str) -> None:
    refused_client = redis_client(f"redis://127.0.0.1:{free_port()}", connect_timeout=timedelta(seconds=1))
    try:
        refused = await raised(refused_client.ping())
    finally:
        await refused_client.aclose()
    # A connection the server closes under a blocking call.
    victim = aioredis.Redis.from_url(redis_url, single_connection_client=True, retry_on_error=[])
    try:
        client_id = await victim.client_id()
        blocked = asyncio.ensure_future(victim.blpop(["nothing-here"], timeout=5))

        async def is_blocked() -> bool:
            return any(c["id"] == str(client_id) and c["cmd"] == "blpop" for c in await redis.client_list())

        await eventually(is_blocked)
        await redis.client_kill_filter(_id=client_id)
        killed = await raised(blocked)
    finally:
        await victim.aclose()
    # redis-py's own timeout of a socket that does not answer in time.
    slow = aioredis.Redis.from_url(redis_url, socket_timeout=0.05, retry_on_error=[])
    try:
        timed_out = await raised(slow.blpop(["nothing-here"], timeout=1))
    finally:
        await slow.aclose()
    await redis.config_set("maxmemory", 1)
    try:
        out_of_memory = await raised(redis.set("k", "v"))
    finally:
        await redis.config_set("maxmemory", 0)
    for fault in (refused, killed, timed_out, out_of_memory, ReadOnlyError("READONLY"), BusyLoadingError("loading")):
        assert stores.is_fault(fault), repr(fault)
    await redis.set("a-string", "x")
    bugs = [
        await raised(redis.set("k", {"not": "a value"})),  # type: ignore[arg-type]  # DataError: our argument
        await raised(redis.execute_command("NOSUCHCOMMAND")),
        await raised(redis.zadd("a-string", {"m": 1})),  # WRONGTYPE
        await raised(redis.eval("return redis.call('INCR', KEYS[1], 'x')", 1, "k")),
    ]
    assert isinstance(bugs[0], DataError)
    for bug in bugs:
        assert not stores.is_fault(bug), repr(bug)


async def test_postgres_faults(pool: asyncpg.Pool, database_url: str) -> None:
    refused = await raised(asyncpg.connect(f"postgresql://127.0.0.1:{free_port()}/none", timeout=2))
    # A connection terminated under a running statement (what a restart or a failover does), and
    # what using it afterwards raises.
    conn = await asyncpg.connect(database_url)
    try:
        pid = conn.get_server_pid()
        sleeping = asyncio.ensure_future(conn.fetchval("SELECT pg_sleep(5)"))

        async def is_sleeping() -> bool:
            query = "SELECT query FROM pg_stat_activity WHERE pid = $1 AND state = 'active'"
            return "pg_sleep" in (await pool.fetchval(query, pid) or "")

        await eventually(is_sleeping)
        await pool.execute("SELECT pg_terminate_backend($1)", pid)
        terminated = await raised(sleeping)
        closed = await raised(conn.fetchval("SELECT 1"))
    finally:
        await conn.close()
    async with pool.acquire() as held:
        await held.execute("SET statement_timeout = 50")
        cancelled = await raised(held.fetchval("SELECT pg_sleep(2)"))
        await held.execute("RESET statement_timeout")
        await held.execute("SET default_transaction_read_only = on")  # what a demoted primary answers
        read_only = await raised(held.execute("CREATE TEMP TABLE t (x int)"))
        await held.execute("RESET default_transaction_read_only")
    # A pool closing (its connections being given back) while a call asks it for one.
    closing_pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
    borrowed = await closing_pool.acquire()
    closing = asyncio.ensure_future(closing_pool.close())
    await asyncio.sleep(0.05)
    pool_closing = await raised(closing_pool.acquire())
    await closing_pool.release(borrowed)
    await closing
    timed_out = await raised(asyncio.wait_for(pool.fetchval("SELECT pg_sleep(2)"), 0.05))
    faults = [refused, terminated, closed, cancelled, read_only, pool_closing, timed_out,
              TooManyConnectionsError("sorry, too many clients already"),
              CannotConnectNowError("the database system is starting up"),
              DeadlockDetectedError("deadlock detected")]  # fmt: skip
    for fault in faults:
        assert stores.is_fault(fault), repr(fault)
    assert isinstance(terminated, asyncpg.PostgresError | asyncpg.InterfaceError | OSError)
    assert stores.is_unavailable(terminated)
    assert stores.is_unavailable(pool_closing)


async def test_postgres_bugs(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        busy = asyncio.ensure_future(conn.fetchval("SELECT pg_sleep(0.3)"))
        await asyncio.sleep(0.05)
        in_progress = await raised(conn.fetchval("SELECT 1"))  # our concurrency bug
        await busy
    async with pool.acquire() as conn:
        pass

    async def use_released() -> object:
        return await conn.fetchval("SELECT 1")

    released = await raised(use_released())  # a connection used after its release
    bad_argument = await raised(pool.fetchval("SELECT $1::int", "x"))  # asyncpg's DataError
    bugs = [
        in_progress,
        released,
        bad_argument,
        await raised(pool.execute("SELECT no_such_column FROM jobs")),
        await raised(pool.execute("SELECT 1 / 0")),
        await raised(pool.execute("INSERT INTO jobs (id) VALUES (NULL)")),
    ]
    assert "another operation is in progress" in str(in_progress)
    for bug in bugs:
        assert not stores.is_fault(bug), repr(bug)
        assert not stores.is_unavailable(bug), repr(bug)


@pytest.mark.parametrize(
    ("exc", "fault"),
    [
        (Unavailable("down"), True),
        (TimeoutError(), True),  # our own asyncio.timeout around a call
        (ConnectionResetError(104, "reset by peer"), True),
        (RuntimeError("a bug"), False),
        (ValueError("bad input"), False),
        (KeyError("x"), False),
        (FileNotFoundError(2, "no such file"), False),  # an OSError of our own, not of a store's client
    ],
)
def test_errors_of_no_store(exc: BaseException, fault: bool) -> None:
    assert stores.is_fault(exc) is fault


async def test_an_oserror_raised_inside_a_stores_client_is_a_fault() -> None:
    # A failed lookup: a plain OSError (socket.gaierror), not a ConnectionError, whose frames name asyncpg.
    unknown_host = await raised(asyncpg.connect(host="no-such-host.invalid", port=5432, timeout=5))
    assert type(unknown_host).__name__ == "gaierror"
    assert stores.is_fault(unknown_host)


def test_asyncpgs_internal_state_broken_with_its_connection_is_a_fault() -> None:
    # Raised from a pool's fetch while PostgreSQL shut down fast (make chaos, pg-down-twice): the
    # worker died of it. Each call has its own pooled connection, so no task of ours shared it.
    broken = asyncpg.exceptions._base.InternalClientError(
        "cannot switch to state 12; another operation (2) is in progress"
    )
    assert stores.is_fault(broken)
