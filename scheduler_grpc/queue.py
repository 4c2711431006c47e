"""The reliable priority queue: Redis sorted sets moved between by one Lua script per operation.

An item is an id (an execution UUID later), a priority, an opaque payload and, optionally, limit
keys. It is in exactly one of four sorted sets of its queue (all keys share the hash tag
`{q:<name>}`, see `QueueKeys`), except that an item with limit keys waits in its group's backlog
where another would wait in ready (see "Keyed flow control" below):

- ready: waiting to run, scored `(PRIORITY_MAX - priority) * 2**42 + seq`, so the lowest score is the
  most urgent item and, within a priority, the earliest to become ready. `seq` comes from `INCR`, so
  the order is exact for items of any age: unlike `now - priority * 1e6` no amount of waiting lets a
  lower priority overtake a higher one, and the score stays an exact integer in a double
  (2001 * 2**42 < 2**53).
- processing: leased to a worker until a deadline (ms, Redis clock). Each delivery gets a fresh
  token; ack, nack, extend and dead_letter act only under the current token, so a worker whose lease
  expired and was recovered changes nothing ("lease lost").
- delayed: due at a time (ms, Redis clock, rounded up at enqueue so an item is never due early);
  every dequeue first moves the due ones to ready (so do `promote_due` and the leader's loop). A
  dequeue with a reserve window also leases delayed items due within it straight from the delayed
  set (a worker's reservations, started at their due time), when ready items do not fill it.
- dead: parked with a reason; listed, requeued or purged by an operator.

Stalls are charged to the run that caused them: an item dead-lettered as stalled has had
`max_stalls` deliveries whose leases expired, the last of them a *solo* delivery, alone on an idle
worker. An item that stalled `max_stalls - 1` times waits in the solo set (a set of ids, empty in
normal operation, so the dequeue pays one SCARD for the rule): busy workers skip it, keeping its
place, and one of them (the drainer) is told to become idle; an idle worker gets it alone. So the
items that merely shared a worker with a poison one, which die with that worker, are never parked
for it: their own solo delivery succeeds.

Every time comes from Redis `TIME` inside the scripts, never from a client clock; durations in this
API are `timedelta`, turned into integer milliseconds only at the Redis boundary.

Idle workers do not poll: they block in `BZPOPMIN` on the queue's marker, a one-member sorted set
that every script making work ready sets (BullMQ's marker pattern), so an enqueue wakes one of them
at once and the marker persists until consumed, which rules out a lost wake-up. An empty dequeue
says when the earliest delayed item is due, and the wait ends then; an enqueue of a delayed item
that becomes the earliest sets the marker too, so a waiter learns the new time.

Keyed flow control (limits). An item may carry limit keys (`NewItem.limits`: `LimitKey(limit, key,
units)`), resolved by the caller; the definitions (`LimitDefinition`: a concurrency cap per key, or
a GCRA rate per key with a burst, see `gcra.py`; per-key overrides) live in the queue's `limdef`
hash, written by `put_limit_definitions` or along with an `enqueue_many`. Limit state is per queue,
under its hash tag: jobs on two queues that name the same limit and key are counted separately. An
item with limit keys never enters ready: whenever it would (enqueue, promote, nack, hand-back,
recover, requeue), it joins its *group*'s backlog, the group being the canonical string of its
sorted limit keys (`gcra.encode_group`), ordered by the same ready score (priority, then FIFO). A
dequeue serves the active groups round-robin, merged with ready by ready score, and leases a
group's best run only when every key admits its units: a concurrency key while the units held
leave room (a run asking for more than the limit runs when its key holds none), a rate key by
GCRA, a paused key never. Taking the units is part of the lease script. A group found blocked is
parked (on the key for a concurrency unit, a pause or a missing definition; in the `gdelay` set
until the exact GCRA retry time or the pause's end), `gblock` recording why and since when
(`blocked_by`). So a key with a huge backlog delays no other key, and the work per dequeue grows
with the groups that have room (at most `count + 8` group turns per call), never with the parked
ones; an empty dequeue's wait accounts for the earliest parked group's time. Concurrency units are
held exactly while the lease is: every script that ends a lease (ack, finish, nack, recover,
dead_letter) gives them back through the run's `holds` record, deleted on return, so a resent or
late return gives nothing back twice, and a returned unit wakes the groups parked on its key.
`pause_key`/`resume_key` pause a key by hand; `nack(retry_after=)` pauses the run's keys and hands
the run back without counting the delivery. `key_state` reads a key. In a queue where no item
carries limit keys, every item takes exactly the path above, and each script call pays one EXISTS
more (whether any item does), not a lookup per item.

The queue knows nothing of gRPC or PostgreSQL; the scheduler records what `recover_expired`,
`dead_letter`, `requeue_dead` and `purge_dead` report.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Final

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from scheduler_grpc import pagetokens, resend, stores
from scheduler_grpc.errors import InvalidArgument, LeaseLost, Unavailable
from scheduler_grpc.gcra import LimitDefinition, LimitKey, encode_definition, encode_group
from scheduler_grpc.keys import QueueKeys, shard_name
from scheduler_grpc.rules import PRIORITY_MAX, PRIORITY_MIN, QUEUE_NAME_RULE, is_queue_name
from scheduler_grpc.script_calls import ScriptCall
from scheduler_grpc.scripts import source as _script_source
from scheduler_grpc.scripts import text as _text

__all__ = [
    "DEFAULT_MAX_DELIVERIES",
    "DEFAULT_MAX_STALLS",
    "MAX_BATCH",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "BlockedBy",
    "DeadItem",
    "DeadPage",
    "ItemState",
    "KeyState",
    "Lease",
    "Leased",
    "LimitDefinition",
    "LimitKey",
    "NewItem",
    "Queue",
    "QueueStats",
    "Recovered",
]

_log = logging.getLogger(__name__)

SEQ_SPAN: Final = 2**42
"""Sequence numbers per priority in a ready score; the Lua scripts hard-code the same value."""
DEFAULT_MAX_STALLS: Final = 3
"""Default of `Queue(max_stalls=)`, the default of `SCHEDULER_MAX_STALLS`."""
DEFAULT_MAX_DELIVERIES: Final = DEFAULT_MAX_STALLS
"""The same number under its older name."""
MAX_BATCH: Final = 1000
"""Most items one dequeue, recover, promote or dead-letter batch moves, so no script stalls Redis."""
STALLED: Final = "stalled"
SOLO_RETRY_DELAY: Final = timedelta(seconds=30)
"""How long a run whose solo delivery stalled waits before its last one (`recover_expired`): longer
than a burst of outside kills (a rolling deploy, a chaos run), short beside a poison job's damage."""
"""Dead-letter reason of an item whose leases expired `max_deliveries` times, the last one alone."""

_MS: Final = timedelta(milliseconds=1)
# A field of limdef no limit can be named (a limit name has no control character): the leader's mark.
_SYNCED: Final = "\x00synced"
# Each BZPOPMIN of dequeue_blocking waits at most this long, then the loop tries a dequeue anyway:
# a marker lost to a crash between its pop and the following dequeue costs at most this much delay.
_MAX_BLOCK_S: Final = 2.0
# Extra time a blocking read may take beyond BZPOPMIN's own timeout before the server counts as hung.
_BLOCK_MARGIN_S: Final = 1.0
_DEFAULT_WAIT: Final = timedelta(seconds=5)
CALL_TIMEOUT: Final = timedelta(seconds=5)
"""A queue call's bound on Redis's answer, unless its `Queue` is given another."""


