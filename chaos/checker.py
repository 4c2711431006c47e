"""What a fault run must not have done, read from PostgreSQL after healing.

Invariants (each violation is reported with the slots or runs it concerns):

* duplicate slot: more than one run for one (job, scheduled slot) -- a slot fired twice;
* duplicate success: more than one `succeeded` attempt of one run -- a late completion accepted;
* lost slot (hole): a slot the schedule expects in the window with no row at all; a slot recorded
  `missed` or `skipped` is explained by the job's misfire or concurrency policy and counted apart,
  and so is a slot inside a recorded run of misfires (one `missed` row from `scheduled_for` through
  `missed_through`); a slot inside such a range that also has a run of its own is a duplicate;
* failed: a fired run of a job that always succeeds whose last attempt ended otherwise (dead,
  cancelled, abandoned ...): the run was fired but never completed;
* stuck: a run whose last attempt is still `queued` or `running` after healing and settling;
* stale term: a row written by the scheduler under term t although a newer term T > t had already
  been recorded before the row's transaction began. The term history comes from a trigger on
  `leader_state` the suite installs (`install_term_history`), stamped with `clock_timestamp()` when
  the new term is written: a fenced write that started after that instant must see the new term
  (its FOR SHARE waits for the writer) and be refused, so such a row is a write accepted under a
  stale term;
* over cap (issue 22; scenarios with limits, `check_caps`): a key of a concurrency limit held by
  more units than its cap at some instant, counted over the attempts' [started_at, end) intervals
  (`attempt_end` says which end each attempt gets, and why; a killed worker's attempt ends at its
  kill).
* remote workers (issue 23; scenarios with SDK workers, over `attempts_of`): a run not succeeded
  exactly once (`not_exactly_once`); an assignment the worker never acknowledged that spent an
  attempt (`spent_unacknowledged`); an attempt left `running` longer than its lease plus the
  visibility timeout after its worker went away (`overdue_running`); a success recorded for a
  worker the suite had killed (`succeeded_on`).

Recovery: for each fault instant, the time until the next slot fired (or until given runs finished,
or until a slot fired after it succeeded).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

import asyncpg

from scheduler_grpc.jobs import Job, ScheduleKind
from scheduler_grpc.schedule import fire_times

_TERM_HISTORY = """
CREATE TABLE IF NOT EXISTS chaos_term_history (
    term        bigint NOT NULL,
    holder      text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION chaos_record_term() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos_term_history (term, holder) VALUES (NEW.term, NEW.holder);
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS chaos_term_history ON leader_state;
CREATE TRIGGER chaos_term_history AFTER INSERT OR UPDATE ON leader_state
    FOR EACH ROW EXECUTE FUNCTION chaos_record_term();
"""

FINAL_OK = "succeeded"
OPEN = ("queued", "running")
POLICY = ("missed", "skipped")
SAMPLE = 5  # examples kept per invariant in a report


async def install_term_history(pool: asyncpg.Pool) -> None:
    """Record every new leader term with the instant it was written (call after migrating)."""
    await pool.execute(_TERM_HISTORY)


def expected_slots(job: Job, start: datetime, end: datetime) -> list[datetime]:
    """The slots `job` should fire in [start, end] (cron or one-shot)."""
    if job.schedule_kind is ScheduleKind.ONCE:
        return [job.run_at] if job.run_at is not None and start <= job.run_at <= end else []
    schedule = job.cron_schedule
    if schedule is None:
        return []
    slots = []
    for fire in fire_times(schedule, start - timedelta(microseconds=1)):
        if fire.instant > end:
            break
        slots.append(fire.instant)
    return slots


@dataclass(frozen=True)
class FaultMark:
    """One fault instance for the recovery figures.

    Attributes:
        label: What happened ("kill -9 scheduler-1").
        at: When (for outages: when healed).
        after_term: Only slots fired under a newer term count (a killed leader's own last write
            must not count as the recovery).
        run_ids: Measure until these runs have succeeded instead of until the next slot fired.
        completed: Measure until a slot fired after `at` has succeeded (its run went through the
            queue after the fault: faults of the queue's own Redis node).
    """

    label: str
    at: datetime
    after_term: int | None = None
    run_ids: tuple[str, ...] = ()
    completed: bool = False


@dataclass
class Violation:
    invariant: str
    detail: str


@dataclass
class CheckReport:
    """The counts of one scenario and the violations behind them."""

    expected: int = 0
    fired: int = 0
    explained: int = 0
    duplicated: int = 0
    lost: int = 0
    failed: int = 0
    stuck: int = 0
    stale: int = 0
    caps: CapReport | None = None  # scenarios with limits: what `check_caps` found
    recovery: list[float | None] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)

    def add(self, invariant: str, items: Sequence[object]) -> None:
        if not items:
            return
        shown = ", ".join(str(item) for item in items[:SAMPLE])
        more = f" (+{len(items) - SAMPLE} more)" if len(items) > SAMPLE else ""
        self.violations.append(Violation(invariant, f"{len(items)}: {shown}{more}"))

    def recovery_percentile(self, q: float) -> float | None:
        """The q-quantile of the measured recoveries; None if none, inf if one never recovered."""
        if not self.recovery:
            return None
        values = sorted(float("inf") if value is None else value for value in self.recovery)
        if len(values) == 1:
            return values[0]
        index = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
        return values[index]

    def recovery_median(self) -> float | None:
        if not self.recovery:
            return None
        return statistics.median(float("inf") if value is None else value for value in self.recovery)


def _slot(job_id: object, slot: datetime) -> str:
    return f"{str(job_id)[:8]}@{slot:%H:%M:%S.%f}"[:-3]


async def check(
    pool: asyncpg.Pool,
    *,
    jobs: Sequence[Job],
    start: datetime,
    end: datetime,
    succeeding_jobs: Sequence[str] | None = None,
    marks: Sequence[FaultMark] = (),
) -> CheckReport:
    """Check the invariants over the scheduled jobs `jobs` in the window [start, end].

    Args:
        pool: The scenario's database.
        jobs: The jobs whose schedules are checked for holes and duplicates.
        start: The first instant of the window (slots before are not expected).
        end: The last instant of the window (the cut-off after healing and settling).
        succeeding_jobs: Jobs whose runs must all end `succeeded` (default: all of `jobs`).
        marks: Fault instants to measure recovery from.
    """
    report = CheckReport()
    job_ids = [job.id for job in jobs]
    rows = await pool.fetch(
        """SELECT job_id, scheduled_for, count(DISTINCT run_id) AS runs,
                  array_agg(DISTINCT status) FILTER (WHERE attempt = 1) AS first_status
           FROM job_executions WHERE job_id = ANY($1::uuid[]) AND scheduled_for BETWEEN $2 AND $3
           GROUP BY job_id, scheduled_for""",
        job_ids,
        start,
        end,
    )
    recorded: dict[tuple[str, datetime], asyncpg.Record] = {(str(r["job_id"]), r["scheduled_for"]): r for r in rows}
    ranges: dict[str, list[tuple[datetime, datetime]]] = {}
    for r in await pool.fetch(
        """SELECT job_id, scheduled_for, missed_through FROM job_executions
           WHERE job_id = ANY($1::uuid[]) AND status = 'missed' AND missed_through > scheduled_for
             AND missed_through >= $2 AND scheduled_for <= $3""",
        job_ids,
        start,
        end,
    ):
        ranges.setdefault(str(r["job_id"]), []).append((r["scheduled_for"], r["missed_through"]))
    lost: list[str] = []
    inside_range_and_run: list[str] = []
    for job in jobs:
        for slot in expected_slots(job, start, end):
            report.expected += 1
            row = recorded.get((job.id, slot))
            in_range = any(first <= slot <= through for first, through in ranges.get(job.id, ()))
            if row is None and not in_range:
                lost.append(_slot(job.id, slot))
            elif row is None or set(row["first_status"] or ()) <= set(POLICY):
                report.explained += 1
            else:
                report.fired += 1
                if in_range:
                    inside_range_and_run.append(_slot(job.id, slot))
    report.lost = len(lost)
    report.add("lost slot (expected, never recorded)", lost)

    duplicated = [
        f"{_slot(r['job_id'], r['scheduled_for'])} x{r['runs']}"
        for r in await pool.fetch(
            # Every job, not only the window's: one-shot herds and catch-ups count too.
            """SELECT job_id, scheduled_for, count(DISTINCT run_id) AS runs FROM job_executions
               WHERE trigger <> 'manual'
               GROUP BY job_id, scheduled_for HAVING count(DISTINCT run_id) > 1"""
        )
    ]
    twice = [
        f"run {str(r['run_id'])[:8]} attempts {list(r['attempts'])}"
        for r in await pool.fetch(
            """SELECT run_id, array_agg(attempt ORDER BY attempt) AS attempts FROM job_executions
               WHERE status = 'succeeded' GROUP BY run_id HAVING count(*) > 1"""
        )
    ]
    report.duplicated = len(duplicated) + len(twice) + len(inside_range_and_run)
    report.add("duplicate slot (one slot, several runs)", duplicated)
    report.add("duplicate slot (recorded missed in a range, and run)", inside_range_and_run)
    report.add("duplicate success (several succeeded attempts of one run)", twice)

    latest = await pool.fetch(
        """SELECT DISTINCT ON (run_id) run_id, job_id, scheduled_for, attempt, status, worker_id
           FROM job_executions WHERE scheduled_for <= $1
           ORDER BY run_id, attempt DESC""",
        end,
    )
    must_succeed = set(job_ids if succeeding_jobs is None else succeeding_jobs)
    stuck = [
        f"run {str(r['run_id'])[:8]} {_slot(r['job_id'], r['scheduled_for'])} attempt {r['attempt']} {r['status']}"
        for r in latest
        if r["status"] in OPEN
    ]
    failed = [
        f"run {str(r['run_id'])[:8]} {_slot(r['job_id'], r['scheduled_for'])} attempt {r['attempt']} {r['status']}"
        for r in latest
        if str(r["job_id"]) in must_succeed and r["status"] not in (FINAL_OK, *OPEN, *POLICY)
    ]
    report.stuck = len(stuck)
    report.failed = len(failed)
    report.add("stuck (not final after settling)", stuck)
    report.add("fired but never completed", failed)

    stale = [
        f"{_slot(r['job_id'], r['scheduled_for'])} term {r['term']} < {r['newer']} ({r['late_ms']:.0f}ms late)"
        for r in await pool.fetch(
            """SELECT e.job_id, e.scheduled_for, e.term, max(h.term) AS newer,
                      extract(epoch FROM e.created_at - min(h.recorded_at)) * 1000 AS late_ms
               FROM job_executions e
               JOIN chaos_term_history h ON h.term > e.term AND h.recorded_at < e.created_at
               WHERE e.term IS NOT NULL
               GROUP BY e.id, e.job_id, e.scheduled_for, e.term, e.created_at"""
        )
    ]
    report.stale = len(stale)
    report.add("write accepted under a stale term", stale)

    for mark in marks:
        report.recovery.append(await recovery(pool, mark))
    return report


async def recovery(pool: asyncpg.Pool, mark: FaultMark) -> float | None:
    """Seconds from `mark.at` to the next slot fired (or until `mark.run_ids` all succeeded, or with
    `mark.completed` until a slot fired after it succeeded)."""
    if mark.run_ids:
        row = await pool.fetchrow(
            """SELECT count(DISTINCT run_id) AS done, max(finished_at) AS last FROM job_executions
               WHERE run_id = ANY($1::uuid[]) AND status = 'succeeded'""",
            list(mark.run_ids),
        )
        if row is None or row["done"] < len(set(mark.run_ids)):
            return None
        return max(0.0, float((row["last"] - mark.at).total_seconds()))
    if mark.completed:
        done = await pool.fetchval(
            """SELECT min(e.finished_at) FROM job_executions e
               WHERE e.status = 'succeeded' AND e.trigger = 'schedule' AND e.attempt = 1 AND e.created_at > $1""",
            mark.at,
        )
        return None if done is None else (done - mark.at).total_seconds()
    first = await pool.fetchval(
        """SELECT min(created_at) FROM job_executions
           WHERE trigger = 'schedule' AND created_at > $1 AND ($2::bigint IS NULL OR term > $2)""",
        mark.at,
        mark.after_term,
    )
    return None if first is None else (first - mark.at).total_seconds()


# -- limits (issue 22): no key over its concurrency cap ----------------------------------------------


@dataclass(frozen=True)
class Hold:
    """The units one attempt held of one limit key, over the half-open interval [start, end).

    Attributes:
        limit: The limit's name.
        key: The resolved key.
        units: Units the attempt takes of it.
        start: When the attempt started running (its `started_at`).
        end: When it surely stopped running (see `attempt_end`).
        attempt: A label for reports (run id prefix and attempt number).
    """

    limit: str
    key: str
    units: int
    start: datetime
    end: datetime
    attempt: str


@dataclass(frozen=True)
class CapBreach:
    """An instant at which attempts of one key held more units than its cap allows.

    Attributes:
        limit: The limit's name.
        key: The key.
        at: The start that took the key over its cap.
        held: Units held from that instant.
        cap: The key's cap (the limit, or the key's override).
        attempts: The attempts holding the key then.
    """

    limit: str
    key: str
    at: datetime
    held: int
    cap: int
    attempts: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.limit}/{self.key} {self.held}>{self.cap} at {self.at:%H:%M:%S.%f}: {', '.join(self.attempts)}"


def cap_breaches(holds: Iterable[Hold], cap: Callable[[str, str], int | None]) -> list[CapBreach]:
    """The stretches during which a key's holds exceed its cap: one breach per stretch, at the start
    that took the key over, with the most units held during it and every attempt that held the key
    then.

    Intervals are half-open: an attempt ending at the very instant another starts does not overlap
    it (a takeover records the old attempt's end and the new one's start in one transaction, at the
    same `now()`). An empty interval (start >= end) holds nothing. Keys whose `cap` is None (a rate
    limit, an unknown limit) are not checked. Sweep per key: O(n log n).
    """
    by_key: dict[tuple[str, str], list[Hold]] = {}
    for hold in holds:
        if hold.start < hold.end:
            by_key.setdefault((hold.limit, hold.key), []).append(hold)
    breaches: list[CapBreach] = []
    for (limit, key), items in by_key.items():
        allowed = cap(limit, key)
        if allowed is None:
            continue
        # (instant, 0 for an end, 1 for a start, index): at one instant ends come first (half-open).
        events = sorted([(h.start, 1, i) for i, h in enumerate(items)] + [(h.end, 0, i) for i, h in enumerate(items)])
        open_: dict[int, Hold] = {}
        held = 0
        current: CapBreach | None = None  # the stretch over the cap in progress
        for instant, kind, index in events:
            hold = items[index]
            if kind == 0:
                if open_.pop(index, None) is not None:
                    held -= hold.units
                if current is not None and held <= allowed:
                    breaches.append(current)
                    current = None
                continue
            open_[index] = hold
            held += hold.units
            if held > allowed:
                labels = [h.attempt for h in sorted(open_.values(), key=lambda h: h.start)]
                if current is None:
                    current = CapBreach(limit, key, instant, held, allowed, tuple(labels))
                else:
                    seen = [*current.attempts, *(label for label in labels if label not in current.attempts)]
                    current = replace(current, held=max(current.held, held), attempts=tuple(seen))
        if current is not None:
            breaches.append(current)
    breaches.sort(key=lambda b: b.at)
    return breaches


def worker_pid(worker_id: str | None) -> int | None:
    """The process id in a worker id (`host:pid:random`), or None."""
    if not worker_id:
        return None
    parts = worker_id.split(":")
    return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None


LEASE_RESOLUTION = timedelta(milliseconds=1)
"""A start recorded from a lease is the dequeue's clock in whole milliseconds (the instant the limits
admitted it), so it may read up to this much before the instant the run really held its units: a
hand-off within a millisecond of the previous holder's `finished_at` is not an overlap."""


