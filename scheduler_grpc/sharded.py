"""A sharded queue (issue 24): one `Queue` per shard, behind the `Queue` interface.

`ShardedQueue` is what every role uses for a queue: with one shard (the default) each call goes
straight to the queue's own keys, unchanged. With more (`sharding.ShardMap`), it places each new
item on its shard (`ShardPlan.shard_of`: limits on shard 0, others by a stable hash of the run id
under the count in effect when the run was made), takes work from every shard round-robin, and
routes every move of a lease to the shard that leased it: a lease token of shard i > 0 reads
`<i>~<token>` (shard 0's are the queue's own, unchanged), and since a token travels with its run
(the claim token in PostgreSQL, a remote worker's resume) every later move finds its shard. The
leader's moves (recover, promote), the reads (states, counts, dead letters) and the removals go to
every shard served (`ShardPlan.served`: the highest count the queue ever had).

Ordering a sharded queue promises: within a shard, priority then FIFO, exactly as an unsharded
queue; across shards none beyond this: a dequeue takes from the shards in turn, starting one shard
later each call, so a ready run waits behind at most one dequeue batch from each other shard per
turn, and no shard is starved. Runs that take limits are all on shard 0, so limits (caps, rates,
paused keys, the fairness between keys) are exactly an unsharded queue's. Limit calls (definitions,
keys, holds, `blocked_by`) act on shard 0: they are this class's own `Queue` methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, Final, TypeVar, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from scheduler_grpc import pagetokens
from scheduler_grpc.errors import InvalidArgument, LeaseLost
from scheduler_grpc.queue import (
    CALL_TIMEOUT,
    DEFAULT_MAX_STALLS,
    MAX_BATCH,
    SOLO_RETRY_DELAY,
    DeadItem,
    DeadPage,
    ItemState,
    Lease,
    Leased,
    LimitDefinition,
    LimitKey,
    NewItem,
    Queue,
    QueueStats,
    Recovered,
    _check_id,
    item_args,
)
from scheduler_grpc.script_calls import ScriptCall
from scheduler_grpc.sharding import ShardMap, ShardPlan

log = logging.getLogger(__name__)

T = TypeVar("T")

_SEP: Final = "~"
_DEFAULT_WAIT: Final = timedelta(seconds=5)
_MAX_BLOCK_S: Final = 2.0
_BLOCK_MARGIN_S: Final = 1.0


def wrap_token(shard: int, token: str) -> str:
    """The token a caller sees for a lease of `shard`."""
    return token if shard == 0 else f"{shard}{_SEP}{token}"


def unwrap_token(token: str) -> tuple[int, str]:
    """(shard, the shard's own token) of a token `wrap_token` made."""
    head, sep, rest = token.partition(_SEP)
    if sep and head.isdigit():
        return int(head), rest
    return 0, token


def _unwrapped(lease: Lease | tuple[str, str]) -> tuple[int, Lease | tuple[str, str]]:
    if isinstance(lease, Lease):
        shard, token = unwrap_token(lease.token)
        return shard, dataclasses.replace(lease, token=token) if shard else lease
    item_id, raw = lease
    shard, token = unwrap_token(raw)
    return shard, (item_id, token)


class ShardedQueue(Queue):
    """One queue over its shards (see the module's docstring). Arguments as `Queue`'s, plus:

    Args:
        shard_map: Where the shard counts come from (shared by the process's queues).
    """

    def __init__(
        self,
        redis: Redis,
        name: str = "default",
        *,
        shard_map: ShardMap,
        blocking_redis: Redis | None = None,
        call_timeout: timedelta = CALL_TIMEOUT,
        max_stalls: int = DEFAULT_MAX_STALLS,
    ) -> None:
        super().__init__(redis, name, blocking_redis=blocking_redis, call_timeout=call_timeout, max_stalls=max_stalls)
        self.shard_map = shard_map
        self._make: Callable[[int], Queue] = lambda shard: Queue(
            redis, name, blocking_redis=blocking_redis, call_timeout=call_timeout, max_stalls=max_stalls, shard=shard
        )
        self._shards: list[Queue] = [self._make(0)]
        self._turn = 0
        self._solo_shard: int | None = None  # the shard whose solo item this caller was told to drain

    def shard_queue(self, index: int) -> Queue:
        """The plain `Queue` of one shard."""
        while len(self._shards) <= index:
            self._shards.append(self._make(len(self._shards)))
        return self._shards[index]

    async def served(self) -> list[Queue]:
        """Every shard consumers serve now."""
        plan = await self.shard_map.current()
        return [self.shard_queue(index) for index in range(plan.served(self.name))]

    async def _placing(self, items: Sequence[NewItem]) -> ShardPlan:
        return await self.shard_map.placing([item.id for item in items if not item.limits])

    # -- adding work ----------------------------------------------------------------------------

    async def enqueue(
        self,
        item_id: str,
        *,
        priority: int = 0,
        data: bytes | str = b"",
        delay: timedelta | None = None,
        limits: Iterable[LimitKey] = (),
    ) -> bool:
        limits = tuple(limits)
        if not isinstance(item_id, str):
            return await self.shard_queue(0).enqueue(item_id, priority=priority, data=data, delay=delay, limits=limits)
        plan = await self._placing([NewItem(item_id, limits=limits)])
        target = self.shard_queue(plan.shard_of(self.name, item_id, has_limits=bool(limits)))
        return await target.enqueue(item_id, priority=priority, data=data, delay=delay, limits=limits)

    async def enqueue_many(self, items: Iterable[NewItem], definitions: Iterable[LimitDefinition] = ()) -> int:
        items, definitions = list(items), list(definitions)
        if not items:
            return await self.shard_queue(0).enqueue_many(items, definitions)
        calls = await self.enqueue_calls(items, definitions)
        # The shards' scripts run at once (on a cluster each is a round trip to its own master, in
        # parallel rather than in series).
        return sum(int(reply) for reply in await _all([self._bounded(call.send()) for call in calls]))

    async def enqueue_calls(
        self, items: Iterable[NewItem], definitions: Iterable[LimitDefinition] = ()
    ) -> list[ScriptCall]:
        """The script calls of `enqueue_many`, one per shard that gets items, for a caller that sends
        them along with other calls (`script_calls.run_together`); each call's reply is the number
        of its items added.

        Raises:
            InvalidArgument: naming the first bad field (every item is checked before any call is made).
        """
        items = list(items)
        args = [item_args(item, f"items[{index}].{{}}".format) for index, item in enumerate(items)]
        plan = await self._placing(items)
        by_shard: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
        for item, item_arguments in zip(items, args, strict=True):
            by_shard[plan.shard_of(self.name, item.id, has_limits=bool(item.limits))].append(item_arguments)
        # Definitions go to shard 0, where every run with limits is.
        calls = [self.shard_queue(0).enqueue_call(by_shard.pop(0, []), definitions)]
        calls += [self.shard_queue(index).enqueue_call(batch) for index, batch in sorted(by_shard.items())]
        return [call for call in calls if call is not None]

    # -- taking work ----------------------------------------------------------------------------

    async def dequeue(
        self,
        worker_id: str,
        visibility_timeout: timedelta,
        count: int = 1,
        *,
        reserve: timedelta = timedelta(0),
        reserve_count: int = 0,
        idle: bool = False,
        held: int = 0,
    ) -> Leased:
        _check_id(worker_id, "worker_id")
        shards = await self.served()
        leases, _ = await self._take_all(
            shards, worker_id=worker_id, visibility_timeout=visibility_timeout, count=count,
            reserve=reserve, reserve_count=reserve_count, idle=idle, held=held,
        )  # fmt: skip
        return leases

    async def _take_all(
        self,
        shards: Sequence[Queue],
        *,
        worker_id: str,
        visibility_timeout: timedelta,
        count: int,
        reserve: timedelta,
        reserve_count: int,
        idle: bool,
        held: int = 0,
    ) -> tuple[Leased, float | None]:
        """One dequeue over the shards in turn, starting one shard later than the last call. `held`
        is the caller's reservations on all shards: each shard's fair share counts its part of
        them as the placement spreads runs, evenly."""
        if len(shards) == 1:
            return await shards[0]._take(
                worker_id, visibility_timeout, count, reserve, reserve_count, idle=idle, held=held
            )
        held_here = -(-held // len(shards))
        start = self._turn % len(shards)
        self._turn += 1
        if idle and self._solo_shard is not None and self._solo_shard < len(shards):
            # Told to drain a solo item: the idle dequeue starts on its shard, where it is served.
            start, self._solo_shard = self._solo_shard, None
        taken: list[Lease] = []
        ready = reserved = 0
        next_due: float | None = None
        solo_waiting = False
        try:
            for step in range(len(shards)):
                index = (start + step) % len(shards)
                leases, due = await shards[index]._take(
                    worker_id,
                    visibility_timeout,
                    count - ready,
                    reserve,
                    reserve_count - reserved,
                    idle=idle and not taken,
                    held=held_here,
                )
                for lease in leases:
                    taken.append(dataclasses.replace(lease, token=wrap_token(index, lease.token)))
                    if lease.due_in is None:
                        ready += 1
                    else:
                        reserved += 1
                if leases and leases[0].solo:
                    break  # a solo delivery runs alone: nothing more beside it
                if leases.solo_waiting:
                    solo_waiting = True
                    self._solo_shard = index
                    break
                if due is not None:
                    next_due = due if next_due is None else min(next_due, due)
                if ready >= count:
                    break
        except asyncio.CancelledError:
            if taken:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.finish_many(retries=[(t, t.due_in or timedelta(0)) for t in taken]))
            raise
        return Leased(taken, solo_waiting=solo_waiting), (None if taken else next_due)

    async def dequeue_blocking(
        self,
        worker_id: str,
        visibility_timeout: timedelta,
        count: int = 1,
        wait: timedelta = _DEFAULT_WAIT,
        *,
        reserve: timedelta = timedelta(0),
        reserve_count: int = 0,
        idle: bool = False,
        held: Callable[[], int] | None = None,
    ) -> Leased:
        """`Queue.dequeue_blocking` over every shard: an idle wait wakes on any shard's marker."""
        shards = await self.served()
        if len(shards) == 1:
            return await shards[0].dequeue_blocking(
                worker_id, visibility_timeout, count, wait, reserve=reserve, reserve_count=reserve_count, idle=idle,
                held=held,
            )  # fmt: skip
        _check_id(worker_id, "worker_id")
        if wait < timedelta(0):
            raise InvalidArgument("wait", "must not be negative")
        loop = asyncio.get_running_loop()
        end = loop.time() + wait.total_seconds()
        while True:
            leases, next_due = await self._take_all(
                shards, worker_id=worker_id, visibility_timeout=visibility_timeout, count=count,
                reserve=reserve, reserve_count=reserve_count, idle=idle, held=held() if held is not None else 0,
            )  # fmt: skip
            if leases or leases.solo_waiting:
                return leases
            remaining = end - loop.time()
            if remaining <= 0:
                return leases
            block = min(remaining, _MAX_BLOCK_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(next_due if next_due is not None and next_due < block else None):
                    await _wait_any(shards, block)
            shards = await self.served()

    # -- finishing work -------------------------------------------------------------------------

    async def ack(self, item_id: str, token: str) -> bool:
        return (await self.ack_many([(item_id, token)]))[0]

    async def ack_many(self, leases: Iterable[Lease | tuple[str, str]]) -> list[bool]:
        return await self._routed(list(leases), lambda shard, batch: shard.ack_many(batch))

    async def nack(
        self,
        item_id: str,
        token: str,
        delay: timedelta = timedelta(0),
        *,
        count_delivery: bool = True,
        retry_after: timedelta | None = None,
    ) -> bool:
        leases = [(item_id, token)]
        return (await self.nack_many(leases, delay, count_delivery=count_delivery, retry_after=retry_after))[0]

    async def nack_many(
        self,
        leases: Iterable[Lease | tuple[str, str]],
        delay: timedelta = timedelta(0),
        *,
        count_delivery: bool = True,
        retry_after: timedelta | None = None,
    ) -> list[bool]:
        return await self._routed(
            list(leases),
            lambda shard, batch: shard.nack_many(batch, delay, count_delivery=count_delivery, retry_after=retry_after),
        )

    async def finish_many(
        self,
        acks: Iterable[Lease] = (),
        retries: Iterable[tuple[Lease, timedelta]] = (),
        dead: Iterable[tuple[Lease, str]] = (),
    ) -> list[bool]:
        # One entry per lease in the reply's order: (kind, lease, extra).
        entries: list[tuple[str, Lease | tuple[str, str], Any]] = [
            *(("a", lease, None) for lease in acks),
            *(("r", lease, delay) for lease, delay in retries),
            *(("d", lease, reason) for lease, reason in dead),
        ]

        async def finish(shard: Queue, batch: list[tuple[str, Lease, Any]]) -> list[bool]:
            return await shard.finish_many(
                [lease for kind, lease, _ in batch if kind == "a"],
                [(lease, extra) for kind, lease, extra in batch if kind == "r"],
                [(lease, extra) for kind, lease, extra in batch if kind == "d"],
            )

        # Within a shard the reply is acks, retries, dead: the entries are already in that order.
        return await _route_entries(self, entries, finish)

    async def extend(self, item_id: str, token: str, more_time: timedelta) -> datetime:
        [deadline] = await self.extend_many([(item_id, token)], more_time)
        if deadline is None:
            raise LeaseLost(f"queue {self.name!r}: the lease on item {item_id!r} was lost")
        return deadline

    async def extend_many(
        self, leases: Iterable[Lease | tuple[str, str]], more_time: timedelta
    ) -> list[datetime | None]:
        return await self._routed(list(leases), lambda shard, batch: shard.extend_many(batch, more_time))

    async def _routed(
        self,
        leases: list[Lease | tuple[str, str]],
        call: Callable[[Queue, list[Any]], Any],
    ) -> list[Any]:
        entries: list[tuple[str, Lease | tuple[str, str], Any]] = [("", lease, None) for lease in leases]

        async def run(shard: Queue, batch: list[tuple[str, Any, Any]]) -> list[Any]:
            return list(await call(shard, [lease for _, lease, _ in batch]))

        return await _route_entries(self, entries, run)

    # -- maintenance (the leader's loops) -------------------------------------------------------

    async def recover_expired(
        self,
        limit: int = MAX_BATCH,
        *,
        max_deliveries: int | None = None,
        solo_retry_delay: timedelta = SOLO_RETRY_DELAY,
    ) -> Recovered:
        """`Queue.recover_expired` on every shard (up to `limit` each: a reply of `limit` or more
        items in all means more may have expired). Tokens are wrapped as the worker saw them."""
        requeued: list[str] = []
        dead: list[str] = []
        tokens: list[str] = []
        for shard in await self.served():
            got = await shard.recover_expired(limit, max_deliveries=max_deliveries, solo_retry_delay=solo_retry_delay)
            requeued += got.requeued
            dead += got.dead
            tokens += [wrap_token(shard.shard, token) for token in got.tokens]
        return Recovered(requeued=requeued, dead=dead, tokens=tokens)

    async def promote_due(self, limit: int = MAX_BATCH) -> list[str]:
        """`Queue.promote_due` on every shard (up to `limit` each)."""
        promoted: list[str] = []
        for shard in await self.served():
            promoted += await shard.promote_due(limit)
        return promoted

    # -- dead letters ---------------------------------------------------------------------------

    async def dead_letter(self, item_id: str, token: str | None, reason: str) -> bool:
        if token:
            index, own = unwrap_token(token)
            return await self.shard_queue(index).dead_letter(item_id, own, reason)
        for shard in await self.served():
            if await shard.dead_letter(item_id, None, reason):
                return True
        return False

    async def list_dead(self, page_size: int = 100, page_token: str | None = None) -> DeadPage:
        """Dead items shard by shard, each shard's ordered by time parked, then id (a page of shard
        0 alone carries `Queue.list_dead`'s own token)."""
        shards = await self.served()
        index, inner = (0, page_token) if not page_token else self._decode_dead_token(page_token)
        if len(shards) == 1 and index == 0:
            return await shards[0].list_dead(page_size, inner)
        items: list[DeadItem] = []
        while index < len(shards):
            page = await shards[index].list_dead(page_size - len(items), inner or None)
            items += page.items
            if page.next_page_token is not None:
                return DeadPage(items, self._encode_dead_token(index, page.next_page_token))
            index, inner = index + 1, None
            if len(items) >= page_size:
                break
        more = index < len(shards)
        return DeadPage(items, self._encode_dead_token(index, "") if more else None)

    def _encode_dead_token(self, index: int, inner: str) -> str:
        if index == 0:
            return inner
        return pagetokens.encode("dead_letter_shards", {"queue": self.name}, [index, inner])

    def _decode_dead_token(self, token: str) -> tuple[int, str | None]:
        try:
            position = pagetokens.decode(token, "dead_letter_shards", {"queue": self.name})
        except InvalidArgument:
            return 0, token  # shard 0's own token (checked by its `list_dead`)
        if len(position) != 2 or not isinstance(position[0], int) or not isinstance(position[1], str):
            raise InvalidArgument("page_token", "not a token this server issued")
        return position[0], position[1] or None

    async def requeue_dead(self, ids: Iterable[str] | None, *, batch: int = MAX_BATCH) -> list[str]:
        wanted = None if ids is None else list(ids)
        done: list[str] = []
        for shard in await self.served():
            done += await shard.requeue_dead(wanted, batch=batch)
        return done

    async def purge_dead(
        self, ids: Iterable[str] | None, *, older_than: timedelta | None = None, batch: int = MAX_BATCH
    ) -> list[str]:
        wanted = None if ids is None else list(ids)
        done: list[str] = []
        for shard in await self.served():
            done += await shard.purge_dead(wanted, older_than=older_than, batch=batch)
        return done

    async def restore_dead(self, items: Iterable[tuple[NewItem, str]]) -> int:
        """Parks each item on its shard (the shard it would be enqueued on)."""
        pairs = list(items)
        plan = await self._placing([item for item, _ in pairs])
        by_shard: dict[int, list[tuple[NewItem, str]]] = defaultdict(list)
        for item, reason in pairs:
            by_shard[plan.shard_of(self.name, item.id, has_limits=bool(item.limits))].append((item, reason))
        parked = 0
        for index, batch in sorted(by_shard.items()):
            parked += await self.shard_queue(index).restore_dead(batch)
        return parked

    # -- inspection and cancellation ------------------------------------------------------------

    async def remove(self, item_id: str) -> bool:
        return (await self.remove_many([item_id]))[0]

    async def remove_many(self, ids: Iterable[str]) -> list[bool]:
        wanted = list(ids)
        removed = [False] * len(wanted)
        for shard in await self.served():
            left = [i for i, flag in enumerate(removed) if not flag]
            if not left:
                break
            flags = await shard.remove_many([wanted[i] for i in left])
            for i, flag in zip(left, flags, strict=True):
                removed[i] = flag
        return removed

    async def states(self, ids: Iterable[str]) -> dict[str, ItemState | None]:
        result: dict[str, ItemState | None] = dict.fromkeys(ids)
        for shard in await self.served():
            unknown = [item_id for item_id, state in result.items() if state is None]
            if not unknown:
                break
            result.update({k: v for k, v in (await shard.states(unknown)).items() if v is not None})
        return result

    async def stats(self) -> QueueStats:
        """`Queue.stats` summed over the shards (each shard's a snapshot of its own)."""
        totals = [await shard.stats() for shard in await self.served()]
        return QueueStats(
            ready=sum(s.ready for s in totals),
            processing=sum(s.processing for s in totals),
            delayed=sum(s.delayed for s in totals),
            dead=sum(s.dead for s in totals),
            shards=len(totals),
        )

    async def ready_by_band(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for shard in await self.served():
            for band, count in (await shard.ready_by_band()).items():
                totals[band] = totals.get(band, 0) + count
        return totals


async def _route_entries(
    queue: ShardedQueue,
    entries: Sequence[tuple[str, Lease | tuple[str, str], Any]],
    call: Callable[[Queue, list[Any]], Any],
) -> list[Any]:
    """Group entries by their token's shard, call each shard once, and give the replies back in the
    entries' order."""
    by_shard: dict[int, list[tuple[int, tuple[str, Any, Any]]]] = defaultdict(list)
    for position, (kind, lease, extra) in enumerate(entries):
        index, own = _unwrapped(lease)
        by_shard[index].append((position, (kind, own, extra)))
    shards = sorted(by_shard.items())
    # Every shard at once: on a cluster each shard is a round trip to its own master.
    answered = await _all([call(queue.shard_queue(index), [entry for _, entry in batch]) for index, batch in shards])
    replies: list[Any] = [None] * len(entries)
    for (_, batch), answers in zip(shards, answered, strict=True):
        for (position, _), answer in zip(batch, answers, strict=True):
            replies[position] = answer
    return replies


async def _all(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Await every call concurrently; once all have ended, raise the first failure, if any. A
    single call is awaited as is (no task)."""
    if len(calls) == 1:
        return [await calls[0]]
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return cast("list[T]", results)


async def _wait_any(shards: Sequence[Queue], seconds: float) -> None:
    """Block on every shard's marker at once until one is set or `seconds` pass. On one server, one
    BZPOPMIN of every marker (`Queue.wait_for_any`); on a cluster (the markers are in different
    slots), one waiting connection per shard, the waits left cancelled when one ends (a cancelled
    wait that took its marker sets it again, `Queue.wait_for_work`)."""
    if not isinstance(shards[0].blocking_client, RedisCluster):
        await shards[0].wait_for_any(shards, timedelta(seconds=seconds))
        return
    tasks = [asyncio.ensure_future(shard.wait_for_work(timedelta(seconds=seconds))) for shard in shards]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        woken = any([task.result() for task in done])  # a store fault raises here
        if not woken and pending:
            # Timed out, not woken: the other waits had the same timeout and end at the server's
            # next tick. Waiting for them keeps their connections (a cancelled wait's is dropped,
            # and the pool opens another for the next wait).
            done, _ = await asyncio.wait(pending, timeout=_BLOCK_MARGIN_S)
            for task in done:
                task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
