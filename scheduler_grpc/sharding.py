"""Sharded queues (issue 24): how many shards each queue has over time, and which shard a run is on.

A queue may be split into shards, each its own set of Redis keys under its own hash tag (shard 0
is the queue's `{q:<name>}`, shard i > 0 is `{q:<name>#i}`: `keys.shard_name`), so one queue's
load spreads over a cluster's masters. The count is configuration every role must agree on over
time, so it is kept as a *history*: changes `(effective_at, shards)` per queue (PostgreSQL,
`db/queue_shards.py`), each taking effect a lead time after it is made (`SHARD_LEAD`), so every
role has read it before it applies.

Placement is a pure function of the run and that history, never of when it is enqueued:

- a run that takes limit keys is on shard 0, where its queue's limit state lives (so caps, rates
  and the fairness between keys are exactly those of an unsharded queue);
- any other run is on `hash(run id) mod count`, the count being the one in effect at the run's
  creation, read from its id (a UUIDv7's millisecond prefix). An id that is not a UUIDv7 (queue
  tests, embedders) takes the newest count known.

So every enqueue of a run (the first, the reconcile's, a dead-letter rebuild's) by any role lands
on the same shard, whenever it happens, and a run is never in two shards. Consumers (workers, the
leader's recover, promote and reconcile, the dead-letter reads, the counts) serve every shard up
to the highest count the history ever held (`ShardPlan.served`): a count lowered live leaves its
runs where they are, served until done; nothing is moved, so nothing is lost or duplicated.

Pure but for `ShardMap`, which holds the current `ShardPlan` and refreshes it from a source.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Final

from scheduler_grpc.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

SHARDS_MAX: Final = 64
"""Most shards a queue may have (the schema's CHECK repeats it)."""
SHARD_LEAD: Final = timedelta(seconds=10)
"""Default lead time of a change: it applies to runs made from `now + lead` (database clock) on."""
_MARGIN_MS: Final = 1000
"""Clock slack (ms) taken off a plan's validity: a run's id is made on a server's clock."""


@dataclass(frozen=True, slots=True)
class ShardChange:
    """From `effective_ms` (ms since the epoch, database clock) on, new runs of the queue spread
    over `shards` shards."""

    effective_ms: int
    shards: int


@dataclass(frozen=True, slots=True)
class ShardHistory:
    """A queue's shard counts over time, read at `now_ms` (database clock).

    Attributes:
        queue: The queue.
        changes: Its changes, oldest first (one ahead of `now_ms` included); none: one shard.
        now_ms: The database clock when it was read (ms since the epoch).
    """

    queue: str
    changes: tuple[ShardChange, ...]
    now_ms: int

    @property
    def shards(self) -> int:
        """The count in effect at `now_ms`: what new runs are spread over."""
        return ShardPlan({self.queue: self.changes}).count_at(self.queue, self.now_ms)

    @property
    def served(self) -> int:
        """The shards consumers serve (`ShardPlan.served`)."""
        return ShardPlan({self.queue: self.changes}).served(self.queue)


def check_shards(shards: object, field_name: str = "shards") -> int:
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= SHARDS_MAX:
        raise InvalidArgument(field_name, f"must be an integer from 1 to {SHARDS_MAX}, got {shards!r}")
    return shards


# A UUIDv7 in the canonical form run ids have (lowercase, RFC 4122 variant): its first 48 bits,
# the first 12 hex digits, are the millisecond.
_CANONICAL_V7: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def run_time_ms(item_id: str) -> int | None:
    """The creation millisecond of a UUIDv7 id (a run id), or None for any other id."""
    # Read off the text for a canonical id (every placement and shard look-up of every run asks,
    # and parsing a UUID object cost a bulk trigger ~4 % of its CPU); any other form is parsed.
    if type(item_id) is str and _CANONICAL_V7.fullmatch(item_id):
        return int(item_id[:8] + item_id[9:13], 16)
    try:
        value = uuid.UUID(item_id)
    except (ValueError, AttributeError, TypeError):
        return None
    if value.version != 7:
        return None
    return value.int >> 80


def spread(item_id: str) -> int:
    """A stable hash of an id (the same in every process and release: CRC-32 of its UTF-8)."""
    return zlib.crc32(item_id.encode())


@dataclass(frozen=True)
class ShardPlan:
    """A snapshot of every queue's shard history.

    Attributes:
        histories: queue -> its changes, oldest first. A queue without one has one shard.
        valid_until_ms: Runs made before this (database clock) are placed exactly by this plan; a
            later one needs a newer plan (a change made since would apply to it). None: static,
            valid for ever (tests, embedders without PostgreSQL).
    """

    histories: Mapping[str, Sequence[ShardChange]] = field(default_factory=dict)
    valid_until_ms: int | None = None

    def count_at(self, queue: str, ms: int | None) -> int:
        """The count in effect at `ms` (None: the newest change)."""
        history = self.histories.get(queue, ())
        if not history:
            return 1
        if ms is None:
            return history[-1].shards
        count = 1
        for change in history:
            if change.effective_ms > ms:
                break
            count = change.shards
        return count

    def served(self, queue: str) -> int:
        """How many shards consumers serve: the highest count the queue ever had."""
        return max((change.shards for change in self.histories.get(queue, ())), default=1)

    def shard_of(self, queue: str, item_id: str, *, has_limits: bool = False) -> int:
        """The shard of a run (see the module's docstring)."""
        if has_limits or queue not in self.histories:  # (one shard: no need to read the id)
            return 0
        count = self.count_at(queue, run_time_ms(item_id))
        return 0 if count == 1 else spread(item_id) % count

    def places(self, item_id: str) -> bool:
        """Whether this plan places `item_id` exactly (its creation is before `valid_until_ms`)."""
        if self.valid_until_ms is None:
            return True
        made = run_time_ms(item_id)
        return made is not None and made < self.valid_until_ms


# (database now in ms, every queue's changes oldest first)
ShardSource = Callable[[], Awaitable[tuple[int, Mapping[str, Sequence[ShardChange]]]]]


class ShardMap:
    """The process's current `ShardPlan`, refreshed from `source` (PostgreSQL) when older than
    `refresh_every`, and at once when a run to place is newer than the plan's validity.

    Only the first read and a placement beyond the plan's validity wait for the source; a stale
    plan is refreshed in the background while callers go on with it (the counts only grow, and a
    change applies a lead time after it is made), so a slow or failing PostgreSQL never holds up a
    dequeue, an ack or the leader's Redis moves.

    Args:
        source: Where the histories come from; None: `static` for ever.
        static: queue -> shards, one change at the epoch each (tests, embedders).
        lead: The lead time changes are made with (`SHARD_LEAD`, `db/queue_shards.py`): a plan
            read at database time T places exactly every run made before T + lead.
        refresh_every: Most age of the plan for readers that only serve shards (workers).
    """

    def __init__(
        self,
        source: ShardSource | None = None,
        *,
        static: Mapping[str, int] | None = None,
        lead: timedelta = SHARD_LEAD,
        refresh_every: timedelta | None = None,
    ) -> None:
        self._source = source
        self._lead_ms = round(lead.total_seconds() * 1000)
        every = refresh_every if refresh_every is not None else lead / 4
        self._every_s = every.total_seconds()
        histories = {name: (ShardChange(0, check_shards(count)),) for name, count in (static or {}).items()}
        self.plan = ShardPlan(histories, None if source is None else 0)
        self._read_at: float | None = None
        self._lock = asyncio.Lock()
        self._background: asyncio.Task[None] | None = None
        self._failing = False

    @property
    def lead(self) -> timedelta:
        """The lead time this map assumes changes are made with: a change must be made with it."""
        return timedelta(milliseconds=self._lead_ms)

    async def refresh(self) -> ShardPlan:
        """Read the histories now. Raises what the source raises."""
        assert self._source is not None
        async with self._lock:
            started = time.monotonic()
            now_ms, histories = await self._source()
            plan = ShardPlan(
                {name: tuple(changes) for name, changes in histories.items()},
                now_ms + self._lead_ms - _MARGIN_MS,
            )
            self.plan = plan
            self._read_at = started
            return plan

    async def current(self) -> ShardPlan:
        """The plan for serving shards. The first call reads it (Unavailable if it cannot); later
        ones return the last read at once, starting a background refresh when it is stale."""
        if self._source is None:
            return self.plan
        if self._read_at is None:
            try:
                return await self.refresh()
            except Exception as exc:
                raise Unavailable(f"could not read the queues' shard counts: {exc}") from exc
        stale = time.monotonic() - self._read_at >= self._every_s
        if stale and (self._background is None or self._background.done()):
            self._background = asyncio.create_task(self._refresh_quietly(), name="shard-map-refresh")
        return self.plan

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh()
        except Exception:
            # Tried again at the next stale read; logged once per outage.
            if not self._failing:
                log.warning("could not refresh the queues' shard counts; using the last read", exc_info=True)
            self._failing = True
            self._read_at = time.monotonic()
        else:
            self._failing = False

    async def placing(self, item_ids: Sequence[str]) -> ShardPlan:
        """A plan that places every one of `item_ids` exactly (refreshed if needed).

        Raises:
            Unavailable: the histories could not be read and the plan is too old for these runs.
        """
        plan = await self.current()
        if all(plan.places(item_id) or run_time_ms(item_id) is None for item_id in item_ids):
            return plan
        try:
            plan = await self.refresh()
        except Exception as exc:
            raise Unavailable(f"could not read the queues' shard counts: {exc}") from exc
        return plan