@dataclass(frozen=True)
class Kill:
    """One worker process the suite killed (kill -9).

    Attributes:
        pid: Its process id (the middle of its worker id, `host:pid:random`).
        spawned: When the suite started it (before it could claim anything).
        killed: When the suite had reaped it: every attempt it ran had stopped by then.
    """

    pid: int
    spawned: datetime
    killed: datetime


def attempt_end(
    started_at: datetime,
    finished_at: datetime | None,
    worker_id: str | None,
    kills: Sequence[Kill],
    cutoff: datetime,
) -> datetime:
    """When an attempt surely stopped running: the end the checker gives its hold.

    * Recorded by its own worker (the usual case): `finished_at`. The worker records an outcome in
      PostgreSQL before it acks the queue item (the ack returns the units), so the recorded end
      precedes the units' return, and `started_at` is the lease that took them (the dequeue's Redis
      clock, in whole milliseconds, recorded by the claim): the recorded interval lies inside the
      real hold but for its start, which may read up to 1 ms early (`check_caps` counts a hold from
      `started_at + LEASE_RESOLUTION`).
    * Its worker was killed (kill -9 by the scenario): the kill instant, if earlier than
      `finished_at`. A killed attempt is recorded `abandoned` by whoever claims its run next, which
      may be long after its lease expired and its units came back (the run waits in its group's
      backlog behind the key's other runs meanwhile), so its `finished_at` says nothing about when
      it stopped; the process surely stopped by the time the suite reaped it, which is `killed`
      (an upper bound: a start inside the few milliseconds of the kill is counted as an overlap,
      and a legitimate one cannot happen there, since the units come back only when the lease
      expires). The process is the one with the attempt's pid spawned last before `started_at`.
      A claim that reached PostgreSQL after the kill (sent just before it, executed by the server
      after) still starts at its lease, before the kill, and holds [lease, killed): its units were
      taken at the lease and came back only when the lease expired. A claim without a lease
      instant (recorded at its own statement time) can start after `killed`: that process ran no
      handler, and the interval is empty.
    * Not finished at all: `cutoff` (the check's own instant; such a run is also reported stuck).

    Args:
        started_at: The attempt's `started_at`.
        finished_at: Its `finished_at` (None: still open).
        worker_id: The worker that ran it (`host:pid:random`).
        kills: Every worker kill, in any order; a pid may recur (reused by the system).
        cutoff: The end of an attempt never finished.
    """
    end = finished_at if finished_at is not None else cutoff
    pid = worker_pid(worker_id)
    ran_in = [kill for kill in kills if kill.pid == pid and kill.spawned <= started_at]
    if ran_in:
        end = min(end, max(ran_in, key=lambda kill: kill.spawned).killed)
    return end


