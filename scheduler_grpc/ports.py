"""What each role needs of its stores, as small protocols named for the need.

A role depends on the methods it calls and the guarantees it relies on, not on a repository's
whole surface: the worker on a `RunStore`, a `WorkQueue`, an `EventBus` and `HistoryPruning`; the
leader on a `FiringStore` and a `RecoveryStore`; the trigger batcher on a `TriggerStore`; cancels
(`dispatch.cancel_runs`) on a `CancelStore`. The implementations are PostgreSQL's (`db/runs.py`,
`db/firing.py`, `db/recovery.py`, `db/history.py`) and Redis's (`queue.Queue`,
`events.RedisEventBus`); the tests run the roles against those, on real servers, never on fakes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from typing import Any, Protocol

from scheduler_grpc.db.executions import (
    Advance,
    Claim,
    Completed,
    DeadRun,
    Outcome,
    PlannedSlot,
    Queued,
    TriggerRequest,
    TriggerResult,
)
from scheduler_grpc.events import ExecutionEvent
from scheduler_grpc.executions import Execution, ExecutionStatus
from scheduler_grpc.queue import Lease, Leased


class RunStore(Protocol):
    """What the worker claims, completes and hands back attempts through (`db.runs.RunRepository`).

    Items are `(run_id, lease_token)` for a claim and `(execution_id, claim_token)` after it. Every
    write applies only to an attempt still `running` under that token: an attempt whose lease
    another worker took over changes nothing and is left out of the reply. Each call is one
    statement, safe to send again after a lost reply: a repeated claim returns the same attempt, a
    repeated completion is reported again (with `resent`), a repeated release, unclaim or abandon
    finds nothing left to do. A value the store refuses fails only the outcome that carried it
    (`complete` records it `dead`).
    """

    async def claim(
        self,
        items: Sequence[tuple[str, str]],
        worker_id: str,
        *,
        reserved: Sequence[bool] = (),
        leased_at: Sequence[datetime | None] = (),
        slots: Sequence[datetime | None] = (),
    ) -> list[Claim]:
        """The current attempt of each run, now `running` under the lease token; a ready item's
        start is its lease instant (`leased_at`, one per item; unknown: the claim's time). `slots`:
        each run's `scheduled_for` (one per item; None or empty: unknown, found by run id alone)."""
        ...

    async def resumable(self, items: Sequence[tuple[str, str]]) -> list[Claim]:
        """The attempts `(execution_id, claim_token)` still `running` under their token, as claims
        (a remote worker's runs resumed on a new stream)."""
        ...

    async def upstream_results(self, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """For runs of a flow run: each upstream job's result by job name, by run id."""
        ...

    async def complete(self, outcomes: Sequence[Outcome], *, resent: bool = True) -> list[Completed]:
        """Record how attempts ended (and add the retry an outcome asks for)."""
        ...

    async def release(
        self,
        items: Sequence[tuple[str, str]],
        *,
        reason: str = ...,
        delay: timedelta = ...,
        slots: Sequence[datetime | None] = (),
    ) -> int:
        """Hand attempts back `interrupted` (no retry budget spent), the next attempt `queued`."""
        ...

    async def unclaim(
        self, items: Sequence[tuple[str, str]], *, slots: Sequence[datetime | None] = ()
    ) -> dict[str, ExecutionStatus]:
        """Undo the claims of reserved attempts that never started (back to `queued`)."""
        ...

    async def abandon(self, items: Sequence[tuple[str, str]], *, slots: Sequence[datetime | None] = ()) -> int:
        """Give up attempts whose lease was lost (`abandoned`, the next attempt `queued`)."""
        ...

    async def cancel_requested(
        self, execution_ids: Sequence[str], *, slots: Sequence[datetime | None] = ()
    ) -> list[str]:
        """Which of these running attempts have a cancel requested (the worker's poll)."""
        ...


class HistoryPruning(Protocol):
    """What `system.cleanup` prunes the execution history through (`db.history.HistoryRepository`)."""

    async def prune(self, older_than: datetime) -> int:
        """Drop the whole days of history that end by `older_than` (never a DELETE of executions); a
        day holding an open (queued or running) attempt is kept whole. Returns the attempts dropped."""
        ...


class WorkQueue(Protocol):
    """What the worker leases runs through: one queue (`sharded.ShardedQueue`: every shard of it).

    A lease is a delivery under a token: every move of an item (ack, nack, finish, extend) applies
    only while that token holds it, and each is safe to send again after a lost reply (a resend
    finds the item already moved and reports False for it). A lease not extended expires and the
    leader recovers its item.
    """

    async def dequeue_blocking(
        self,
        worker_id: str,
        visibility_timeout: timedelta,
        count: int = 1,
        wait: timedelta = ...,
        *,
        reserve: timedelta = ...,
        reserve_count: int = 0,
        idle: bool = False,
        held: Callable[[], int] | None = None,
    ) -> Leased:
        """Lease up to `count` due items (and reserve items due within `reserve`, a fair share of
        them beside the other reserving workers, less the reservations `held()` counts), waiting up to
        `wait`."""
        ...

    async def ack_many(self, leases: Iterable[Lease | tuple[str, str]]) -> list[bool]:
        """Remove items whose runs are done with (or have nothing left to run)."""
        ...

    async def nack(
        self,
        item_id: str,
        token: str,
        delay: timedelta = ...,
        *,
        count_delivery: bool = True,
        retry_after: timedelta | None = None,
    ) -> bool:
        """Give one item back, due after `delay` (or its limit keys paused for `retry_after`)."""
        ...

    async def pause_key(self, limit: str, key: str, duration: timedelta | None = None) -> datetime | None:
        """Pause one limit key for `duration` (back-pressure: a webhook host's open breaker)."""
        ...

    async def pause_keys_equal(self, ids: Iterable[str], key: str, duration: timedelta) -> int:
        """Pause the limit keys of these items whose key is `key` (a webhook host's open breaker)."""
        ...

    async def nack_many(
        self, leases: Iterable[Lease | tuple[str, str]], delay: timedelta = ..., *, count_delivery: bool = True
    ) -> list[bool]:
        """Give items back, due after `delay`."""
        ...

    async def finish_many(
        self,
        acks: Iterable[Lease] = (),
        retries: Iterable[tuple[Lease, timedelta]] = (),
        dead: Iterable[tuple[Lease, str]] = (),
    ) -> list[bool]:
        """Ack, delay for a retry or park as dead letters, in one call."""
        ...

    async def extend_many(
        self, leases: Iterable[Lease | tuple[str, str]], more_time: timedelta
    ) -> list[datetime | None]:
        """Extend leases; None for one no longer held (its run is given up)."""
        ...

    async def purge_dead(
        self, ids: Iterable[str] | None, *, older_than: timedelta | None = None, batch: int = ...
    ) -> list[str]:
        """Drop dead letters (`system.cleanup`: those parked longer than `older_than`)."""
        ...


class EventBus(Protocol):
    """The execution event stream as the worker publishes to it and `system.cleanup` trims it
    (`events.RedisEventBus`; `read_after` reads it back, for tests and resumption).

    A publish is one call that appends its events in their order and is not appended twice when
    the client resends it after a lost reply. Events are a notification, not the record: one lost
    between a change and its publish leaves the change recorded in PostgreSQL.
    """

    async def publish(self, events: Iterable[ExecutionEvent]) -> list[str]:
        """Append events; returns their stream ids."""
        ...

    async def publish_encoded(self, encoded: Sequence[bytes], *, ids: bool = True) -> list[str]:
        """Append events already encoded (`events.encode_fields`); `ids=False` skips decoding the ids."""
        ...

    async def read_after(self, cursor: str = "0-0", count: int = 1000) -> list[ExecutionEvent]:
        """The events after `cursor`, oldest first."""
        ...

    async def trim_before(self, older_than: datetime) -> int:
        """Drop events older than `older_than` (`system.cleanup`)."""
        ...


class FiringStore(Protocol):
    """What the leader's scan records due slots through (`db.firing.FiringRepository`).

    `fire_clocked` is fenced by the leader's term in its one statement (`Fenced` once the term is
    stale, nothing written) and idempotent per slot: a slot never fires twice, so a scan repeated
    after a lost reply or by a new leader adds nothing.
    """

    async def fire_clocked(
        self,
        term: int,
        advances: Sequence[Advance],
        slots: Sequence[PlannedSlot],
        trace_contexts: Sequence[str | None] = (),
    ) -> tuple[list[Queued], datetime]:
        """Record slots and advance their jobs under `term` (each run with its slot's trace context,
        if any); the runs to enqueue, and the database clock."""
        ...

    async def open_run_ids(self, job_ids: Sequence[str], *, excluding: Sequence[str] = ()) -> list[str]:
        """Runs of these jobs still open (those the `replace` policy cancels)."""
        ...


class TriggerStore(Protocol):
    """What manual triggers create runs through (`db.firing.FiringRepository`): one statement for
    many requests, idempotent per `request_id` (a resend gets the run the first call made)."""

    async def trigger_now(self, requests: Sequence[TriggerRequest]) -> list[TriggerResult]:
        """One result per request, in their order."""
        ...


class CancelStore(Protocol):
    """What a cancel records through (`db.recovery.RecoveryRepository`, `dispatch.cancel_runs`).

    Idempotent: a run already cancelled or finished is left alone. Inside `fenced(term)` nothing
    commits unless `term` is still the leader's.
    """

    def fenced(self, term: int) -> AbstractAsyncContextManager[CancelStore]:
        """This store inside one transaction that commits only while `term` is current (`Fenced`)."""
        ...

    async def cancel_runs(self, run_ids: Sequence[str]) -> tuple[list[Execution], list[Execution]]:
        """Cancel queued attempts now; ask for running ones (their workers cancel them)."""
        ...


class RecoveryStore(Protocol):
    """What the leader's recover and reconcile loops read and write through
    (`db.recovery.RecoveryRepository`).

    The scans only read (a page of runs by run id, so a loop resumes where it stopped). The writes
    run inside `fenced(term)`: one transaction that first checks the term, so a deposed leader
    changes nothing; each is idempotent (a run already dead or cancelled is left alone).
    """

    def fenced(self, term: int) -> AbstractAsyncContextManager[RecoveryStore]:
        """This store inside one transaction that commits only while `term` is current (`Fenced`)."""
        ...

    async def open_runs(self, *, older_than: timedelta, after_run_id: str | None, limit: int) -> list[Queued]:
        """Runs whose latest attempt is `queued` (older than `older_than`), by run id."""
        ...

    async def abandon_expired(self, leases: Sequence[tuple[str, str]]) -> int:
        """End the attempts of expired leases `(run_id, lease token)` `abandoned`, the next `queued`."""
        ...

    async def stale_running_runs(self, *, grace: timedelta, limit: int) -> list[Queued]:
        """Runs `running` past their timeout plus `grace`."""
        ...

    async def dead_runs(self, *, after_run_id: str | None, limit: int) -> list[DeadRun]:
        """Runs whose latest attempt is `dead` and not purged, by run id."""
        ...

    async def mark_runs_dead(self, run_ids: Sequence[str], reason: str) -> list[Execution]:
        """Record the latest open attempt of each run `dead`."""
        ...

    async def cancel_runs(self, run_ids: Sequence[str]) -> tuple[list[Execution], list[Execution]]:
        """As `CancelStore.cancel_runs` (the `replace` policy's cancels)."""
        ...
