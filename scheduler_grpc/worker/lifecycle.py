"""The run lifecycle: one state per run a worker holds, every legal transition, the slots they take.

Pure bookkeeping (no I/O, no tasks, no clock): the stages that talk to Redis and PostgreSQL ask it
what to do and tell it what happened; an illegal transition raises `IllegalTransition` (a bug).
It knows runs only by id, delivery token and a few flags, so a server holding runs for remote
workers can drive the same lifecycle.

    (leased) --+-- LEASED ---claim--> RUNNING --outcome--> FINISHED --taken--> RECORDING --> RECORDED
               |      (a ready item: holds a slot)          (waits for the completion stage)
               +-- RESERVED --claim--> HELD --due--> STARTING --slot--> RUNNING
                     (a delayed item leased ahead: holds a reservation, no slot, until it starts)

A run in LEASED or RESERVED may instead end DROPPED (nothing to run), HANDED_BACK (given back to the
queue: breaker open, claim failed, no room) or LAPSED (even that failed: its lease expires). A run
whose task is stopped (`request_stop`, then `stopped` when its task has ended) goes on by the
reason: a cancel request gives a RUNNING run its cancelled outcome (FINISHED) and hands a held one
back (RETURNING); a lost lease makes it LOSING (its attempt is abandoned: ABANDONED); a shutdown
hands it back (RETURNING); a park lets it go (PARKED: nothing recorded, its lease left to expire,
for a remote worker's stream that ended: a new stream may resume it). RETURNING ends HANDED_BACK,
UNRESERVED (a held run, unspent) or LAPSED. A run resumed from a parked holder enters RUNNING
(`adopt`) with the claim token it had.

Slots (`concurrency` of them) are derived from the states: a LEASED or RUNNING run takes one, a
solo run all of them from its lease until it leaves (whatever its state: the worker runs nothing
beside it until it is recorded), and FINISHED runs from the queue beyond `finished_max` one each, so
a completion stage that falls behind stops fetching rather than growing a buffer. The fetch stage
books slots and reservations before it asks the queue (`book`), so a lease never finds its slot
taken; held runs that came due wait for slots first come, first served and come before fetching.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar


class State(enum.Enum):
    """Where a run is in the worker; the last six are ends (the run leaves the tracker)."""

    # Members are singletons: hashed by identity, not by Enum's Python-level hash of the name
    # (several lookups per transition, several transitions per run).
    __hash__ = object.__hash__

    LEASED = "leased"  # a ready item leased, its claim pending: holds a slot
    RESERVED = "reserved"  # a delayed item leased ahead of its due time, claim pending
    HELD = "held"  # claimed ahead, waiting for its due time
    STARTING = "starting"  # held, due, waiting for a slot
    RUNNING = "running"  # its handler runs (or is about to): holds a slot
    FINISHED = "finished"  # its outcome waits for the completion stage
    RECORDING = "recording"  # its outcome is being recorded
    RETURNING = "returning"  # being handed back to the queue (or cancelled unstarted)
    LOSING = "losing"  # its lease was lost: its attempt is being abandoned
    RECORDED = "recorded"
    HANDED_BACK = "handed_back"
    UNRESERVED = "unreserved"
    ABANDONED = "abandoned"
    DROPPED = "dropped"
    LAPSED = "lapsed"
    PARKED = "parked"  # let go unrecorded: its lease expires unless a new holder resumes it


class Stop(enum.Enum):
    """Why a run's task was asked to stop."""

    __hash__ = object.__hash__  # (as `State`'s)

    CANCEL = "cancel"  # an operator's (or `replace`'s) cancel request
    LOST = "lost"  # its lease is gone: another worker may hold the item now
    SHUTDOWN = "shutdown"  # the worker is stopping
    PARK = "park"  # let it go as it is (a remote worker's stream ended; it may resume elsewhere)