@dataclass
class CapReport:
    """What `check_caps` found: the keys and attempts it looked at, the breaches, the notes."""

    keys: int = 0
    holds: int = 0
    breaches: list[CapBreach] = field(default_factory=list)
    wrong_keys: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


async def check_caps(pool: asyncpg.Pool, *, kills: Sequence[Kill] = (), cutoff: datetime | None = None) -> CapReport:
    """Read every started attempt of every job with limits and check that no key of a concurrency
    limit ever held more units than its cap (`cap_breaches` over `attempt_end` intervals).

    The keys an attempt holds are derived here, independently of the engine, from its job's limit
    refs and its own payload snapshot (`limits.resolve_keys`); when the run recorded the keys it
    took (`limit_keys`), they must be the same (else `wrong_keys`). A run whose payload gives no
    key holds nothing (it must have failed at fire time).
    """
    from scheduler_grpc.limits import LimitKeyError, refs_from_json, resolve_keys

    report = CapReport()
    caps: dict[str, tuple[int, dict[str, int]]] = {}
    for r in await pool.fetch("""SELECT name, "limit", overrides FROM limits WHERE kind = 'concurrency'"""):
        overrides = r["overrides"] or {}
        caps[r["name"]] = (int(r["limit"]), {key: int(value["limit"]) for key, value in overrides.items()})

    def cap(limit: str, key: str) -> int | None:
        found = caps.get(limit)
        return None if found is None else found[1].get(key, found[0])

    rows = await pool.fetch(
        """SELECT e.run_id::text, e.attempt, e.worker_id, e.started_at, e.finished_at, e.limit_keys,
                  coalesce(e.payload, j.payload) AS payload, j.limits AS refs, clock_timestamp() AS now
           FROM job_executions e JOIN jobs j ON j.id = e.job_id
           WHERE j.limits <> '[]'::jsonb AND e.started_at IS NOT NULL"""
    )
    holds: list[Hold] = []
    recorded = 0
    for r in rows:
        try:
            keys = resolve_keys(refs_from_json(r["refs"]), r["payload"] or {})
        except LimitKeyError:
            continue
        if r["limit_keys"] is not None:
            recorded += 1
            if [list(k) for k in r["limit_keys"]] != [list(k) for k in keys]:
                report.wrong_keys.append(f"run {r['run_id'][-12:]}: recorded {r['limit_keys']}, expected {keys}")
        end = attempt_end(r["started_at"], r["finished_at"], r["worker_id"], kills, cutoff or r["now"])
        label = f"{r['run_id'][-12:]}#{r['attempt']}"  # a uuid v7's head is its time: the tail tells runs apart
        start = r["started_at"] + LEASE_RESOLUTION
        holds += [Hold(limit, key, units, start, end, label) for limit, key, units in keys]
    report.holds = len(rows)
    report.keys = len({(h.limit, h.key) for h in holds if cap(h.limit, h.key) is not None})
    report.breaches = cap_breaches(holds, cap)
    if rows and not recorded:
        report.notes.append("no attempt recorded its limit keys (job_executions.limit_keys): keys derived only")
    return report


