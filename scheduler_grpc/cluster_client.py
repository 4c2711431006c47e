"""The roles' Valkey Cluster client: redis-py's `RedisCluster`, which also checks its slot map when
a node goes silent.

redis-py learns a new slot map from a node's error (a lost or refused connection, its own socket
timeout, CLUSTERDOWN) or a `MOVED` answer. A master that accepts connections but never answers (cut
off, stopped, its host frozen) gives neither: the roles bound each call with `asyncio.timeout`
rather than a socket timeout (see `connections.redis_client`), and that timeout cancels the call
inside the client, which then sees no error at all. When the cluster promotes the silent master's
replica, redis-py would go on sending the slot's commands to the old master until it answers again.

So a call unanswered after `UNANSWERED_AFTER` (but a blocking command's wait), or cancelled after
waiting `SILENT_AFTER` for its node (`ClusterClient.execute_command` and the pipelines' `execute`:
the one place every command passes), starts a `SlotMapWatch` in the background, one at a time and
`INTERVAL` apart at least: it asks every known node for `CLUSTER SLOTS` (each bounded by
`PROBE_TIMEOUT`, judged as the answers come); as soon as a node that answers names another master
for a slot than the client's map, the client's map is loaded again at once (redis-py's
`NodesManager.initialize`, a silent node asked last), the connections of the silent nodes that serve
no slot any more are closed (the calls still waiting on them fail with a connection error at once,
and redis-py resends them by the new map), and the watch ends; while a node stays silent and the map
is unchanged (the cluster has not failed over yet) it asks again every `INTERVAL`, for `WATCH_FOR`
at most. The hot path never waits for it; a refresh is logged once, when it happens. A role notices
a silent master about a second after its first call to it, whatever its calls' own timeouts
(`SCHEDULER_CONNECT_TIMEOUT`, 5 s, for most).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable
from typing import Any, Final, TypeVar

from redis.asyncio.cluster import ClusterNode, ClusterPipeline, NodesManager, RedisCluster
from redis.cluster import get_node_name
from redis.typing import EncodableT

log = logging.getLogger(__name__)
T = TypeVar("T")

SILENT_AFTER: Final = 0.1
"""A call cancelled after waiting this long (seconds) for its node makes the client check its map."""
UNANSWERED_AFTER: Final = 1.0
"""A call (not a blocking command) still unanswered after this long (seconds) makes the client check
its map, whatever its own timeout."""
_BLOCKING: Final = frozenset(
    {
        "BLPOP",
        "BRPOP",
        "BLMOVE",
        "BRPOPLPUSH",
        "BLMPOP",
        "BZPOPMIN",
        "BZPOPMAX",
        "BZMPOP",
        "XREAD",
        "XREADGROUP",
        "WAIT",
        "WAITAOF",
    }
)
PROBE_TIMEOUT: Final = 1.0
"""How long (seconds) a node may take to answer `CLUSTER SLOTS` before it counts as silent."""
INTERVAL: Final = 0.5
"""Seconds between two checks of one watch (a check itself lasts up to `PROBE_TIMEOUT`)."""
WATCH_FOR: Final = 30.0
"""Seconds a watch goes on while a node stays silent and the map is unchanged (a later cancelled
call starts another)."""
REFRESH_TIMEOUT: Final = 5.0
"""Bound (seconds) on loading the map again (redis-py asks the nodes one after the other)."""


class SlotMapWatch:
    """Checks one cluster client's slot map against the nodes that answer; see the module docstring.

    Args:
        nodes: The client's `nodes_manager` (its node cache, slot map and `initialize`).
    """

    def __init__(self, nodes: NodesManager) -> None:
        self._nodes = nodes
        self._task: asyncio.Task[None] | None = None
        self._checked_at = -math.inf  # monotonic: when the last check began
        self._seen_silent: set[str] = set()  # nodes that let a probe of this watch time out
        self.checks = 0
        """Checks begun: every node asked for its map (for tests)."""
        self.refreshes = 0
        """Slot maps loaded again because a node named another master for a slot (for tests)."""

    def suspect(self) -> None:
        """A call was cancelled while its node had not answered: check the map in the background,
        unless a check is under way or due (checks begin `INTERVAL` apart at least, however many
        calls are cancelled)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="cluster-slot-map-watch")

    async def watching(self, call: Awaitable[T], *, blocking: bool) -> T:
        """`call`, suspecting a silent node when it has waited `UNANSWERED_AFTER` (unless it is a
        `blocking` command, which waits by design) or is cancelled after `SILENT_AFTER`."""
        began = time.monotonic()
        timer = None if blocking else asyncio.get_running_loop().call_later(UNANSWERED_AFTER, self.suspect)
        try:
            return await call
        except asyncio.CancelledError:
            if time.monotonic() - began >= SILENT_AFTER:
                self.suspect()
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def stop(self) -> None:
        """Cancel a check under way (the client is closing)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _watch(self) -> None:
        until = time.monotonic() + WATCH_FOR
        self._seen_silent = set()
        while True:
            await asyncio.sleep(max(0.0, self._checked_at + INTERVAL - time.monotonic()))
            self._checked_at = time.monotonic()
            self.checks += 1
            try:
                silent, stale = await self._check()
                if stale:
                    await self._refresh(silent, stale)
                    return
            except Exception as exc:  # a watch never fails a call: the next cancelled call tries again
                log.debug("Valkey Cluster slot map check failed: %r", exc)
                return
            if not silent or time.monotonic() >= until:
                return

    async def _check(self) -> tuple[list[ClusterNode], dict[str, str]]:
        """The nodes that have not answered, and the slots' masters (range -> node name) that an
        answering node sees otherwise than the client's map. Judged as the answers come: once one
        shows the map stale, the nodes still silent are not waited for."""
        probes = {asyncio.ensure_future(_slots(node)): node for node in self._nodes.nodes_cache.values()}
        pending = set(probes)
        stale: dict[str, str] = {}
        try:
            while pending and not stale:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for probe in done:
                    for first, last, host, port in probe.result() or ():
                        master = get_node_name(*self._nodes.remap_host_port(host, port))
                        if self._serves_otherwise(first, last, master):
                            stale[f"{first}-{last}"] = master
            if stale and pending and not any(probes[probe].name in self._seen_silent for probe in pending):
                # Which of the nodes not answered yet is silent is not known (redis-py must not ask
                # it first when it loads the map): wait for their probes, each bounded.
                await asyncio.wait(pending)
                pending = set()
        finally:
            for probe in pending:
                probe.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._seen_silent.update(
            node.name for probe, node in probes.items() if probe not in pending and probe.result() is None
        )
        silent = [node for probe, node in probes.items() if probe in pending or probe.result() is None]
        silent.sort(key=lambda node: node.name not in self._seen_silent)  # the ones known silent first
        return silent, stale

    def _serves_otherwise(self, first: int, last: int, name: str) -> bool:
        cache = self._nodes.slots_cache
        return any(not cache.get(slot) or cache[slot][0].name != name for slot in range(first, last + 1))

    async def _refresh(self, silent: list[ClusterNode], stale: dict[str, str]) -> None:
        """Load the map again; then close the connections of the silent nodes that serve no slot in
        it: the calls still waiting on them (sent before the new map) would wait out their own
        timeouts, and closed they fail at once with a connection error, on which redis-py loads the
        map again and resends them to the slot's master (the queue's scripts that are not
        idempotent carry a request key: `resend`)."""
        async with asyncio.timeout(REFRESH_TIMEOUT):
            await self._nodes.initialize(last_failed_node_name=silent[0].name if silent else None)
            masters = {nodes[0].name for nodes in self._nodes.slots_cache.values() if nodes}
            dropped = [node for node in silent if node.name not in masters]
            await asyncio.gather(*(node.disconnect() for node in dropped), return_exceptions=True)
        self.refreshes += 1
        log.warning(
            "Valkey Cluster: slot map refreshed from the nodes that answer (silent, calls resent: %s; now served: %s)",
            ", ".join(node.name for node in silent) or "none",
            ", ".join(f"{span} -> {name}" for span, name in stale.items()),
        )


async def _slots(node: ClusterNode) -> list[tuple[int, int, str, int]] | None:
    """`CLUSTER SLOTS` of one node as (first, last, master's host, master's port) ranges; None if it
    did not answer within `PROBE_TIMEOUT` (or failed)."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT):
            reply = await node.execute_command("CLUSTER SLOTS")
    except Exception:
        return None
    ranges = []
    for first, last, master, *_ in reply:
        host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
        ranges.append((int(first), int(last), host or node.host, int(master[1])))
    return ranges


class ClusterClient(RedisCluster):
    """`RedisCluster` whose calls left unanswered start a `SlotMapWatch` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slot_map_watch = SlotMapWatch(self.nodes_manager)

    async def execute_command(self, *args: EncodableT, **kwargs: Any) -> Any:
        blocking = isinstance(args[0], str) and args[0].upper() in _BLOCKING if args else False
        return await self.slot_map_watch.watching(super().execute_command(*args, **kwargs), blocking=blocking)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # (refused by redis-py)
        # (redis-py's typing declares an attribute abstract that its own ClusterPipeline sets at run time)
        return _Pipeline(self, transaction)  # type: ignore[abstract]

    async def aclose(self) -> None:
        await self.slot_map_watch.stop()
        await super().aclose()


class _Pipeline(ClusterPipeline):
    """A pipeline of a `ClusterClient`: left unanswered, it starts the watch."""

    def __init__(self, client: ClusterClient, transaction: Any | None = None) -> None:
        super().__init__(client, transaction)
        self._watch = client.slot_map_watch

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        return await self._watch.watching(super().execute(raise_on_error, allow_redirections), blocking=False)
