"""Valkey and PostgreSQL servers under fault, on fixed loopback ports so clients can come back.

Both come from the same wheels as `scheduler_grpc.embedded` (which starts them); this module adds
what a fault run needs: kill -9 and restart with or without the append-only file, FLUSHALL, errors
of a server that refuses writes (READONLY, OOM), PostgreSQL's fast and immediate shutdowns (the
signals `pg_ctl stop -m fast|immediate` sends to the postmaster), and SIGSTOP of the postmaster
with all its backends. A Valkey Cluster (issue 24, `ChaosValkeyCluster`: the embedded 3 masters
and 3 replicas) adds kill -9, restart and SIGSTOP of one node, and a slot's migration to another
master.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from scheduler_grpc.embedded import EmbeddedPostgres, EmbeddedRedis, EmbeddedValkeyCluster, free_port


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
        self._server = EmbeddedPostgres(data_dir, fast=True, port=free_port())  # fixed: restarts keep it
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


@dataclass(frozen=True)
class ValkeyNode:
    """One node of a Valkey Cluster as `CLUSTER NODES` shows it to the node asked.

    Attributes:
        id: The node's id.
        port: Its client port (loopback).
        master: Whether it is a master (else a replica).
        master_id: A replica's master ("-" for a master).
        slots: The slot ranges a master serves, inclusive.
        failing: The node asked flags it `fail` or `fail?`.
    """

    id: str
    port: int
    master: bool
    master_id: str
    slots: tuple[tuple[int, int], ...]
    failing: bool

    def serves(self, slot: int) -> bool:
        return self.master and any(first <= slot <= last for first, last in self.slots)


def _parse_nodes(text: str) -> list[ValkeyNode]:
    """`CLUSTER NODES`: `id ip:port@bus flags master ping pong epoch link slot...` per line (a
    slot being moved shows as `[slot->-id]` or `[slot-<-id]`: not a served range)."""
    nodes = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        flags = set(fields[2].split(","))
        ranges = []
        for span in fields[8:]:
            if span.startswith("["):
                continue
            first, _, last = span.partition("-")
            ranges.append((int(first), int(last or first)))
        port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
        nodes.append(ValkeyNode(fields[0], port, "master" in flags, fields[3], tuple(ranges),
                                bool(flags & {"fail", "fail?"})))  # fmt: skip
    return nodes


class ChaosValkeyCluster:
    """The embedded Valkey Cluster (3 masters, 3 replicas on loopback, `EmbeddedValkeyCluster`) of
    one scenario, with the faults of one node: kill -9 and restart (it comes back from its
    `nodes.conf`, as a replica of whoever replaced it), SIGSTOP and SIGCONT (cut off from everyone:
    its peers and the clients; connections to it hang), and a slot moved to another master by the
    cluster's own commands, as `valkey-cli --cluster reshard` moves it.

    Every admin command goes to one node by its port, on a connection of its own with a timeout,
    so a stopped or dead node is skipped, never waited on. Start and restart from the long-lived
    servers thread (`Servers.run`): the nodes die with the thread that started them.

    Args:
        data_dir: One subdirectory per node.
        node_timeout: `cluster-node-timeout`: how long a master may be unreachable before its
            replica is promoted.
    """

    def __init__(self, data_dir: Path, node_timeout: timedelta = timedelta(seconds=2)) -> None:
        self._cluster = EmbeddedValkeyCluster(data_dir, node_timeout=node_timeout)
        self._paused: set[int] = set()

    @property
    def url(self) -> str:
        """`redis+cluster://` with every node as a seed: the roles' REDIS_URL."""
        return self._cluster.url

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self._cluster.nodes]

    def start(self) -> None:
        self._cluster.start()

    def stop(self) -> None:
        self.resume_all()
        self._cluster.stop()

    def _server(self, port: int) -> EmbeddedRedis:
        return next(node for node in self._cluster.nodes if node.port == port)

    def pid(self, port: int) -> int | None:
        child = self._server(port)._child
        return None if child is None else child.process.pid

    def kill(self, port: int) -> None:
        """kill -9 of one node (waits until it is gone): what it had not replicated is lost."""
        self._server(port).kill()

    def restart(self, port: int) -> None:
        """Start a killed node again on its port, from its `nodes.conf` (no data: no AOF)."""
        self._server(port).start()

    def pause(self, port: int) -> None:
        """SIGSTOP one node: a partition from everyone (TCP still connects, nothing answers)."""
        pid = self.pid(port)
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)
            self._paused.add(port)

    def resume(self, port: int) -> None:
        pid = self.pid(port)
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        self._paused.discard(port)

    def resume_all(self) -> None:
        for port in list(self._paused):
            self.resume(port)

    def answering(self) -> list[int]:
        """The nodes neither stopped nor killed (the ones an admin command may go to)."""
        return [port for port in self.ports if port not in self._paused and self.pid(port) is not None]

    async def command(self, port: int, *args: object, within: float = 5.0) -> Any:
        """One command to one node (decoded replies)."""
        client = aioredis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_connect_timeout=2,
                                socket_timeout=within)  # fmt: skip
        try:
            async with asyncio.timeout(within):
                return await client.execute_command(*args)  # type: ignore[no-untyped-call]
        finally:
            await client.aclose()

    async def nodes(self, port: int | None = None) -> list[ValkeyNode]:
        """The cluster as node `port` (default: the first answering node) sees it."""
        asked = port if port is not None else self.answering()[0]
        return _parse_nodes(await self.command(asked, "CLUSTER", "NODES"))

    async def slot_of(self, key: str) -> int:
        port = self.answering()[0]
        slot = int(await self.command(port, "CLUSTER", "KEYSLOT", key))
        assert slot == key_slot(key.encode())
        return slot

    async def owner(self, slot: int) -> ValkeyNode:
        """The master serving `slot`, as the first answering node sees it."""
        for node in await self.nodes():
            if node.serves(slot) and not node.failing:
                return node
        raise LookupError(f"no master serves slot {slot}")

    async def serving(self, slot: int, *, not_by: str) -> ValkeyNode | None:
        """The master serving `slot` once another than `not_by` does in the view of every answering
        node, each of them reporting `cluster_state:ok` (a failover completed); else None."""
        found: set[str] = set()
        for port in self.answering():
            try:
                info = await self.command(port, "CLUSTER", "INFO")
                nodes = await self.nodes(port)
            except (RedisError, OSError, TimeoutError):
                return None
            owners = [node for node in nodes if node.serves(slot)]
            if "cluster_state:ok" not in info or len(owners) != 1 or owners[0].id == not_by:
                return None
            found.add(owners[0].id)
        if len(found) != 1:
            return None
        return next(node for node in await self.nodes() if node.id in found)

    async def repl_offset(self, port: int) -> int:
        """How far master `port`'s replication stream has come (what it holds now)."""
        return int((await self.command(port, "INFO", "replication"))["master_repl_offset"])

    async def replicated(self, port: int, offset: int) -> bool:
        """Whether every replica of master `port` has acknowledged its stream up to `offset`.
        Replication is asynchronous: a write the master acknowledged and had not yet sent is lost
        when its replica is promoted, so a test that cuts the master off after a write waits for
        this first. Replicas acknowledge once a second."""
        info = await self.command(port, "INFO", "replication")
        replicas = [value for key, value in info.items() if key.startswith("slave") and isinstance(value, dict)]
        return bool(replicas) and all(int(replica["offset"]) >= offset for replica in replicas)

    async def replica_in_sync(self, port: int) -> ValkeyNode | None:
        """Node `port` as itself, once it is a replica whose link to its master is up."""
        try:
            replication = await self.command(port, "INFO", "replication")
            me = next(node for node in await self.nodes(port) if node.port == port)
        except (RedisError, OSError, TimeoutError, StopIteration):
            return None
        in_sync = replication.get("role") == "slave" and replication.get("master_link_status") == "up"
        return me if in_sync and not me.master else None

    async def migrate_slot(self, slot: int, target: ValkeyNode, *, batch: int = 10, hold: float = 0.0) -> int:
        """Move `slot` to master `target` under load, as `valkey-cli --cluster reshard` does:
        SETSLOT IMPORTING on the target, MIGRATING on the source, MIGRATE of the slot's keys
        `batch` at a time, then SETSLOT NODE on the target, the source and every other master.
        With `hold`, the slot stays half-moved (some keys on each side: single-key commands get
        ASK, multi-key ones TRYAGAIN) that many seconds after the first batch. Returns the number
        of keys moved."""
        source = await self.owner(slot)
        if source.id == target.id:
            raise ValueError(f"slot {slot} is already on {target.port}")
        await self.command(target.port, "CLUSTER", "SETSLOT", slot, "IMPORTING", source.id)
        await self.command(source.port, "CLUSTER", "SETSLOT", slot, "MIGRATING", target.id)
        moved = 0
        while True:
            keys = await self.command(source.port, "CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            # MIGRATE host port "" 0 timeout KEYS k...: atomic per call; "NOKEY" if all expired meanwhile.
            await self.command(source.port, "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys,
                               within=10)  # fmt: skip
            moved += len(keys)
            if hold and moved == len(keys):
                await asyncio.sleep(hold)  # the fault's length: the slot half-moved
        await self.command(target.port, "CLUSTER", "SETSLOT", slot, "NODE", target.id)
        await self.command(source.port, "CLUSTER", "SETSLOT", slot, "NODE", target.id)
        for node in await self.nodes():
            if node.master and node.id not in (source.id, target.id) and node.port in self.answering():
                await self.command(node.port, "CLUSTER", "SETSLOT", slot, "NODE", target.id)
        return moved