# -- remote workers (issue 23): runs of a worker killed or cut off ---------------------------------------


@dataclass(frozen=True)
class Attempt:
    """One attempt (a `job_executions` row) as the remote-worker rules read it."""

    run_id: str
    execution_id: str
    attempt: int
    status: str
    worker_id: str | None
    started_at: datetime | None
    finished_at: datetime | None

    def __str__(self) -> str:
        return f"#{self.attempt} {self.status}"


async def attempts_of(pool: asyncpg.Pool, *, run_ids: Sequence[str] = (), job_ids: Sequence[str] = ()) -> list[Attempt]:
    """Every attempt of these runs and of these jobs' runs, by run and attempt."""
    rows = await pool.fetch(
        """SELECT run_id::text, id::text, attempt, status, worker_id, started_at, finished_at FROM job_executions
           WHERE run_id = ANY($1::uuid[]) OR job_id = ANY($2::uuid[]) ORDER BY run_id, attempt""",
        list(run_ids),
        list(job_ids),
    )
    return [Attempt(*row) for row in rows]


def _by_run(attempts: Iterable[Attempt]) -> dict[str, list[Attempt]]:
    runs: dict[str, list[Attempt]] = {}
    for attempt in attempts:
        runs.setdefault(attempt.run_id, []).append(attempt)
    for history in runs.values():
        history.sort(key=lambda a: a.attempt)
    return runs


