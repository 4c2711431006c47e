"""Valkey and PostgreSQL servers under fault, on fixed loopback ports so clients can come back.

Both come from the same wheels as `scheduler_grpc.embedded` (which starts them); this module adds
what a fault run needs: kill -9 and restart with or without the append-only file, FLUSHALL, errors
of a server that refuses writes (READONLY, OOM), PostgreSQL's fast and immediate shutdowns (the
signals `pg_ctl stop -m fast|immediate` sends to the postmaster), and SIGSTOP of the postmaster
with all its backends.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from scheduler_grpc.embedded import EmbeddedPostgres, EmbeddedRedis, free_port


async def _wait_for(check: object, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert callable(check)
        if check():
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{what} within {within}s")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children_of(pid: int) -> list[int]:
    """Direct children of `pid` (PostgreSQL's backends and auxiliary processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


class ChaosRedis:
    """One Valkey on a fixed port that can be killed, flushed and restarted.

    Args:
        data_dir: Its directory (log, append-only file).
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.persistent = False
        self._server: EmbeddedRedis | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *, persistent: bool = False) -> None:
        """Start (again) on the same port; `persistent` loads and keeps the append-only file."""
        self.persistent = persistent
        self._server = EmbeddedRedis(self.data_dir, persistent=persistent, port=self.port)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def kill(self) -> None:
        """kill -9: whatever was not in the append-only file is gone."""
        if self._server is not None:
            self._server.kill()
            self._server = None

    def client(self) -> aioredis.Redis:
        """A client that reconnects after a restart (a dropped connection is retried on a new one)."""
        return aioredis.Redis.from_url(
            self.url,
            socket_connect_timeout=2,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=5),
            retry_on_error=[RedisConnectionError],
        )

    async def _call(self, *args: object) -> object:
        client = self.client()
        try:
            async with asyncio.timeout(10):
                return await client.execute_command(*args)  # type: ignore[no-untyped-call]
        finally:
            await client.aclose()

    async def flushall(self) -> None:
        await self._call("FLUSHALL")

    async def enable_aof(self) -> None:
        """Turn the append-only file on at runtime and wait until it holds the current data."""
        await self._call("CONFIG", "SET", "appendonly", "yes")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            fields = await self._call("INFO", "persistence")  # parsed by redis-py into a dict
            assert isinstance(fields, dict)
            idle = fields.get("aof_rewrite_in_progress") == 0 and fields.get("aof_rewrite_scheduled") == 0
            if idle and fields.get("aof_enabled") == 1 and fields.get("aof_rewrites", 0) >= 1:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError("the append-only file was not written within 20s")

    async def refuse_writes_oom(self) -> None:
        """Every write fails with OOM (maxmemory below what is used, noeviction)."""
        await self._call("CONFIG", "SET", "maxmemory", "1")

    async def accept_writes(self) -> None:
        await self._call("CONFIG", "SET", "maxmemory", "0")

    async def become_replica(self) -> None:
        """Writes fail with READONLY: a replica of a master that does not exist (as after a failover
        that demoted this node). Its data is kept: the sync with the absent master never completes."""
        await self._call("REPLICAOF", "127.0.0.1", str(free_port()))

    async def become_master(self) -> None:
        await self._call("REPLICAOF", "NO", "ONE")


class ChaosPostgres:
    """One PostgreSQL cluster on a fixed port with fast and immediate stops and SIGSTOP.

    Args:
        data_dir: The cluster directory (initdb on first start).
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._server = EmbeddedPostgres(data_dir, fast=True)
        self.port = self._server.port
        self._stopped: list[int] = []

    @property
    def url(self) -> str:
        return self._server.url

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self.cont()
        self._server.stop()

    def postmaster_pid(self) -> int | None:
        """The postmaster's pid from `postmaster.pid`, as pg_ctl finds it."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if _alive(pid) else None

    async def shutdown(self, mode: str) -> None:
        """`pg_ctl stop -m fast` (SIGINT: disconnect clients, checkpoint) or `-m immediate`
        (SIGQUIT: no checkpoint; crash recovery at the next start). Waits until it is gone."""
        signum = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}[mode]
        pid = self.postmaster_pid()
        if pid is None:
            return
        os.kill(pid, signum)
        await _wait_for(lambda: not _alive(pid), 30, f"PostgreSQL did not stop ({mode})")
        self._server.stop()  # reaps the child

    async def restart(self) -> None:
        await asyncio.to_thread(self._server.start)

    def freeze(self) -> int:
        """SIGSTOP the postmaster and every backend: connections hang, new ones wait in the backlog.

        Returns:
            How many processes were stopped.
        """
        pid = self.postmaster_pid()
        if pid is None:
            return 0
        self._stopped = [pid, *_children_of(pid)]
        for each in self._stopped:
            try:
                os.kill(each, signal.SIGSTOP)
            except ProcessLookupError:
                continue
        return len(self._stopped)

    def cont(self) -> None:
        """SIGCONT whatever `freeze` stopped."""
        for each in self._stopped:
            try:
                os.kill(each, signal.SIGCONT)
            except ProcessLookupError:
                continue
        self._stopped = []
