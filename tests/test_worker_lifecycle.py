"""The worker's run lifecycle (`RunTracker`), a pure state machine, driven by Hypothesis through
random interleavings of everything the stages do to it: lease (ready, reserved, solo, a second
delivery of an item still held), claim, a claim failing (store fault) or finding nothing to do,
a held run coming due and waiting for a slot, its grace running out, cancel requests, lost
leases, breaker deferrals, timeouts and completions, recording (failing and retried, or given up),
shutdown. After every step: slots never negative, never leaked and never over the concurrency,
a due held run never waits while a slot is free, idle iff empty; at the end every run leased has
ended exactly once (recorded, handed back, unreserved, abandoned, dropped or lapsed)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler_grpc.worker.lifecycle import ENDS, IllegalTransition, Run, RunTracker, State, Stop

CONCURRENCY = 3
FINISHED_MAX = 1
RESERVE_MAX = 3
_TASKS = (State.HELD, State.STARTING, State.RUNNING)


class Lifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tracker: RunTracker[Run] = RunTracker(CONCURRENCY, finished_max=FINISHED_MAX, reserve_max=RESERVE_MAX)
        self.granted: list[Run] = []
        self.slot_calls = 0
        self.tracker.hooks(on_granted=self.granted.append, on_slots=self._slots)
        self.ids = itertools.count()
        self.live: dict[str, Run] = {}  # what the tracker must hold
        self.ends: dict[str, State] = {}  # by run: how it ended (exactly once)
        self.leased = 0

    def _slots(self) -> None:
        self.slot_calls += 1

    def _in(self, *states: State) -> list[Run]:
        return [run for run in self.live.values() if run.state in states]

    def _end(self, run: Run, end: State) -> None:
        self.tracker.end(run, end)
        assert run.id not in self.ends, f"{run!r} ended twice"
        self.ends[run.id] = end
        del self.live[run.id]

    def _pick(self, data: st.DataObject, *states: State) -> Run:
        return data.draw(st.sampled_from(sorted(self._in(*states), key=lambda run: run.id)))

    # -- fetch -----------------------------------------------------------------------------------

    @rule(ready=st.integers(0, 4), reserved=st.integers(0, 3), duplicate=st.booleans(), steal=st.booleans())
    def fetch(self, ready: int, reserved: int, duplicate: bool, steal: bool) -> None:
        tracker = self.tracker
        free, room = tracker.free_slots(), tracker.reservation_room()
        tracker.book(free, room)
        if steal and self._in(State.HELD):  # a held run comes due while the dequeue is out
            run = self._in(State.HELD)[0]
            if tracker.due(run):
                assert run.state is State.RUNNING
        offered: list[Run] = []
        for _ in range(min(ready, free)):
            offered.append(Run(f"r{next(self.ids)}", "t"))
        for _ in range(min(reserved, room)):
            offered.append(Run(f"r{next(self.ids)}", "t", reserved=True))
        if duplicate and self.live:
            offered.append(Run(next(iter(self.live)), "t2"))  # a second delivery of an item we hold
        for run in offered:
            if tracker.lease(run):
                assert run.id not in self.live
                self.live[run.id] = run
                self.leased += 1
            else:
                assert run.state is None  # given back by the caller, never tracked
        tracker.end_booking()

    @rule()
    def fetch_solo(self) -> None:
        """A solo delivery: taken only by an idle worker (one holding nothing), then alone."""
        idle = self.tracker.idle
        self.tracker.book(self.tracker.free_slots())
        run = Run(f"s{next(self.ids)}", "ts", solo=True)
        assert self.tracker.lease(run) is idle
        self.tracker.end_booking()
        if idle:
            self.live[run.id] = run
            self.leased += 1
            assert self.tracker.free_slots() == 0

    @rule()
    def a_second_fetch_cannot_book_while_one_is_out(self) -> None:
        self.tracker.book(0)
        with pytest.raises(IllegalTransition):
            self.tracker.book(0)
        self.tracker.end_booking()

    # -- claim -----------------------------------------------------------------------------------

    @precondition(lambda self: self._in(State.LEASED, State.RESERVED))
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        run = self._pick(data, State.LEASED, State.RESERVED)
        self.tracker.claimed(run)
        assert run.state is (State.HELD if run.reserved else State.RUNNING)

    @precondition(lambda self: self._in(State.LEASED, State.RESERVED))
    @rule(data=st.data(), end=st.sampled_from([State.HANDED_BACK, State.LAPSED, State.DROPPED]))
    def claim_fails_or_finds_nothing(self, data: st.DataObject, end: State) -> None:
        self._end(self._pick(data, State.LEASED, State.RESERVED), end)

    # -- held runs -------------------------------------------------------------------------------

    @precondition(lambda self: self._in(State.HELD))
    @rule(data=st.data())
    def due(self, data: st.DataObject) -> None:
        run = self._pick(data, State.HELD)
        started = self.tracker.due(run)
        assert started is (run.state is State.RUNNING)
        assert run not in self.granted

    @precondition(lambda self: self._in(State.STARTING, State.HELD))
    @rule(data=st.data(), end=st.sampled_from([State.UNRESERVED, State.LAPSED]))
    def grace_over_or_breaker_open(self, data: st.DataObject, end: State) -> None:
        run = self._pick(data, State.STARTING, State.HELD)
        self.tracker.returning(run)
        self._end(run, end)

    # -- running ---------------------------------------------------------------------------------

    @precondition(lambda self: self._in(State.RUNNING))
    @rule(data=st.data())
    def handler_returns(self, data: st.DataObject) -> None:
        # Also after a stop was asked for: the handler may end before the cancellation lands.
        self.tracker.finished(self._pick(data, State.RUNNING))

    @precondition(lambda self: self.tracker.free_slots() > 0)
    @rule()
    def adopt(self) -> None:
        """A run another holder let go (a remote worker's parked run, resumed): RUNNING at once."""
        run = Run(f"a{next(self.ids)}", "ta")
        self.tracker.adopt(run)
        assert run.state is State.RUNNING
        self.live[run.id] = run
        self.leased += 1  # (taken, as a lease is: it must end once)
        with pytest.raises(IllegalTransition):
            self.tracker.adopt(run)

    @precondition(lambda self: self._in(State.RUNNING))
    @rule(data=st.data())
    def breaker_opened_at_start(self, data: st.DataObject) -> None:
        run = self._pick(data, State.RUNNING)
        self.tracker.returning(run)
        self._end(run, State.HANDED_BACK)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), why=st.sampled_from(Stop))
    def stop_requested(self, data: st.DataObject, why: Stop) -> None:
        """A cancel request, a lost lease or a shutdown: only a run with a task can be stopped,
        once; for any other it is a race lost (its outcome stands)."""
        run = self._pick(data, *self.live_states())
        before = run.stop
        asked = self.tracker.request_stop(run, why)
        assert asked is (run.state in _TASKS and before is None)

    def live_states(self) -> set[State]:
        return {run.state for run in self.live.values() if run.state is not None}

    @precondition(lambda self: [r for r in self._in(*_TASKS) if r.stop is not None])
    @rule(data=st.data())
    def task_ends_cancelled(self, data: st.DataObject) -> None:
        run = data.draw(st.sampled_from(sorted((r for r in self._in(*_TASKS) if r.stop), key=lambda r: r.id)))
        was, state = run.state, self.tracker.stopped(run)
        assert state is run.state
        if run.stop is Stop.CANCEL:
            assert state is (State.FINISHED if was is State.RUNNING else State.RETURNING)
        elif run.stop is Stop.PARK:  # let go as it is: it leaves, nothing else to do
            assert state is State.PARKED
            self.ends[run.id] = State.PARKED
            del self.live[run.id]
        else:
            assert state is (State.LOSING if run.stop is Stop.LOST else State.RETURNING)

    @precondition(lambda self: self._in(State.RETURNING, State.LOSING))
    @rule(data=st.data(), fault=st.booleans())
    def hand_back_or_abandon(self, data: st.DataObject, fault: bool) -> None:
        run = self._pick(data, State.RETURNING, State.LOSING)
        if fault:
            self._end(run, State.LAPSED)
        else:
            self._end(run, State.ABANDONED if run.state is State.LOSING else State.HANDED_BACK)

    # -- completion ------------------------------------------------------------------------------

    @precondition(lambda self: self.tracker.has_finished())
    @rule(most=st.integers(1, 4))
    def take_outcomes(self, most: int) -> None:
        oldest = [run for run in self._in(State.FINISHED)]
        batch = self.tracker.take_finished(most)
        assert 1 <= len(batch) <= most
        assert all(run.state is State.RECORDING for run in batch)
        assert len(batch) <= len(oldest)

    @precondition(lambda self: self._in(State.RECORDING))
    @rule(data=st.data())
    def recording_fails_and_is_retried(self, data: st.DataObject) -> None:
        run = self._pick(data, State.RECORDING)
        assert run in self.tracker.extendable()  # its lease is kept while recording is retried

    @precondition(lambda self: self._in(State.RECORDING))
    @rule(data=st.data(), given_up=st.booleans())
    def recorded(self, data: st.DataObject, given_up: bool) -> None:
        self._end(self._pick(data, State.RECORDING), State.LAPSED if given_up else State.RECORDED)

    @precondition(lambda self: self.ends)
    @rule(data=st.data(), to=st.sampled_from(sorted(ENDS, key=lambda state: state.value)))
    def an_ended_run_moves_no_more(self, data: st.DataObject, to: State) -> None:
        run_id = data.draw(st.sampled_from(sorted(self.ends)))
        ghost = Run(run_id, "t")
        ghost.state = self.ends[run_id]
        with pytest.raises(IllegalTransition):
            self.tracker.end(ghost, to)  # recorded (or handed back...) twice
        with pytest.raises(IllegalTransition):
            self.tracker.claimed(ghost)

    @precondition(lambda self: self._in(State.FINISHED, State.RECORDING, State.LEASED))
    @rule(data=st.data())
    def illegal_moves_raise(self, data: st.DataObject) -> None:
        run = self._pick(data, State.FINISHED, State.RECORDING, State.LEASED)
        with pytest.raises(IllegalTransition):
            self.tracker.due(run)  # never held

    # -- shutdown --------------------------------------------------------------------------------

    def teardown(self) -> None:
        """The worker stops: everything it holds is driven to an end; none may be left."""
        self.shutdown()
        assert self.tracker.idle
        assert not self.live
        assert len(self.ends) == self.leased, "a run was lost"
        assert sum(self.tracker.ended.values()) == self.leased
        assert self.tracker.ended == Counter(self.ends.values())

    def shutdown(self) -> None:
        tracker = self.tracker
        for run in self._in(State.LEASED, State.RESERVED):  # the claim stage hands back its batch
            self._end(run, State.HANDED_BACK)
        for run in self._in(*_TASKS):
            tracker.request_stop(run, Stop.SHUTDOWN)
            if run.state is not None and run.stop is not None and tracker.stopped(run) is State.PARKED:
                self.ends[run.id] = State.PARKED  # (a park asked for before the stop: it leaves)
                del self.live[run.id]
        for run in self._in(State.RETURNING, State.LOSING):
            self._end(run, State.ABANDONED if run.state is State.LOSING else State.HANDED_BACK)
        while tracker.has_finished():
            tracker.take_finished(10)
        for run in self._in(State.RECORDING):
            self._end(run, State.RECORDED)

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def slots_are_derived_from_the_states(self) -> None:
        tracker = self.tracker
        taken = len(self._in(State.LEASED, State.RUNNING))
        waiting = sum(1 for r in self._in(State.FINISHED) if not r.reserved)
        solo = any(run.solo for run in self.live.values())
        used = CONCURRENCY if solo else taken + max(0, waiting - FINISHED_MAX)
        assert tracker.used == used
        assert 0 <= used <= CONCURRENCY
        starting = len(self._in(State.STARTING))
        assert tracker.free_slots() == max(0, CONCURRENCY - used - starting)
        if starting:
            assert used == CONCURRENCY, "a due held run waits while a slot is free"
        if solo:  # it runs alone, from its lease until it is recorded (or otherwise ends)
            assert len(self.live) == 1
            assert tracker.reservation_room() == 0
        assert tracker.running == len(self._in(State.RUNNING))

    @invariant()
    def reservations_are_bounded(self) -> None:
        held = len(self._in(State.RESERVED, State.HELD, State.STARTING))
        assert held <= RESERVE_MAX
        if not any(run.solo for run in self.live.values()):
            assert self.tracker.reservation_room() == RESERVE_MAX - held

    @invariant()
    def the_tracker_holds_exactly_the_live_runs(self) -> None:
        tracker = self.tracker
        assert tracker.idle is (len(tracker) == 0) is (not self.live)
        assert {run.id for run in tracker} == set(self.live)
        assert all(tracker.get(run_id) is run for run_id, run in self.live.items())
        assert not set(self.live) & set(self.ends)
        assert {run.id for run in tracker.extendable()} == {
            r.id for r in self.live.values() if r.state is not State.LOSING
        }
        for state in State:
            if state not in ENDS:
                assert tracker.count(state) == len(self._in(state))

    @invariant()
    def granted_runs_are_running(self) -> None:
        for run in self.granted:
            assert run.state is not State.STARTING


TestLifecycle = Lifecycle.TestCase
TestLifecycle.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_a_tracker_refuses_a_bad_configuration() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        RunTracker(0, finished_max=1)