def _history(attempts: Sequence[Attempt]) -> str:
    return ", ".join(str(a) for a in attempts)


def not_exactly_once(attempts: Iterable[Attempt], run_ids: Iterable[str]) -> list[str]:
    """The runs among `run_ids` without exactly one `succeeded` attempt (none recorded at all counts)."""
    runs = _by_run(attempts)
    found = []
    for run_id in run_ids:
        history = runs.get(run_id, [])
        if sum(a.status == FINAL_OK for a in history) != 1:
            found.append(f"run {run_id[-12:]}: {_history(history) or 'no attempt'}")
    return found


def spent_unacknowledged(attempts: Iterable[Attempt], unacknowledged: Iterable[str]) -> list[str]:
    """Assignments (execution ids) a remote worker never acknowledged must go back unspent: the run
    is claimed again as that same attempt, so that execution stays its run's only attempt, whatever
    it ended as. A later attempt of the run (the unacknowledged one recorded interrupted, abandoned,
    failed ...), or the execution gone, spent one.
    """
    attempts = list(attempts)
    runs = _by_run(attempts)
    by_id = {a.execution_id: a for a in attempts}
    found = []
    for execution_id in unacknowledged:
        assigned = by_id.get(execution_id)
        if assigned is None:
            found.append(f"assignment {execution_id[-12:]}: no such attempt")
            continue
        history = runs[assigned.run_id]
        if [a.execution_id for a in history] != [execution_id]:
            found.append(f"run {assigned.run_id[-12:]}: assignment #{assigned.attempt} never acknowledged, "
                         f"yet attempts {_history(history)}")  # fmt: skip
    return found


