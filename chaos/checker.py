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
  stale term.

Recovery: for each fault instant, the time until the next slot fired (or until given runs finished).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    """

    label: str
    at: datetime
    after_term: int | None = None
    run_ids: tuple[str, ...] = ()


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
    """Seconds from `mark.at` to the next slot fired (or until `mark.run_ids` all succeeded)."""
    if mark.run_ids:
        row = await pool.fetchrow(
            """SELECT count(DISTINCT run_id) AS done, max(finished_at) AS last FROM job_executions
               WHERE run_id = ANY($1::uuid[]) AND status = 'succeeded'""",
            list(mark.run_ids),
        )
        if row is None or row["done"] < len(set(mark.run_ids)):
            return None
        return max(0.0, float((row["last"] - mark.at).total_seconds()))
    first = await pool.fetchval(
        """SELECT min(created_at) FROM job_executions
           WHERE trigger = 'schedule' AND created_at > $1 AND ($2::bigint IS NULL OR term > $2)""",
        mark.at,
        mark.after_term,
    )
    return None if first is None else (first - mark.at).total_seconds()