class ItemState(StrEnum):
    """Where an item is."""

    READY = "ready"
    PROCESSING = "processing"
    DELAYED = "delayed"
    DEAD = "dead"


# The integer codes queue_states.lua returns, in its order.
_STATE_CODES: Final = (None, ItemState.READY, ItemState.PROCESSING, ItemState.DELAYED, ItemState.DEAD)


@dataclass(frozen=True, slots=True)
class NewItem:
    """An item to enqueue.

    Attributes:
        id: Unique within the queue; enqueueing an id the queue knows (in any state) does nothing.
        priority: PRIORITY_MIN..PRIORITY_MAX; higher runs first.
        data: Opaque payload returned with every lease (a str is stored as UTF-8).
        delay: Wait this long (Redis clock) in the delayed set first; None or zero: ready now.
        limits: The run's limit keys (see the module docstring): when there are any, the item
            waits in its group's backlog instead of ready and is leased only when every key
            admits its units. Kept with the item in every state (a retry, a dead-letter requeue).
    """

    id: str
    priority: int = 0
    data: bytes | str = b""
    delay: timedelta | None = None
    limits: tuple[LimitKey, ...] = ()


@dataclass(frozen=True, slots=True)
class Lease:
    """One delivery of an item to a worker.

    Attributes:
        id: The item.
        token: Opaque, unique per delivery; ack, nack, extend and dead_letter need it.
        data: The payload given at enqueue.
        priority: The item's priority.
        deliveries: Deliveries counted so far, this one included (see `Queue.nack`).
        deadline: When the lease expires (Redis clock, UTC) unless extended or finished.
        due_in: None for a ready item; for a reserved delayed item (`dequeue(reserve=...)`), how
            long after the dequeue read the Redis clock the item is due.
        solo: This delivery must run alone on its worker: nothing else may be leased, claimed or
            run beside it until it ends (the item stalled `max_stalls - 1` times already).
        leased_at: The instant of the lease (Redis clock, UTC, whole milliseconds): the clock
            reading its dequeue admitted it on (its limits' units and rates were taken then) and
            counted `deadline` from; the same for every lease of one dequeue. None when unknown.
    """

    id: str
    token: str
    data: bytes
    priority: int
    deliveries: int
    deadline: datetime
    due_in: timedelta | None = None
    solo: bool = False
    leased_at: datetime | None = None


class Leased(list[Lease]):
    """What a dequeue leased (a list of `Lease`), and whether the caller should become idle.

    Attributes:
        solo_waiting: The caller skipped a solo item and is its drainer (one worker at a time): it
            should lease nothing more until it holds no run, then dequeue once with `idle=True`.
    """

    solo_waiting: bool

    def __init__(self, leases: Iterable[Lease] = (), *, solo_waiting: bool = False) -> None:
        super().__init__(leases)
        self.solo_waiting = solo_waiting


@dataclass(frozen=True, slots=True)
class Recovered:
    """What one `recover_expired` call did.

    Attributes:
        requeued: Ids whose lease expired, back in ready with their priority.
        dead: Ids whose lease expired once too often, now in the dead set with reason "stalled".
        tokens: The expired lease token of each requeued id (aligned with `requeued`): the claim
            token of the attempt that lease held, for the scheduler to end it.
    """

    requeued: list[str]
    dead: list[str]
    tokens: list[str] = dataclasses.field(default_factory=list)

    def expired_leases(self) -> list[tuple[str, str]]:
        """(run id, lease token) of each requeued item."""
        return list(zip(self.requeued, self.tokens, strict=True))


@dataclass(frozen=True, slots=True)
class DeadItem:
    """A dead-lettered item as `list_dead` shows it."""

    id: str
    reason: str
    parked_at: datetime
    priority: int
    deliveries: int
    data: bytes


@dataclass(frozen=True, slots=True)
class DeadPage:
    """One page of `list_dead`; `next_page_token` is None on the last page."""

    items: list[DeadItem]
    next_page_token: str | None


@dataclass(frozen=True, slots=True)
class KeyState:
    """One limit key's state in this queue (`Queue.key_state`), read atomically.

    Attributes:
        running: Concurrency units held by leased runs (0 for a rate limit).
        queued: Runs waiting in groups that contain this key (ready or parked; not delayed ones).
        next_admission: When the key admits one unit by its rate and pause (the read time when it
            would now); None when a concurrency limit is full (it waits for a unit to come back),
            the key is paused until resumed, or the limit has no definition in this queue.
        paused_until: The end of a pause (`pause_key`, back-pressure); None when not paused.
    """

    running: int
    queued: int
    next_admission: datetime | None
    paused_until: datetime | None


@dataclass(frozen=True, slots=True)
class BlockedBy:
    """Why a waiting run waits (`Queue.blocked_by`): its group is parked on `limit` and `key`.

    Attributes:
        limit: The limit's name.
        key: The key.
        since: When its group was parked on that key (Redis clock, UTC).
        kind: `concurrency` (no unit free), `rate` (until the GCRA retry time), `paused`, or
            `undefined` (the limit has no definition in this queue, or a limit of 0).
    """

    limit: str
    key: str
    since: datetime
    kind: str