def overdue_running(
    attempts: Iterable[Attempt], *, allowed: timedelta, cutoff: datetime, since: datetime | None = None
) -> list[str]:
    """Attempts `running` for longer than `allowed`: from their start, or from `since` (the fault)
    when that is later, to their end (`cutoff`, the check's instant, if they have none yet).

    `allowed` is what the scenario's handler may take plus its worker's lease plus the visibility
    timeout (issue 23: "no run stays `running` past its lease plus the visibility timeout"): a
    worker gone silent keeps its lease at most that long, and the attempt must be ended (recorded,
    or taken over) one visibility timeout after. An attempt never started (`queued`, or handed back
    unspent) has no start and is not counted.
    """
    found = []
    for attempt in attempts:
        if attempt.started_at is None:
            continue
        began = attempt.started_at if since is None else max(attempt.started_at, since)
        end = attempt.finished_at or cutoff
        if end - began > allowed:
            still = "still running" if attempt.finished_at is None else f"{attempt.status} after"
            found.append(f"run {attempt.run_id[-12:]} #{attempt.attempt} {still} {(end - began).total_seconds():.1f}s "
                         f"(allowed {allowed.total_seconds():g}s)")  # fmt: skip
    return found


def succeeded_on(attempts: Iterable[Attempt], worker_ids: Iterable[str]) -> list[str]:
    """Successes recorded for workers the suite killed (their runs had to succeed elsewhere)."""
    dead = set(worker_ids)
    return [f"run {a.run_id[-12:]} #{a.attempt} on {a.worker_id}" for a in attempts
            if a.status == FINAL_OK and a.worker_id in dead]  # fmt: skip