ENDS = frozenset({
    State.RECORDED, State.HANDED_BACK, State.UNRESERVED, State.ABANDONED, State.DROPPED, State.LAPSED, State.PARKED,
})  # fmt: skip
_S = State
# Every legal transition. Ends have none: a run that ended is gone.
_NEXT: dict[State, frozenset[State]] = {
    _S.LEASED: frozenset({_S.RUNNING, _S.DROPPED, _S.HANDED_BACK, _S.LAPSED}),
    _S.RESERVED: frozenset({_S.HELD, _S.DROPPED, _S.HANDED_BACK, _S.LAPSED}),
    _S.HELD: frozenset({_S.STARTING, _S.RETURNING, _S.LOSING, _S.PARKED}),
    _S.STARTING: frozenset({_S.RUNNING, _S.RETURNING, _S.LOSING, _S.PARKED}),
    _S.RUNNING: frozenset({_S.FINISHED, _S.RETURNING, _S.LOSING, _S.PARKED}),
    _S.FINISHED: frozenset({_S.RECORDING}),
    _S.RECORDING: frozenset({_S.RECORDED, _S.LAPSED}),
    _S.RETURNING: frozenset({_S.HANDED_BACK, _S.UNRESERVED, _S.LAPSED}),
    _S.LOSING: frozenset({_S.ABANDONED, _S.LAPSED}),
}
_SLOT_STATES = frozenset({_S.LEASED, _S.RUNNING})
# Each legal transition with what it does to the slots: -1 frees the run's, +1 takes one, 0 neither.
_EDGES: dict[State | None, dict[State, int]] = {
    was: {to: (to in _SLOT_STATES) - (was in _SLOT_STATES) for to in _NEXT.get(was, ())} for was in [None, *State]
}
_RESERVATION_STATES = frozenset({_S.RESERVED, _S.HELD, _S.STARTING})
_TASK_STATES = frozenset({_S.HELD, _S.STARTING, _S.RUNNING})  # a task of its own runs it
_CANCEL_TO = {_S.HELD: _S.RETURNING, _S.STARTING: _S.RETURNING, _S.RUNNING: _S.FINISHED}


class IllegalTransition(RuntimeError):
    """A stage asked for a transition the lifecycle does not have: a bug."""


class Run:
    """One delivery of a queue item that a worker holds.

    Subclass it to carry what the stages need (the lease, the claim, the task); the tracker only
    reads and writes these fields.
    """

    __slots__ = ("id", "reserved", "solo", "state", "stop", "token")

    def __init__(self, run_id: str, token: str, *, reserved: bool = False, solo: bool = False) -> None:
        self.id = run_id
        self.token = token  # the delivery's lease token
        self.reserved = reserved  # leased ahead of its due time (a reservation)
        self.solo = solo  # must run alone: takes every slot from its lease until it leaves
        self.state: State | None = None  # None until leased
        self.stop: Stop | None = None  # why its task was asked to stop, once it was

    def __repr__(self) -> str:
        return f"<Run {self.id} {self.state and self.state.value}{' solo' if self.solo else ''}>"


R = TypeVar("R", bound=Run)


def _nothing(*_: object) -> None:
    return None


