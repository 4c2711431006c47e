"""The chaos checker's cap logic (issue 22): which instants a key is held beyond its cap, which end a
killed worker's attempt gets, and the reading of planted attempts from PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos.checker import LEASE_RESOLUTION, Hold, Kill, attempt_end, cap_breaches, check_caps, worker_pid
from scheduler_grpc.control import Control
from scheduler_grpc.jobs import JobSpec
from scheduler_grpc.limits import LimitKind, LimitRef, LimitSpec

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def at(ms: int) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def hold(start: int, end: int, *, key: str = "k", units: int = 1, label: str = "") -> Hold:
    return Hold("per-customer", key, units, at(start), at(end), label or f"{start}-{end}")


def test_back_to_back_attempts_do_not_overlap_but_one_millisecond_does() -> None:
    assert cap_breaches([hold(0, 100), hold(100, 200), hold(200, 300)], lambda _l, _k: 1) == []
    breaches = cap_breaches([hold(0, 100), hold(99, 200)], lambda _l, _k: 1)
    assert [(b.at, b.held, b.cap, b.attempts) for b in breaches] == [(at(99), 2, 1, ("0-100", "99-200"))]


def test_keys_are_counted_apart_and_uncapped_keys_are_not_checked() -> None:
    holds = [hold(0, 100, key="a"), hold(50, 150, key="b"), hold(0, 100, key="r"), hold(10, 20, key="r")]
    caps = {"a": 1, "b": 1, "r": None}
    assert cap_breaches(holds, lambda _limit, key: caps[key]) == []


def test_one_breach_per_stretch_over_the_cap() -> None:
    # Four attempts of one key started at once (one claim batch), then a second stretch later.
    holds = [hold(0, 100, label=str(i)) for i in range(4)] + [hold(500, 600, label="x"), hold(550, 650, label="y")]
    breaches = cap_breaches(holds, lambda _l, _k: 1)
    assert [(b.at, b.held, b.attempts) for b in breaches] == [
        (at(0), 4, ("0", "1", "2", "3")),
        (at(550), 2, ("x", "y")),
    ]


def test_units_and_caps_above_one() -> None:
    # cap 3: two 1-unit holds and a 2-unit one overlap in [50, 60) only.
    holds = [hold(0, 60), hold(10, 100), hold(50, 70, units=2, label="big")]
    breaches = cap_breaches(holds, lambda _l, _k: 3)
    assert [(b.at, b.held) for b in breaches] == [(at(50), 4)]
    assert cap_breaches(holds, lambda _l, _k: 4) == []


def test_an_empty_interval_holds_nothing() -> None:
    # A reserved attempt taken over before its start is recorded with start = end.
    assert cap_breaches([hold(0, 100), hold(50, 50), hold(70, 60)], lambda _l, _k: 1) == []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20), st.integers(1, 3)), max_size=12),
    st.integers(1, 4),
)
def test_sweep_agrees_with_brute_force(spans: list[tuple[int, int, int]], cap: int) -> None:
    holds = [hold(start, start + length, units=units, label=str(i)) for i, (start, length, units) in
             enumerate(spans)]  # fmt: skip
    # Brute force: at every start instant, the units of every hold containing it (half-open).
    over = any(
        sum(h.units for h in holds if h.start <= probe.start < h.end) > cap
        for probe in holds
        if probe.start < probe.end
    )
    assert bool(cap_breaches(holds, lambda _l, _k: cap)) == over


def test_worker_pid_from_a_worker_id() -> None:
    assert worker_pid("host-a:4242:abc") == 4242
    assert worker_pid("host:with:colons:77:xyz") == 77
    assert worker_pid("nonsense") is None
    assert worker_pid(None) is None


def test_a_killed_workers_attempt_ends_at_its_kill_not_at_its_takeover() -> None:
    # The pid reused by a later process (spawned at 550), killed again.
    kills = [Kill(4242, at(0), at(500)), Kill(4242, at(550), at(9000))]
    cutoff = at(20_000)
    # Taken over (recorded abandoned) long after the kill: it stopped running at the kill.
    assert attempt_end(at(100), at(4000), "h:4242:a", kills, cutoff) == at(500)
    # Finished by its worker before the kill: its own record.
    assert attempt_end(at(100), at(300), "h:4242:a", kills, cutoff) == at(300)
    # Started in the later process with the same pid: its own kill counts.
    assert attempt_end(at(600), at(9500), "h:4242:b", kills, cutoff) == at(9000)
    # Another worker, never killed, never finished: open until the cut-off.
    assert attempt_end(at(100), None, "h:77:c", kills, cutoff) == cutoff
    # The next attempt of the key starting after the kill but before the takeover is no overlap.
    first = Hold("l", "k", 1, at(100), attempt_end(at(100), at(4000), "h:4242:a", kills, cutoff), "killed")
    second = Hold("l", "k", 1, at(3500), at(3600), "next")
    assert cap_breaches([first, second], lambda _l, _k: 1) == []


def test_a_claim_that_reached_postgresql_after_its_workers_kill_holds_nothing() -> None:
    """The claim's statement was sent before the kill and executed after it (a fresh clone's
    `make chaos` saw started_at 2 ms after the reap): that process ran no handler, so the attempt,
    taken over later, overlaps nothing (before: it held the key until its takeover, a false
    breach with the key's next run)."""
    kills = [Kill(4242, at(0), at(500)), Kill(4242, at(550), at(9000))]
    late = attempt_end(at(502), at(4000), "h:4242:a", kills, at(20_000))
    assert late == at(500)
    first = Hold("l", "k", 1, at(502), late, "claimed-after-kill")
    second = Hold("l", "k", 1, at(3500), at(3600), "next")
    assert cap_breaches([first, second], lambda _l, _k: 1) == []


async def test_check_caps_reads_planted_attempts(pool: asyncpg.Pool, control: Control) -> None:
    limit = await control.limits.create_limit(LimitSpec("per-customer", LimitKind.CONCURRENCY, 1, overrides={}))
    assert limit.name == "per-customer"
    job = await control.create_job(JobSpec(
        name="capped", handler="test.echo", payload={"customer_id": "acme"},
        limits=(LimitRef("per-customer", "payload.customer_id"),)))  # fmt: skip
    other = await control.create_job(JobSpec(
        name="capped-const", handler="test.echo", limits=(LimitRef("per-customer", "acme"),)))  # fmt: skip
    free = await control.create_job(JobSpec(name="free", handler="test.echo"))

    async def attempt(job_id: str, start: int, end: int | None, worker: str = "h:1:x") -> None:
        row_id = uuid.uuid4()
        await pool.execute(
            """INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger,
                   worker_id, started_at, finished_at, claim_token)
               VALUES ($1, $1, $2, $3, 1, $4, 'manual', $5, $3, $6, 'token')""",
            row_id, uuid.UUID(job_id), at(start), "running" if end is None else "succeeded", worker,
            None if end is None else at(end),
        )  # fmt: skip

    await attempt(job.id, 0, 100)
    await attempt(other.id, 100, 200)  # the same key through a constant template: back to back
    await attempt(free.id, 0, 1000)  # no limits: not counted
    await attempt(free.id, 1, 1000)
    report = await check_caps(pool, cutoff=at(10_000))
    assert (report.keys, report.holds, report.breaches) == (1, 2, [])
    # A start stamped by its lease in whole milliseconds may read up to 1 ms before the previous
    # holder's finish (recorded to the microsecond): a hand-off, not an overlap.
    await attempt(job.id, 200, 300)
    await pool.execute(
        "UPDATE job_executions SET finished_at = finished_at + interval '700 microseconds' WHERE started_at = $1",
        at(100),
    )
    report = await check_caps(pool, cutoff=at(10_000))
    assert (report.holds, report.breaches) == (3, [])
    await pool.execute("DELETE FROM job_executions WHERE started_at = $1", at(200))
    # A killed worker's attempt, taken over at 5000, ended at its kill (300): no overlap with 400..
    await attempt(job.id, 250, 5000, worker="h:4242:k")
    await attempt(other.id, 400, 500)
    report = await check_caps(pool, kills=[Kill(4242, at(0), at(300))], cutoff=at(10_000))
    assert report.breaches == [], report.breaches
    # ... but without the kill it would be one, and an attempt still open runs until the cut-off.
    assert len((await check_caps(pool, cutoff=at(10_000))).breaches) == 1
    await attempt(other.id, 600, None)
    await attempt(job.id, 9000, 9100)
    report = await check_caps(pool, kills=[Kill(4242, at(0), at(300))], cutoff=at(10_000))
    # Reported at the counted start: the recorded one plus the lease stamp's resolution.
    assert [(b.key, b.at) for b in report.breaches] == [("acme", at(9000) + LEASE_RESOLUTION)]
    assert "no attempt recorded its limit keys" in report.notes[0]
    # Keys the run recorded are compared with the ones its payload gives.
    await pool.execute(
        """UPDATE job_executions SET limit_keys = '[["per-customer", "other", 1]]'
           WHERE job_id = $1 AND started_at = $2""",
        uuid.UUID(job.id),
        at(0),
    )
    report = await check_caps(pool, kills=[Kill(4242, at(0), at(300))], cutoff=at(10_000))
    assert len(report.wrong_keys) == 1
    assert "expected [('per-customer', 'acme', 1)]" in report.wrong_keys[0]