_BLOCK_KINDS: Final = {"c": "concurrency", "r": "rate", "p": "paused", "u": "undefined"}
_FOREVER_MS: Final = 2**52
"""A pause with no end (queue_limits.lua's and queue_dequeue.lua's FOREVER)."""


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Item counts per state, read atomically (a sharded queue's: summed over its shards, each read
    atomically; `shards` is how many were read, `sharded.py`)."""

    ready: int
    processing: int
    delayed: int
    dead: int
    shards: int = 1


def _lua_source(name: str) -> str:
    """The source of `lua/queue_<name>.lua`, includes expanded (`scripts.source`)."""
    return _script_source(f"queue_{name}")


@functools.cache
def _key_names(names: str) -> tuple[str, ...]:
    return tuple(names.split())


@functools.cache
def _op_source(name: str, once: bool) -> str:
    return resend.guarded(_lua_source(name)) if once else _lua_source(name)


# One registered script per Redis client and operation, shared by every `Queue` on that client: a
# script object holds its source (several KB), and a server may make a `Queue` for every queue name
# a request mentions. Weak keys: a closed, dropped client takes its scripts with it.
_SCRIPTS: weakref.WeakKeyDictionary[Redis, dict[tuple[str, bool], AsyncScript]] = weakref.WeakKeyDictionary()


def _shared_script(client: Redis, name: str, once: bool) -> AsyncScript:
    scripts = _SCRIPTS.get(client)
    if scripts is None:
        scripts = _SCRIPTS[client] = {}
    script = scripts.get((name, once))
    if script is None:
        # register_script calls EVALSHA and loads the source only on NOSCRIPT (first use, or after
        # SCRIPT FLUSH / a restart), so the script text crosses the wire once per server.
        script = scripts[(name, once)] = client.register_script(_op_source(name, once))
    return script


class _Op:
    """One Lua script with the keys it is always called with.

    `once`: the script is not idempotent, so it runs under the resend guard (see `resend`): each
    call gets a request key, and a resend by the client's auto-retry returns the first reply.
    """

    __slots__ = ("key_names", "keys", "name", "once", "script")

    def __init__(
        self, client: Redis, name: str, key_names: Sequence[str], keys: Sequence[str], *, once: bool = False
    ) -> None:
        self.name = name
        self.key_names = list(key_names)
        self.once = once
        self.script: AsyncScript = _shared_script(client, name, once)
        self.keys = list(keys)


class Queue:
    """One named priority queue with leases, delays and a dead-letter set.

    Blocking waits (`wait_for_work`, `dequeue_blocking`) hold a connection for up to a couple of
    seconds each. They take it from `blocking_redis`'s connection pool when given, otherwise from
    `redis`'s pool (redis-py hands every command its own pooled connection, so other calls go on
    meanwhile). Size the pool for the number of concurrent waiters plus ordinary calls; a
    `single_connection_client` cannot serve blocking waits and is refused.

    Attributes:
        name: The queue's name.
        keys: Its Redis keys.
        blocking_client: The client its blocking waits use.

    Args:
        redis: Client for every non-blocking call. `decode_responses=False` is recommended (payloads
            are bytes); both settings work for str payloads.
        name: Queue name: 1-64 letters, digits, '_', '.' or '-'.
        blocking_redis: Optional separate client for blocking waits.
        call_timeout: Bound on each non-blocking call (e.g. SCHEDULER_CONNECT_TIMEOUT).
        max_stalls: SCHEDULER_MAX_STALLS: the default of `recover_expired(max_deliveries=)`, and
            what makes a counted `nack` put an item in the solo set.
        shard: Which shard of the queue this object works on (`sharding.py`): its keys are
            `keys.shard_name(name, shard)`'s; 0, the default, is the queue itself.

    Raises:
        InvalidArgument: a bad name, timeout, max_stalls or single-connection client for blocking
            waits.
    """

    def __init__(
        self,
        redis: Redis,
        name: str = "default",
        *,
        blocking_redis: Redis | None = None,
        call_timeout: timedelta = CALL_TIMEOUT,
        max_stalls: int = DEFAULT_MAX_STALLS,
        shard: int = 0,
    ) -> None:
        if not is_queue_name(name):
            raise InvalidArgument("name", QUEUE_NAME_RULE)
        _check_max_stalls(max_stalls, "max_stalls")
        self.max_stalls = max_stalls
        if call_timeout <= timedelta(0):
            raise InvalidArgument("call_timeout", "must be positive")
        blocking = blocking_redis or redis
        if getattr(blocking, "single_connection_client", False):
            raise InvalidArgument(
                "blocking_redis",
                "a single_connection_client would stall every call during a blocking wait; pass a pooled client",
            )
        self._redis = redis
        self._blocking = blocking
        self.blocking_client = blocking
        # A cluster client (no one pool: one per node) is made with no socket timeout (`connections`).
        pool = getattr(blocking, "connection_pool", None)
        socket_timeout = pool.connection_kwargs.get("socket_timeout") if pool is not None else None
        self._blocking_socket_timeout: float | None = float(socket_timeout) if socket_timeout else None
        self._call_timeout_s = call_timeout.total_seconds()
        self.name = name
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 0:
            raise InvalidArgument("shard", f"must be a non-negative integer, got {shard!r}")
        self.shard = shard
        self.keys = k = QueueKeys(shard_name(name, shard))

        key_of = functools.cache(lambda key: str(getattr(k, key)))  # one string per key, shared by the ops

        def op(script: str, key_names: str, *, once: bool = False) -> _Op:
            # Key names in the order of the script's KEYS (its header lists the same; a test checks).
            names = _key_names(key_names)
            return _Op(redis, script, names, [key_of(key) for key in names], once=once)

        # What lua/_groups.lua needs, in this order after each script's own keys.
        groups = "lims gwait gmem gactive gdelay gblock grr kpark kqueued held holds"
        self._enqueue = op("enqueue", f"ready delayed priority data seq marker limdef {groups}")
        # once=True: not safe to run twice (see `resend`); the others are.
        self._dequeue = op(
            "dequeue",
            "ready processing priority data deliveries lease owner lease_seq marker delayed seq solo drainer limdef "
            f"{groups} tat tatrem kpause reservers reserving",
            once=True,
        )
        self._ack = op("ack", f"processing priority data deliveries lease owner ready seq marker {groups}")
        self._nack = op(
            "nack", f"processing ready delayed priority deliveries lease owner seq marker solo {groups} kpause"
        )
        self._extend = op("extend", "processing lease")
        self._recover = op(
            "recover",
            f"processing ready dead priority deliveries lease owner dead_reason seq marker solo delayed {groups}",
            once=True,
        )
        self._promote = op("promote", f"delayed ready priority seq marker {groups}")
        self._dead_letter = op(
            "dead_letter", f"processing ready delayed dead lease owner dead_reason solo seq marker {groups}"
        )
        self._finish = op(
            "finish",
            f"processing ready delayed dead priority data deliveries lease owner dead_reason seq marker solo {groups}",
        )
        self._list_dead = op("list_dead", "dead priority data deliveries dead_reason")
        self._requeue_dead = op(
            "requeue_dead", f"dead ready priority deliveries dead_reason seq marker {groups}", once=True
        )
        self._purge_dead = op("purge_dead", "dead priority data deliveries lease owner dead_reason lims", once=True)
        self._restore_dead = op("restore_dead", "dead priority data dead_reason lims")
        self._remove = op("remove", f"ready delayed priority data deliveries solo seq marker {groups}")
        self._states = op("states", "ready processing delayed dead gmem")
        self._rearm = op("rearm", "ready marker gactive")
        self._limits = op("limits", f"ready seq marker limdef {groups} tat tatrem kpause recount")

    # -- plumbing -------------------------------------------------------------------------------

    async def _run(self, op: _Op, args: Sequence[Any]) -> Any:
        """Run one script under the call timeout (a guarded one with a fresh request key)."""
        if op.once:
            keys = [*op.keys, self.keys.request(resend.request_id())]
            return await self._bounded(op.script(keys=keys, args=[*args, resend.remember_ms()]))
        return await self._bounded(op.script(keys=op.keys, args=args))

    async def _bounded(self, call: Awaitable[Any]) -> Any:
        """Await one Redis call under the call timeout, turning connectivity failures into Unavailable."""
        try:
            async with asyncio.timeout(self._call_timeout_s):
                return await call
        except Exception as exc:
            if not stores.is_unreachable(exc):
                raise
            raise Unavailable(f"Redis did not answer for queue {self.name!r}: {exc or 'timed out'}") from exc

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
        """Add one item, ready now or after `delay`.

        Args:
            item_id: Unique id; an id the queue already knows in any state is not added again.
            priority: PRIORITY_MIN..PRIORITY_MAX; higher runs first, FIFO within a priority.
            data: Opaque payload handed back with each lease.
            delay: Keep it in the delayed set this long (Redis clock) before it can be promoted.
            limits: Its limit keys (see `NewItem.limits`).

        Returns:
            True if added, False if the id was already queued.

        Raises:
            InvalidArgument: a bad id, priority or delay.
            Unavailable: Redis did not answer in time.
        """
        item = NewItem(item_id, priority, data, delay, tuple(limits))
        args = item_args(item, lambda attr: "item_id" if attr == "id" else attr)
        return int(await self._run(self._enqueue, [0, *args])) == 1

    async def enqueue_many(self, items: Iterable[NewItem], definitions: Iterable[LimitDefinition] = ()) -> int:
        """Add many items in one atomic script call; ids already known are skipped.

        An enqueue that makes work ready sets the wake-up marker, so one idle worker wakes.

        Args:
            items: The items.
            definitions: Limit definitions written first, in the same call, each only where the
                queue has none of that name (a definition travels with the work that needs it;
                `put_limit_definitions` replaces one, and wakes the runs waiting for it).

        Returns:
            How many items were added.

        Raises:
            InvalidArgument: naming the first bad field, e.g. `items[3].priority`; nothing is added.
            Unavailable: Redis did not answer in time.
        """
        args = [item_args(item, f"items[{index}].{{}}".format) for index, item in enumerate(items)]
        if not args:
            await self.put_limit_definitions(definitions)
            return 0
        call = self.enqueue_call(args, definitions)
        assert call is not None
        return int(await self._bounded(call.send()))

    def enqueue_call(
        self, items: Sequence[Sequence[Any]], definitions: Iterable[LimitDefinition] = ()
    ) -> ScriptCall | None:
        """The script call of `enqueue_many`, for items already made into their arguments (`item_args`),
        for a caller that sends it along with other calls (`script_calls.run_together`); None when
        there is nothing to write. Definitions are written only where the queue has none of that
        name (`put_limit_definitions` replaces one).

        Raises:
            InvalidArgument: a bad definition (items are checked by `item_args`).
        """
        defs = _definition_args(definitions)
        if not items and not defs:
            return None
        args: list[Any] = [len(defs) // 2, *defs]
        for item in items:
            args += item
        return ScriptCall(self._enqueue.script, self._enqueue.keys, args)

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
        """Lease up to `count` of the best ready items to `worker_id`, without waiting.

        Delayed items whose due time has passed (Redis clock) are promoted to ready first, in the
        same script call. Items come out by priority (highest first), FIFO within a priority. Each
        gets a fresh token, a deadline `visibility_timeout` from now (Redis clock) and one more
        delivery counted. If this
        call is cancelled while the script runs, it waits for the reply and hands whatever it leased
        back (uncounted) before re-raising, so a cancelled consumer strands nothing.

        Args:
            worker_id: Recorded as the owner of each lease.
            visibility_timeout: Lease length; the item is recovered if not acked or extended by then.
            count: Most items to take (1..MAX_BATCH).
            reserve: The reserve window: when fewer than `count` items are ready, delayed items
                due within this long (Redis clock) are leased too, up to `reserve_count`, and leave
                the delayed set; each lease's `due_in` says when its item is due. Zero: none.
            reserve_count: Most delayed items to reserve (0..MAX_BATCH).
            idle: The caller holds no run at all (none leased, claimed, held or running). Only an
                idle caller gets a solo item (one that stalled `max_stalls - 1` times): then the
                reply is that one lease, `solo=True`, and the caller must run nothing beside it
                until it ends. Other callers skip solo items (never reserve them either).
            held: Reservations the caller holds that are not due yet. While several workers
                reserve from the queue, a caller reserves at most its fair share of the window
                less these (see lua/queue_dequeue.lua), until the earliest item is within a third
                of the window of its due time.

        Returns:
            The leases: the ready ones best first, then the reserved ones in due order; empty when
            nothing is ready nor due within the window. `solo_waiting` is True when the caller
            skipped a solo item and was chosen to drain it (see `Leased`).

        Raises:
            InvalidArgument: a bad worker id, timeout or count.
            Unavailable: Redis did not answer in time.
        """
        _check_id(worker_id, "worker_id")
        leases, _ = await self._take(worker_id, visibility_timeout, count, reserve, reserve_count, idle=idle, held=held)
        return leases

    async def _take(
        self,
        worker_id: str,
        visibility_timeout: timedelta,
        count: int,
        reserve: timedelta = timedelta(0),
        reserve_count: int = 0,
        *,
        idle: bool = False,
        held: int = 0,
    ) -> tuple[Leased, float | None]:
        """`dequeue`, and when nothing was ready nor reserved, the seconds until the earliest delayed
        item the caller may take is due, or comes within the reserve window when reserving (Redis
        clock; None when nothing is delayed). Due delayed items are promoted in the same call."""
        visibility_ms = _to_ms(visibility_timeout, "visibility_timeout", minimum=1)
        _check_count(count, "count")
        reserve_ms = _to_ms(reserve, "reserve")
        if isinstance(reserve_count, bool) or not isinstance(reserve_count, int) or not 0 <= reserve_count <= MAX_BATCH:
            raise InvalidArgument("reserve_count", f"must be an integer from 0 to {MAX_BATCH}, got {reserve_count!r}")
        if isinstance(held, bool) or not isinstance(held, int) or held < 0:
            raise InvalidArgument("held", f"must be a non-negative integer, got {held!r}")
        args = (worker_id, visibility_ms, count, MAX_BATCH, reserve_ms, reserve_count, 1 if idle else 0, held)
        call = asyncio.ensure_future(self._run(self._dequeue, args))
        try:
            # Shielded: a cancellation must not drop a reply whose items are already leased.
            reply = await asyncio.shield(call)
        except asyncio.CancelledError:
            await self._give_back(call)
            raise
        if not reply:
            return Leased(), None
        if len(reply) == 2:  # nothing leased: {wait_ms or -1, drain}
            wait_ms = int(reply[0])
            return Leased(solo_waiting=int(reply[1]) == 1), (wait_ms / 1000 if wait_ms >= 0 else None)
        return _leases(reply), None

    async def _give_back(self, call: asyncio.Future[Any]) -> None:
        """Finish a cancelled dequeue and return what it leased to ready, as if never delivered."""
        try:
            reply = await call
            leases = _leases(reply) if len(reply) > 2 else []
            if leases:
                # A reserved item goes back delayed until its due time: ready, anyone would start it early.
                await self.finish_many(retries=[(lease, lease.due_in or timedelta(0)) for lease in leases])
        except Exception:
            # Not lost either way: the leases expire and recover_expired requeues the items.
            _log.warning("queue %s: could not hand back a cancelled dequeue", self.name, exc_info=True)

    async def wait_for_work(self, wait: timedelta) -> bool:
        """Block (one BZPOPMIN on the marker) until work may be ready or `wait` passes.

        The marker is a hint, not a claim: after True, `dequeue` may still find nothing because
        another worker was faster. The wait never busy-polls, and a cancelled wait re-sets the
        marker if work is ready, in case it consumed the marker just before being cancelled.

        Args:
            wait: Longest wait; shortened to half the blocking client's socket timeout if set.

        Returns:
            True if woken by the marker, False on timeout.

        Raises:
            Unavailable: Redis did not answer within the wait plus a margin.
        """
        return await self.wait_for_any([self], wait)

    async def wait_for_any(self, queues: Sequence[Queue], wait: timedelta) -> bool:
        """`wait_for_work` on the markers of several queues at once (one BZPOPMIN on this queue's
        blocking client): a sharded queue's shards on one server (`sharded.py`). Each must be served
        by the same server as this one; a cancelled wait re-sets each marker whose work is ready.
        """
        block = _to_ms(wait, "wait") / 1000
        if self._blocking_socket_timeout is not None:
            block = min(block, self._blocking_socket_timeout / 2)
        if block < 0.001:
            return False  # BZPOPMIN reads 0 as "block for ever".
        try:
            # BZPOPMIN's own timeout ends the wait; this outer one only catches a hung server.
            async with asyncio.timeout(block + _BLOCK_MARGIN_S):
                popped = await self._blocking.bzpopmin([q.keys.marker for q in queues], timeout=round(block, 3))
        except asyncio.CancelledError:
            for queue in queues:
                with contextlib.suppress(Exception):
                    # The cancelled BZPOPMIN's connection is closed, but the close travels on its
                    # own socket: a rearm sent at once on another pooled connection (a cluster
                    # client's pool hands out its oldest one) can reach the server first, and the
                    # wait, still registered, pops the marker it set. A second rearm, sent after the
                    # first's reply, reaches a server that has seen the close. Only when work is
                    # ready (a set marker).
                    if await queue._run(queue._rearm, ()):
                        await queue._run(queue._rearm, ())
            raise
        except Exception as exc:
            if not stores.is_unreachable(exc):
                raise
            raise Unavailable(f"Redis did not answer a blocking wait on queue {self.name!r}") from exc
        return popped is not None

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
        """Like `dequeue`, but wait up to `wait` for work instead of returning empty at once.

        Tries a dequeue; when nothing is ready, blocks on the marker (no polling) and tries again,
        until it gets items or `wait` has passed. Work enqueued at any point, even between the empty
        dequeue and the block, wakes it: the marker stays set until a waiter takes it. Delayed work
        needs no leader: the dequeue promotes due items itself and, when nothing is ready, says when
        the earliest delayed item is due, and the block ends then (an enqueue of an earlier delayed
        item sets the marker, so the waiter learns the new time at once). With a reserve window
        (see `dequeue`) the wait ends when the earliest delayed item comes within the window.
        `idle` is `dequeue`'s; a reply that says `solo_waiting` ends the wait at once. `held` says
        `dequeue`'s `held` at each try.

        Returns:
            The leases, best first; empty if nothing became ready within `wait` (or when the caller
            was told `solo_waiting`).

        Raises:
            InvalidArgument: a bad argument.
            Unavailable: Redis did not answer in time.
        """
        _check_id(worker_id, "worker_id")
        _to_ms(wait, "wait")
        loop = asyncio.get_running_loop()
        end = loop.time() + wait.total_seconds()
        while True:
            leases, next_due = await self._take(
                worker_id, visibility_timeout, count, reserve, reserve_count, idle=idle,
                held=held() if held is not None else 0,  # read again each time: it changes while this waits
            )  # fmt: skip
            if leases or leases.solo_waiting:
                return leases
            remaining = end - loop.time()
            if remaining <= 0:
                return leases
            block = min(remaining, _MAX_BLOCK_S)
            if next_due is not None and next_due < block:
                # Counted from the reply, which came after the script read the Redis clock: the
                # next dequeue runs no earlier than the item's due time, so it finds it promoted.
                await self._sleep_until_due(next_due)
                continue
            await self.wait_for_work(timedelta(seconds=block))

    async def _sleep_until_due(self, seconds: float) -> None:
        """Block on the marker (new ready work ends the wait) for `seconds`, then return.

        Redis ends a blocking command's own timeout only at its next `hz` tick (every 100 ms by
        default), far too coarse for a due time, so the timer is ours: when it fires, the blocked
        call is cancelled (redis-py drops that connection and the pool opens another; a marker
        popped meanwhile is set again by `wait_for_work`). One such wake per due time is the cost.
        """
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.wait_for_work(timedelta(seconds=seconds + _MAX_BLOCK_S))

    # -- finishing work -------------------------------------------------------------------------

    async def ack(self, item_id: str, token: str) -> bool:
        """Finish an item: remove it and every trace of it from the queue.

        Returns:
            True if done; False if the lease was lost (recovered, or handed to another worker):
            then nothing changed.
        """
        return (await self.ack_many([(item_id, token)]))[0]

    async def ack_many(self, leases: Iterable[Lease | tuple[str, str]]) -> list[bool]:
        """`ack` many leases (leases or (id, token) pairs) in one atomic script call.

        Returns:
            One flag per lease, in order: True if acked, False if its lease was lost.
        """
        args = _lease_args(leases)
        if not args:
            return []
        return [bool(flag) for flag in await self._run(self._ack, args)]

    async def nack(
        self,
        item_id: str,
        token: str,
        delay: timedelta = timedelta(0),
        *,
        count_delivery: bool = True,
        retry_after: timedelta | None = None,
    ) -> bool:
        """Return a leased item to the queue with its priority.

        With no delay it rejoins ready at the back of its priority (a fresh FIFO position), and the
        marker wakes a worker; with a delay it goes to the delayed set, due `delay` from now (the
        marker wakes a worker when it becomes the earliest delayed item).

        Args:
            item_id: The item.
            token: Its current lease token.
            delay: Keep it delayed this long before it can run again.
            count_delivery: True (default) keeps this delivery in the item's count, which
                `recover_expired` compares with max_deliveries (and when the next delivery would be
                the `max_stalls`-th, it will be solo). Pass False for work returned unstarted (its
                breaker is open, the worker is shutting down): the delivery is given back, so such
                returns never bring an item closer to being dead-lettered as stalled.
            retry_after: Back-pressure from the upstream ("rate limited, retry after T"): every
                limit key of the item is paused that long (Redis clock; an existing later pause
                is kept), the delivery is given back (it costs no attempt and no stall), and the
                item rejoins its group at once, where it waits for the pause to end. An item
                without limit keys goes to the delayed set for that long instead. `delay` is
                ignored then.

        Returns:
            True if returned; False if the lease was lost (nothing changed).
        """
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
        """`nack` many leases in one atomic script call; one flag per lease, False = lease lost."""
        delay_ms = _to_ms(delay, "delay")
        pause_ms = 0 if retry_after is None else _to_ms(retry_after, "retry_after", minimum=1)
        args = _lease_args(leases)
        if not args:
            return []
        reply = await self._run(self._nack, [delay_ms, 1 if count_delivery else 0, self.max_stalls, pause_ms, *args])
        return [bool(flag) for flag in reply]

    async def finish_many(
        self,
        acks: Iterable[Lease] = (),
        retries: Iterable[tuple[Lease, timedelta]] = (),
        dead: Iterable[tuple[Lease, str]] = (),
    ) -> list[bool]:
        """A worker's completion batch in one script call: ack `acks`, return `retries` each after
        its delay (the delivery given back, like `nack(count_delivery=False)`), and park `dead` in
        the dead set each with its reason (like `dead_letter` under the lease token).

        Returns:
            One flag per lease, acks first, then retries, then dead: False if its lease was lost
            (nothing changed for that item).
        """
        args: list[Any] = []
        for lease in acks:
            args += ("a", lease.id, lease.token, "")
        for lease, delay in retries:
            args += ("r", lease.id, lease.token, _to_ms(delay, "delay"))
        for lease, reason in dead:
            if not isinstance(reason, str):
                raise InvalidArgument("reason", "must be a string")
            args += ("d", lease.id, lease.token, reason)
        if not args:
            return []
        return [bool(flag) for flag in await self._run(self._finish, args)]

    async def extend(self, item_id: str, token: str, more_time: timedelta) -> datetime:
        """Keep a lease: its deadline becomes `more_time` from now (Redis clock).

        A lease whose deadline passed but which was not recovered yet can still be extended: nobody
        else holds the item until `recover_expired` moves it.

        Returns:
            The new deadline (UTC).

        Raises:
            LeaseLost: the token is not the item's current one; nothing changed and the caller must
                stop working on the item (another worker may have it).
            InvalidArgument: `more_time` is under a millisecond.
            Unavailable: Redis did not answer in time.
        """
        [deadline] = await self.extend_many([(item_id, token)], more_time)
        if deadline is None:
            raise LeaseLost(f"queue {self.name!r}: the lease on item {item_id!r} was lost")
        return deadline

    async def extend_many(
        self, leases: Iterable[Lease | tuple[str, str]], more_time: timedelta
    ) -> list[datetime | None]:
        """`extend` many leases in one script call.

        Returns:
            One entry per lease, in order: its new deadline (UTC), or None if the lease was lost
            (that lease is unchanged; the caller must stop working on its item).
        """
        more_ms = _to_ms(more_time, "more_time", minimum=1)
        args = _lease_args(leases)
        if not args:
            return []
        reply = await self._run(self._extend, [more_ms, *args])
        return [None if int(deadline) < 0 else _from_ms(int(deadline)) for deadline in reply]

    # -- maintenance (the leader's loops) -------------------------------------------------------

    async def recover_expired(
        self,
        limit: int = MAX_BATCH,
        *,
        max_deliveries: int | None = None,
        solo_retry_delay: timedelta = SOLO_RETRY_DELAY,
    ) -> Recovered:
        """Requeue up to `limit` items whose lease deadline passed (Redis clock), atomically.

        Each loses its lease (a later ack/nack/extend under the old token fails) and goes back to
        ready with its priority, unless its deliveries have passed `max_deliveries` and this was a
        solo delivery (it ran alone on its worker, see `dequeue(idle=)`): then it is dead-lettered
        with reason "stalled", so a job that kills every worker taking it is parked after a bounded
        number of stalls, and the runs that merely shared a worker with it are not. An item
        requeued with `max_deliveries - 1` deliveries (or more: a delivery that was not solo) waits
        in the solo set, so its next delivery is solo. The first solo delivery that stalls goes to
        the delayed set for `solo_retry_delay` (still solo): one kill from outside of a worker that
        ran it alone parks nothing, two solo deaths that far apart do. With `max_deliveries` 1 no
        earlier delivery could be solo: every stall parks its item.

        Args:
            limit: Most items to move in this call (1..MAX_BATCH); call again while it returns a full
                batch.
            max_deliveries: SCHEDULER_MAX_STALLS; None: this queue's `max_stalls`.
            solo_retry_delay: How long an item whose solo delivery stalled waits before the next one.

        Returns:
            The ids requeued and the ids dead-lettered, for the scheduler to record.
        """
        _check_count(limit, "limit")
        if max_deliveries is None:
            max_deliveries = self.max_stalls
        _check_max_stalls(max_deliveries, "max_deliveries")
        delay_ms = round(solo_retry_delay.total_seconds() * 1000)
        requeued, dead, tokens = await self._run(self._recover, (limit, max_deliveries, STALLED, delay_ms))
        return Recovered(requeued=_texts(requeued), dead=_texts(dead), tokens=_texts(tokens))

    async def promote_due(self, limit: int = MAX_BATCH) -> list[str]:
        """Move up to `limit` delayed items whose due time passed (Redis clock) to ready, atomically.

        Each keeps its priority and joins the back of it; the marker wakes a worker.

        Returns:
            The ids promoted, in due order; a full batch means more may be due.
        """
        _check_count(limit, "limit")
        return _texts(await self._run(self._promote, (limit,)))

    # -- dead letters ---------------------------------------------------------------------------

    async def dead_letter(self, item_id: str, token: str | None, reason: str) -> bool:
        """Park an item in the dead set with a reason.

        Args:
            item_id: The item.
            token: Its lease token when a worker holds it (its limit units come back); None for
                an item waiting in ready, delayed or its group (a processing item is only parked
                under its token). A parked item keeps its limit keys for a requeue.
            reason: Why, shown by `list_dead`.

        Returns:
            True if parked; False if the lease was lost or (token None) the item was not waiting.
        """
        _check_id(item_id, "item_id")
        if not isinstance(reason, str):
            raise InvalidArgument("reason", "must be a string")
        return bool(await self._run(self._dead_letter, (item_id, token or "", reason)))

    async def list_dead(self, page_size: int = 100, page_token: str | None = None) -> DeadPage:
        """One page of dead items, ordered by time parked, then id.

        The order is stable: items parked or removed between pages do not make a page repeat or skip
        the items still parked after the previous page's last one.

        Args:
            page_size: Items per page (1..MAX_BATCH).
            page_token: None for the first page, else the previous page's `next_page_token`.

        Raises:
            InvalidArgument: a bad page size or a page token not from `list_dead`.
        """
        _check_count(page_size, "page_size")
        after_ms, after_id = ("", "") if not page_token else _decode_page_token(self.name, page_token)
        reply = await self._run(self._list_dead, (page_size, after_ms, after_id))
        items = [
            DeadItem(
                id=_text(reply[i]),
                reason=_text(reply[i + 2]),
                parked_at=_from_ms(int(reply[i + 1])),
                priority=int(reply[i + 3]),
                deliveries=int(reply[i + 4]),
                data=_bytes(reply[i + 5]),
            )
            for i in range(1, len(reply), 6)
        ]
        more = int(reply[0]) == 1
        next_token = None
        if more and items:
            last = len(reply) - 6
            next_token = _encode_page_token(self.name, _text(reply[last + 1]), items[-1].id)
        return DeadPage(items=items, next_page_token=next_token)

    async def requeue_dead(self, ids: Iterable[str] | None, *, batch: int = MAX_BATCH) -> list[str]:
        """Move dead items back to ready with their priority and their delivery count reset.

        Args:
            ids: The items; None means every dead item. Ids not in the dead set are skipped.
            batch: Items per atomic script call; "every item" runs as several calls.

        Returns:
            The ids requeued.
        """
        return await self._batched(self._requeue_dead, ids, batch, ())

    async def purge_dead(
        self, ids: Iterable[str] | None, *, older_than: timedelta | None = None, batch: int = MAX_BATCH
    ) -> list[str]:
        """Forget dead items entirely: the dead set and every per-item hash.

        Args:
            ids: The items; None means every dead item. Ids not in the dead set are skipped.
            older_than: Only items parked at least this long ago (Redis clock).
            batch: Items per atomic script call.

        Returns:
            The ids purged.
        """
        older_ms = -1 if older_than is None else _to_ms(older_than, "older_than")
        return await self._batched(self._purge_dead, ids, batch, (older_ms,))

    async def restore_dead(self, items: Iterable[tuple[NewItem, str]]) -> int:
        """Park items `(item, reason)` in the dead set directly, unless the queue knows them already.

        The rebuild of a dead-letter queue that Redis lost: PostgreSQL knows which runs are dead
        and why (see the scheduler's reconcile). `item.delay` is ignored; `item.limits` are kept,
        so a requeue puts the item back in its group.

        Returns:
            How many were parked (ids the queue knew, in any state, are skipped).
        """
        args: list[Any] = []
        for index, (item, reason) in enumerate(items):
            item_id, priority, _, data, group = item_args(item, functools.partial("items[{}].{}".format, index))
            args += [item_id, priority, data, str(reason), group]
        parked = 0
        for start in range(0, len(args), 5 * MAX_BATCH):
            parked += int(await self._run(self._restore_dead, args[start : start + 5 * MAX_BATCH]))
        return parked

    async def _batched(self, op: _Op, ids: Iterable[str] | None, batch: int, extra: tuple[Any, ...]) -> list[str]:
        _check_count(batch, "batch")
        done: list[str] = []
        if ids is not None:
            wanted = _id_list(ids)
            for start in range(0, len(wanted), batch):
                chunk = wanted[start : start + batch]
                done += _texts(await self._run(op, (len(chunk), *extra, *chunk)))
            return done
        # "All": take the head of the dead set batch by batch. Bounded by the count seen now, so
        # items parked meanwhile cannot keep the loop going for ever.
        rounds = -(-int(await self._bounded(self._redis.zcard(self.keys.dead))) // batch) + 1
        for _ in range(rounds):
            moved = _texts(await self._run(op, (batch, *extra)))
            done += moved
            if len(moved) < batch:
                break
        return done

    # -- inspection and cancellation ------------------------------------------------------------

    async def remove(self, item_id: str) -> bool:
        """Forget an item waiting in ready, delayed or its group (e.g. its execution was cancelled).

        Returns:
            True if removed; False if it was not waiting (unknown, processing or dead).
        """
        return (await self.remove_many([item_id]))[0]

    async def remove_many(self, ids: Iterable[str]) -> list[bool]:
        """`remove` many ids in one atomic script call; one flag per id."""
        wanted = _id_list(ids)
        if not wanted:
            return []
        return [bool(flag) for flag in await self._run(self._remove, wanted)]

    async def states(self, ids: Iterable[str]) -> dict[str, ItemState | None]:
        """Where each id is, read atomically in one round trip; None = unknown to the queue."""
        wanted = list(dict.fromkeys(_id_list(ids)))
        if not wanted:
            return {}
        codes = await self._run(self._states, wanted)
        return {item_id: _STATE_CODES[int(code)] for item_id, code in zip(wanted, codes, strict=True)}

    async def stats(self) -> QueueStats:
        """Item counts per state, from one MULTI/EXEC round trip (a consistent snapshot); `ready`
        counts the runs waiting in groups (limits) too."""
        k = self.keys
        async with self._redis.pipeline(transaction=True) as pipe:
            for key in (k.ready, k.processing, k.delayed, k.dead, k.gwait):
                pipe.zcard(key)
            ready, processing, delayed, dead, grouped = await self._bounded(pipe.execute())
        return QueueStats(
            ready=int(ready) + int(grouped), processing=int(processing), delayed=int(delayed), dead=int(dead)
        )

    # -- limits (keyed flow control) -------------------------------------------------------------

    async def put_limit_definitions(self, definitions: Iterable[LimitDefinition]) -> int:
        """Store (create or replace) limit definitions for this queue's scripts, atomically.

        Groups parked on a key of a given limit (up to 1,000 per limit and call) are woken, so a
        raised limit, or a definition that was missing, admits waiting runs at once.

        Returns:
            How many parked groups woke.

        Raises:
            InvalidArgument: a bad definition (the field is named, e.g. `definitions[1].period`).
        """
        args = _definition_args(definitions)
        if not args:
            return 0
        return int(await self._run(self._limits, ["define", *args]))

    async def delete_limit_definitions(self, names: Iterable[str]) -> int:
        """Forget limit definitions; runs that still carry such a limit then wait, parked on their
        key (`blocked_by` says `undefined`) until a definition comes back.

        Returns:
            How many definitions were removed.
        """
        wanted = _id_list(names)
        if not wanted:
            return 0
        return int(await self._run(self._limits, ["undefine", *wanted]))

    async def pause_key(self, limit: str, key: str, duration: timedelta | None = None) -> datetime | None:
        """Pause one limit key: it admits nothing for `duration` (Redis clock), or until
        `resume_key` when None. A pause set here replaces the key's current one.

        Returns:
            When the pause ends (UTC), or None for a pause until resumed.
        """
        _check_limit_name(limit, key)
        ms = -1 if duration is None else _to_ms(duration, "duration", minimum=1)
        until_ms = int(await self._run(self._limits, ["pause", limit, key, ms]))
        return None if until_ms >= _FOREVER_MS else _from_ms(until_ms)

    async def resume_key(self, limit: str, key: str) -> int:
        """End a key's pause now; the groups parked on it (up to 1,000 per call) wake.

        Returns:
            How many parked groups woke.
        """
        _check_limit_name(limit, key)
        return int(await self._run(self._limits, ["resume", limit, key]))

    async def key_state(self, limit: str, key: str) -> KeyState:
        """One limit key's state in this queue, read in one atomic script call (see `KeyState`)."""
        _check_limit_name(limit, key)
        running, queued, next_ms, paused_ms, _ = (
            int(value) for value in await self._run(self._limits, ["state", limit, key])
        )
        return KeyState(
            running=running,
            queued=queued,
            next_admission=None if next_ms < 0 or next_ms >= _FOREVER_MS else _from_ms(next_ms),
            paused_until=None if paused_ms < 0 or paused_ms >= _FOREVER_MS else _from_ms(paused_ms),
        )

    async def blocked_by(self, ids: Iterable[str]) -> dict[str, BlockedBy]:
        """Why each waiting run waits, read atomically: runs whose group is parked on a key map to
        that limit, key, since when and why; other ids (running, ready to go, unknown, without
        limits) are left out."""
        wanted = list(dict.fromkeys(_id_list(ids)))
        if not wanted:
            return {}
        reply = await self._run(self._limits, ["blocked", *wanted])
        return {
            _text(reply[i]): BlockedBy(
                limit=_text(reply[i + 1]),
                key=_text(reply[i + 2]),
                since=_from_ms(int(reply[i + 3])),
                kind=_BLOCK_KINDS.get(_text(reply[i + 4]), _text(reply[i + 4])),
            )
            for i in range(0, len(reply), 5)
        }

    async def hold_running(self, runs: Iterable[tuple[str, Sequence[LimitKey]]]) -> int:
        """Count again the concurrency units of runs still running that Redis lost (a FLUSHALL, a
        failover to an empty replica): each `(run id, limit keys)` the queue knows in no state holds
        its units as its lease did, so caps hold while it runs; `unhold` gives them back once it has
        stopped. Idempotent per run id: a run that holds units, or that the queue knows with its
        limit keys, is left alone. Runs without concurrency keys hold nothing and are not counted.

        Returns:
            How many runs now hold units they did not hold before.

        Raises:
            InvalidArgument: bad limit keys (`runs[i].limits`).
        """
        args: list[str] = []
        for index, (run_id, limits) in enumerate(runs):
            _check_id(run_id, f"runs[{index}].id")
            if limits:
                args += [run_id, encode_group(tuple(limits), f"runs[{index}].limits")]
        if not args:
            return 0
        return int(await self._run(self._limits, ["hold", *args]))

    async def unhold(self, ids: Iterable[str]) -> int:
        """Give back the units `hold_running` counted for these runs (once each); the groups parked
        on their keys wake. Returns how many runs gave units back."""
        wanted = _id_list(ids)
        if not wanted:
            return 0
        return int(await self._run(self._limits, ["unhold", *wanted]))

    async def pause_keys_equal(self, ids: Iterable[str], key: str, duration: timedelta) -> int:
        """Pause for `duration` every limit key of these items whose key text is `key` (ignoring
        case): an open circuit breaker on a webhook host pauses the limits keyed on that host. A
        later pause already set is kept. Returns how many keys were paused or extended."""
        _check_limit_name("-", key)
        wanted = _id_list(ids)
        if not wanted:
            return 0
        ms = _to_ms(duration, "duration", minimum=1)
        return int(await self._run(self._limits, ["pause_equal", ms, key, *wanted]))

    async def recounted(self) -> list[str]:
        """The runs `hold_running` counted that `unhold` has not given back yet (at most 10,000)."""
        return _texts(await self._run(self._limits, ["recounted"]))

    async def mark_limits_synced(self) -> None:
        """Leave a mark in the queue's definitions that the leader has put them and counted the
        units of running runs again; a Redis that lost its data has lost the mark too."""
        await self._bounded(self._redis.hset(self.keys.limdef, _SYNCED, "1"))

    async def limits_synced(self) -> bool:
        """Whether the mark `mark_limits_synced` leaves is still there."""
        return bool(await self._bounded(self._redis.hexists(self.keys.limdef, _SYNCED)))

    async def waiting_by_limit(self, most: int = 50_000) -> dict[str, int]:
        """Runs waiting in groups, summed by limit name, from up to `most` keys (a sample, bounded:
        the per-key counts are read with HSCAN, never all at once)."""
        totals: dict[str, int] = {}
        seen = 0
        cursor: int = 0
        while True:
            cursor, fields = await self._bounded(self._redis.hscan(self.keys.kqueued, cursor, count=1000))
            for field, count in fields.items():
                name = _text(field).split("\0", 1)[0]
                totals[name] = totals.get(name, 0) + int(count)
            seen += len(fields)
            if cursor == 0 or seen >= most:
                return totals

    async def ready_by_band(self) -> dict[str, int]:
        """Ready items by priority band: `high` (> 0), `normal` (0), `low` (< 0); one round trip.

        The ready score orders by priority first, so each band is one score range. Runs waiting in
        groups (limits) are not counted here.
        """
        normal_start = (PRIORITY_MAX - 0) * SEQ_SPAN
        normal_end = (PRIORITY_MAX - 0 + 1) * SEQ_SPAN
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcount(self.keys.ready, "-inf", f"({normal_start}")
            pipe.zcount(self.keys.ready, normal_start, f"({normal_end}")
            pipe.zcount(self.keys.ready, normal_end, "+inf")
            high, normal, low = await self._bounded(pipe.execute())
        return {"high": int(high), "normal": int(normal), "low": int(low)}


# -- conversions ------------------------------------------------------------------------------------


def item_args(item: NewItem, name: Callable[[str], str]) -> tuple[Any, ...]:
    """An item's five script arguments (id, priority, delay ms, data, group), validated; `name`
    gives the field an error names."""
    _check_id(item.id, name("id"))
    _check_priority(item.priority, name("priority"))
    if not isinstance(item.data, bytes | str):
        raise InvalidArgument(name("data"), "must be bytes or str")
    delay = 0 if item.delay is None else _to_ms(item.delay, name("delay"))
    group = encode_group(item.limits, name("limits")) if item.limits else ""
    return (item.id, item.priority, delay, item.data, group)


def _definition_args(definitions: Iterable[LimitDefinition]) -> list[str]:
    args: list[str] = []
    for index, definition in enumerate(definitions):
        args += encode_definition(definition, f"definitions[{index}]")
    return args


def _check_limit_name(limit: object, key: object) -> None:
    if not isinstance(limit, str) or not limit:
        raise InvalidArgument("limit", "must be a non-empty string")
    if not isinstance(key, str) or "\x00" in key:
        raise InvalidArgument("key", "must be a string without NUL characters")


def _id_list(ids: Iterable[str]) -> list[str]:
    # A lone string is iterable too, and would silently become one id per character.
    if isinstance(ids, str | bytes):
        raise InvalidArgument("ids", "expected a collection of ids, not a single string")
    return list(ids)


def _check_id(value: object, field: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(field, "must be a non-empty string")


def _check_priority(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise InvalidArgument(field, f"must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX}, got {value!r}")


def _check_max_stalls(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(field, "must be an integer of at least 1")


def _check_count(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH:
        raise InvalidArgument(field, f"must be an integer from 1 to {MAX_BATCH}, got {value!r}")


def _to_ms(value: object, field: str, *, minimum: int = 0) -> int:
    """A non-negative timedelta as whole milliseconds, rounded up (never earlier than asked)."""
    if not isinstance(value, timedelta):
        raise InvalidArgument(field, "must be a datetime.timedelta")
    ms = -(-value // _MS)
    if ms < minimum:
        raise InvalidArgument(field, f"must be at least {minimum} ms" if minimum else "must not be negative")
    return ms


_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


def _from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def _texts(values: Iterable[bytes | str]) -> list[str]:
    return [_text(value) for value in values]


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _lease_args(leases: Iterable[Lease | tuple[str, str]]) -> list[str]:
    args: list[str] = []
    for lease in leases:
        item_id, token = (lease.id, lease.token) if isinstance(lease, Lease) else lease
        args += (item_id, token)
    return args


def _leases(reply: Sequence[Any]) -> Leased:
    """A dequeue's reply `{deadline_ms, flags, leased_ms, id, token, data, priority, deliveries,
    due_in_ms, ...}` as leases (flags: 1 = the caller is a solo item's drainer, 2 = the one lease is
    solo; leased_ms: the instant of every lease, Redis clock)."""
    deadline = _from_ms(int(reply[0]))
    flags = int(reply[1])
    # Whole milliseconds, exactly (no float on the way): the start PostgreSQL records is this value.
    leased_at = _EPOCH + timedelta(milliseconds=int(reply[2]))
    return Leased(
        (
            Lease(
                id=_text(reply[i]),
                token=_text(reply[i + 1]),
                data=_bytes(reply[i + 2]),
                priority=int(reply[i + 3]),
                deliveries=int(reply[i + 4]),
                deadline=deadline,
                due_in=None if int(reply[i + 5]) < 0 else timedelta(milliseconds=int(reply[i + 5])),
                solo=bool(flags & 2),
                leased_at=leased_at,
            )
            for i in range(3, len(reply), 6)
        ),
        solo_waiting=bool(flags & 1),
    )


def _encode_page_token(queue: str, parked_ms: str, item_id: str) -> str:
    return pagetokens.encode("dead_letters", {"queue": queue}, [parked_ms, item_id])


def _decode_page_token(queue: str, token: str) -> tuple[str, str]:
    position = pagetokens.decode(token, "dead_letters", {"queue": queue})
    if len(position) != 2 or not all(isinstance(part, str) for part in position):
        raise InvalidArgument("page_token", "not a token this server issued")
    parked_ms, item_id = position
    if not (parked_ms.isascii() and parked_ms.isdigit()) or not item_id:
        raise InvalidArgument("page_token", "not a token this server issued")
    return parked_ms, item_id


# -- limit key counts (the console's busiest keys) --------------------------------------------------

KEY_COUNTS_SCAN: Final = 1000
"""Fields asked for per HSCAN call of `key_counts`."""


@dataclass(frozen=True, slots=True)
class KeyCounts:
    """Per-key counts of a queue's limits (`key_counts`).

    Attributes:
        counts: (limit, key) -> (concurrency units held, runs queued), for keys with either.
        complete: Whether every key was read (False: the scan stopped at its bound).
    """

    counts: dict[tuple[str, str], tuple[int, int]]
    complete: bool


async def key_counts(queue: Queue, limits: Iterable[str], *, max_fields: int = 5000) -> KeyCounts:
    """The held units and queued runs of the keys of `limits` in `queue`, from the engine's per-key
    counters (`held`, `kqueued`), read by HSCAN: at most about `max_fields` fields of each hash, so
    the cost is bounded however many keys exist (not atomic: a view for people, not for decisions).
    """
    wanted = set(limits)
    counts: dict[tuple[str, str], list[int]] = {}
    complete = True
    for position, name in enumerate((queue.keys.held, queue.keys.kqueued)):
        cursor, read = 0, 0
        while True:
            cursor, fields = await queue._bounded(queue._redis.hscan(name, cursor, count=KEY_COUNTS_SCAN))
            read += len(fields)
            for field, value in fields.items():
                limit, _, key = _text(field).partition("\x00")
                if limit in wanted and int(value) > 0:
                    counts.setdefault((limit, key), [0, 0])[position] = int(value)
            if int(cursor) == 0:
                break
            if read >= max_fields:
                complete = False
                break
    return KeyCounts({lk: (held, queued) for lk, (held, queued) in counts.items()}, complete)