class RunTracker(Generic[R]):
    """Every run a worker holds, each in one `State`, and the slot accounting derived from them.

    Args:
        concurrency: Slots: handlers that may run at once.
        finished_max: Outcomes of runs from the queue that may wait for recording without holding
            a slot (a held run's outcome never holds one: reservations are bounded already).
        reserve_max: Reservations (leased ahead, claimed or not, not started) held at most.
    """

    def __init__(self, concurrency: int, *, finished_max: int, reserve_max: int = 0) -> None:
        if concurrency < 1 or finished_max < 1 or reserve_max < 0:
            raise ValueError("concurrency and finished_max must be positive, reserve_max not negative")
        self.concurrency = concurrency
        self._limits = (finished_max, reserve_max)
        self._runs: dict[str, R] = {}  # by run id
        self._count = dict.fromkeys(State, 0)  # live runs by state
        self.ended: Counter[State] = Counter()  # runs that left, by their end
        self._slots = 0  # taken by LEASED and RUNNING runs
        self._solo = 0  # solo runs held: each takes every slot from its lease until it leaves
        self._buffered = 0  # FINISHED runs from the queue (not reserved)
        self._booked = (0, 0)  # (slots, reservations) promised to the fetch in flight
        self._fetching = False  # a fetch is booked
        self._starting: dict[R, None] = {}  # STARTING runs, in the order they came due
        self._finished: deque[R] = deque()  # FINISHED runs, oldest first
        self._hooks: tuple[Callable[[], None], Callable[[R], None], Callable[[], None]] = (_nothing, _nothing, _nothing)

    def hooks(
        self,
        *,
        on_slots: Callable[[], None] = _nothing,
        on_granted: Callable[[R], None] = _nothing,
        on_finished: Callable[[], None] = _nothing,
    ) -> None:
        """What the stages want to hear: `on_slots` when slots may have come free or a run left
        (the fetch stage waits for that), `on_granted` with a STARTING run the moment it gets its
        slot (now RUNNING), `on_finished` when an outcome is ready for the completion stage."""
        self._hooks = (on_slots, on_granted, on_finished)

    # -- queries -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[R]:
        return iter(list(self._runs.values()))

    def get(self, run_id: str) -> R | None:
        return self._runs.get(run_id)

    def count(self, *states: State) -> int:
        """Live runs in any of `states`."""
        return sum(self._count[state] for state in states)

    @property
    def idle(self) -> bool:
        """Holding no run at all (what a solo delivery needs)."""
        return not self._runs

    @property
    def running(self) -> int:
        """Handlers running (or about to): the slots busy."""
        return self._count[State.RUNNING]

    @property
    def used(self) -> int:
        """Slots taken: leased and running runs, and outcomes from the queue waiting beyond the
        completion buffer; all of them while a solo run is held."""
        if self._solo:
            return self.concurrency
        return self._slots + max(0, self._buffered - self._limits[0])

    def free_slots(self) -> int:
        """Slots the fetch stage may book: not used, not booked, not owed to held runs that are due."""
        return max(0, self.concurrency - self.used - self._booked[0] - len(self._starting))

    def reservation_room(self) -> int:
        """Reservations the fetch stage may book."""
        if self._solo:
            return 0  # nothing is taken beside a solo run
        held = self.count(*_RESERVATION_STATES)
        return max(0, self._limits[1] - held - self._booked[1])

    def in_state(self, *states: State) -> list[R]:
        return [run for run in self._runs.values() if run.state in states]

    def extendable(self) -> list[R]:
        """Runs whose leases must be kept: all but those being abandoned."""
        return [run for run in self._runs.values() if run.state is not State.LOSING]

    def stoppable(self) -> list[R]:
        """Runs with a task that was not asked to stop yet (cancel requests apply to these)."""
        return [run for run in self._runs.values() if run.state in _TASK_STATES and run.stop is None]

    # -- fetching ----------------------------------------------------------------------------------

    def book(self, slots: int, reservations: int = 0) -> None:
        """Promise slots and reservations to a fetch about to ask the queue (one fetch at a time)."""
        if self._fetching:
            raise IllegalTransition("a fetch is already booked")
        if not 0 <= slots <= self.free_slots() or not 0 <= reservations <= self.reservation_room():
            raise IllegalTransition(f"cannot book {slots} slots and {reservations} reservations")
        self._booked = (slots, reservations)
        self._fetching = True

    def lease(self, run: R) -> bool:
        """A delivery from the booked fetch. False (the run is not tracked: give it back) when its
        booking has no room left for it (held runs took the slots meanwhile) or the worker still
        holds an earlier delivery of the same item."""
        if run.state is not None or not self._fetching:
            raise IllegalTransition(f"{run!r} was leased already, or outside a fetch")
        slots, reservations = self._booked
        if run.id in self._runs:
            return False
        if run.reserved:
            if run.solo or reservations < 1:
                return False
            self._booked = (slots, reservations - 1)
            self._enter(run, State.RESERVED)
        elif run.solo:
            if slots < self.concurrency or self._runs:  # only an idle worker runs a solo delivery
                return False
            self._booked = (0, reservations)
            self._enter(run, State.LEASED)
            self._solo += 1
        else:
            if slots < 1:
                return False
            self._booked = (slots - 1, reservations)
            run.state = State.LEASED  # (`_enter`, inlined: the hot path)
            self._count[State.LEASED] += 1
            self._slots += 1
        self._runs[run.id] = run
        return True

    def end_booking(self) -> None:
        """The fetch is over: what it booked and did not lease is free again."""
        booked, self._booked, self._fetching = self._booked, (0, 0), False
        if booked[0]:
            self._freed()

    # -- claiming, starting, finishing ----------------------------------------------------------------

    def claimed(self, run: R) -> None:
        """Its attempt is claimed: a ready run starts (RUNNING), a reserved one is held (HELD)."""
        self._move(run, State.RUNNING if run.state is State.LEASED else State.HELD)

    def due(self, run: R) -> bool:
        """A held run's due time came: it waits for a slot (STARTING), first come, first served.
        True when it got one at once (RUNNING; `on_granted` is not called for it)."""
        self._move(run, State.STARTING)
        self._starting[run] = None
        self._grant(quiet=run)
        return run.state is State.RUNNING

    def finished(self, run: R) -> None:
        """Its handler is done: its outcome waits for the completion stage."""
        self._move(run, State.FINISHED, notify=False)
        if not run.reserved:
            self._buffered += 1  # before the slot counts as free: an outcome beyond the buffer keeps it
        self._finished.append(run)
        self._freed()
        self._hooks[2]()

    def has_finished(self) -> bool:
        return bool(self._finished)

    def take_finished(self, most: int) -> list[R]:
        """The oldest outcomes, up to `most`, for recording (RECORDING)."""
        finished = self._finished
        batch = [finished.popleft() for _ in range(min(most, len(finished)))]
        from_queue = 0
        for run in batch:  # FINISHED -> RECORDING: only FINISHED runs are in the buffer
            run.state = State.RECORDING
            if not run.reserved:
                from_queue += 1
        self._count[State.FINISHED] -= len(batch)
        self._count[State.RECORDING] += len(batch)
        before = self.used
        self._buffered -= from_queue
        if self.used < before:
            self._freed()
        return batch

    def adopt(self, run: R) -> None:
        """A run claimed by another holder that let it go (a remote worker's parked run, resumed under
        its claim token) is this worker's now, RUNNING: it takes a free slot at once."""
        if run.state is not None or run.id in self._runs or self.free_slots() < 1:
            raise IllegalTransition(f"{run!r} cannot be adopted (tracked already, or no free slot)")
        self._runs[run.id] = run
        run.state = State.RUNNING
        self._count[State.RUNNING] += 1
        self._slots += 1
        if run.solo:
            self._solo += 1

    def returning(self, run: R) -> None:
        """It is being handed back: its breaker is open, no slot came within the grace."""
        self._move(run, State.RETURNING)

    def end(self, run: R, end: State) -> None:
        """It leaves the worker: recorded, handed back, dropped, ..."""
        if end not in ENDS:
            raise IllegalTransition(f"{end} is not an end")
        self._move(run, end)

    def end_all(self, runs: Iterable[R], end: State) -> None:
        """`end` for a batch, telling the stages once."""
        if end not in ENDS:
            raise IllegalTransition(f"{end} is not an end")
        for run in runs:
            self._move(run, end, notify=False)
        self._freed()

    # -- stopping ----------------------------------------------------------------------------------

    def request_stop(self, run: R, why: Stop) -> bool:
        """Ask that the task of `run` stop; True when the caller must cancel it now (its state has a
        task and nobody asked before). Anything else is a race lost, not an error: a cancel of a run
        whose handler has returned leaves its outcome as it is."""
        if run.state not in _TASK_STATES or run.stop is not None or self._runs.get(run.id) is not run:
            return False
        run.stop = why
        return True

    def stopped(self, run: R) -> State | None:
        """The task of `run` ended by the cancellation asked for: the run goes on by the reason (a
        cancelled RUNNING run is FINISHED; the caller gives it its cancelled outcome). Returns its new
        state, or None when the run was not stopping (cancelled by no one of ours)."""
        state = run.state
        if run.stop is None or state is None or state not in _TASK_STATES:
            return None
        if run.stop is Stop.CANCEL:
            target = _CANCEL_TO[state]
        elif run.stop is Stop.PARK:
            target = State.PARKED
        else:
            target = State.LOSING if run.stop is Stop.LOST else State.RETURNING
        if target is State.FINISHED:
            self.finished(run)
        else:
            self._move(run, target)
        return target

    # -- the transitions -----------------------------------------------------------------------------

    def _move(self, run: R, to: State, *, notify: bool = True) -> None:
        # The state alone says whether the run is ours: only the tracker writes it, and a run that
        # left (an end) or was never leased (None) has no transitions.
        was = run.state
        slots = _EDGES[was].get(to)
        if slots is None:
            raise IllegalTransition(f"{run!r} cannot go to {to.value}")
        count = self._count
        count[was] -= 1  # type: ignore[index]  # not None: it has edges
        if was is State.STARTING:
            del self._starting[run]
        run.state = to
        if to in ENDS:
            del self._runs[run.id]
            self.ended[to] += 1
        else:
            count[to] += 1
        if slots:
            self._slots += slots
        if run.solo and to in ENDS:
            self._solo -= 1
        if notify and (slots < 0 or to in ENDS):
            self._freed()  # slots came free, or the worker may be idle now

    def _enter(self, run: R, state: State) -> None:
        run.state = state
        self._count[state] += 1
        if state is State.LEASED:
            self._slots += 1

    def _freed(self) -> None:
        self._grant()
        self._hooks[0]()

    def _grant(self, quiet: R | None = None) -> None:
        """Slots to the STARTING runs in their order; a slot a held run takes may be one the fetch
        in flight booked (the run is due now; the fetch gives back what it cannot place)."""
        while self._starting and self.used < self.concurrency:
            run = next(iter(self._starting))
            self._move(run, State.RUNNING)
            slots, reservations = self._booked
            self._booked = (max(0, min(slots, self.concurrency - self.used)), reservations)
            if run is not quiet:
                self._hooks[1](run)
