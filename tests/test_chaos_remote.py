"""The chaos checker's remote-worker rules (issue 23): each passes a good history and fails a crafted
bad one, and `attempts_of` reads planted attempts back from PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import orjson
import pytest
from scheduler_client.v1 import workers_pb2

from chaos.checker import (
    Attempt,
    attempts_of,
    not_exactly_once,
    overdue_running,
    spent_unacknowledged,
    succeeded_on,
)
from chaos.remote_worker import AckFilter
from scheduler_grpc.control import Control
from scheduler_grpc.jobs import JobSpec

T0 = datetime(2030, 1, 1, tzinfo=UTC)
DEAD = "remote:127.0.0.1:dead0001"
ELSEWHERE = "remote:127.0.0.1:alive002"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def attempt(run: str, number: int, status: str, *, start: float | None = 0, end: float | None = 1,
            worker: str | None = ELSEWHERE, execution: str = "") -> Attempt:  # fmt: skip
    return Attempt(run, execution or f"{run}-{number}", number, status, worker,
                   None if start is None else at(start), None if end is None else at(end))  # fmt: skip


def test_every_run_must_succeed_exactly_once() -> None:
    history = [
        attempt("once", 1, "succeeded"),
        attempt("retried", 1, "interrupted", worker=DEAD),
        attempt("retried", 2, "succeeded"),
        attempt("twice", 1, "succeeded", worker=DEAD),
        attempt("twice", 2, "succeeded"),
        attempt("never", 1, "queued", start=None, end=None),
    ]
    found = not_exactly_once(history, ["once", "retried", "twice", "never", "lost"])
    assert found == ["run twice: #1 succeeded, #2 succeeded", "run never: #1 queued", "run lost: no attempt"]


def test_an_unacknowledged_assignment_must_come_back_as_the_same_attempt() -> None:
    history = [
        # Handed back unspent: the same execution claimed again elsewhere and succeeded.
        attempt("unspent", 1, "succeeded", execution="e-unspent"),
        # Recorded interrupted like an acknowledged one: the retry spent an attempt.
        attempt("spent", 1, "interrupted", worker=DEAD, execution="e-spent"),
        attempt("spent", 2, "succeeded"),
        # Still waiting in the queue, unspent (the stuck check reports it, not this rule).
        attempt("waiting", 1, "queued", start=None, end=None, execution="e-waiting"),
    ]
    found = spent_unacknowledged(history, ["e-unspent", "e-spent", "e-waiting", "e-gone"])
    assert found == [
        "run spent: assignment #1 never acknowledged, yet attempts #1 interrupted, #2 succeeded",
        "assignment e-gone: no such attempt",
    ]


def test_no_attempt_may_stay_running_past_its_lease_plus_the_visibility_timeout() -> None:
    allowed = timedelta(seconds=11)  # a 1 s handler, a 5 s lease, a 5 s visibility timeout
    history = [
        attempt("normal", 1, "succeeded", start=0, end=1.02),
        attempt("interrupted", 1, "interrupted", start=0, end=3.0),  # the stream's end, at once
        attempt("parked", 1, "abandoned", start=0, end=10.9),  # parked until its lease, then recovered
        attempt("kept", 1, "succeeded", start=0, end=30.4),  # a silent stream kept alive (Hatchet #3280)
        attempt("open", 1, "running", start=5, end=None),  # never ended: until the check's instant
        attempt("queued", 1, "queued", start=None, end=None),  # handed back unspent: not started
    ]
    found = overdue_running(history, allowed=allowed, cutoff=at(40))
    assert found == [
        "run kept #1 succeeded after 30.4s (allowed 11s)",
        "run open #1 still running 35.0s (allowed 11s)",
    ]
    # Counted from the fault when the attempt was running before it (a worker killed at 100 s that
    # held its runs for 100 s): its attempts must end within the allowance of the kill.
    held = [attempt("held", 1, "interrupted", start=0, end=100.2), attempt("late", 1, "abandoned", start=0, end=111)]
    assert overdue_running(held, allowed=timedelta(seconds=10), cutoff=at(200), since=at(100)) == [
        "run late #1 abandoned after 11.0s (allowed 10s)"
    ]


def test_no_run_may_succeed_on_a_killed_worker() -> None:
    history = [
        attempt("elsewhere", 1, "interrupted", worker=DEAD),
        attempt("elsewhere", 2, "succeeded"),
        attempt("on-dead", 1, "succeeded", worker=DEAD),
    ]
    assert succeeded_on(history, [DEAD]) == [f"run on-dead #1 on {DEAD}"]


async def test_attempts_of_reads_runs_and_jobs_from_postgresql(pool: asyncpg.Pool, control: Control) -> None:
    job = await control.create_job(JobSpec(name="remote-planted", handler="test.echo"))
    other = await control.create_job(JobSpec(name="remote-other", handler="test.echo"))
    run, lone = uuid.uuid4(), uuid.uuid4()
    retry = uuid.uuid4()
    rows = [
        (run, run, job.id, 1, "interrupted", DEAD, at(0), at(3)),
        (retry, run, job.id, 2, "succeeded", ELSEWHERE, at(4), at(5)),
        (lone, lone, other.id, 1, "queued", None, None, None),
    ]
    for row_id, run_id, job_id, number, status, worker, started, finished in rows:
        await pool.execute(
            """INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, worker_id,
                   started_at, finished_at)
               VALUES ($1, $2, $3, $4, $5, $6, 'manual', $7, $8, $9)""",
            row_id, run_id, uuid.UUID(job_id), T0, number, status, worker, started, finished,
        )  # fmt: skip
    by_job = await attempts_of(pool, job_ids=[job.id])
    assert [(a.run_id, a.execution_id, a.attempt, a.status, a.worker_id) for a in by_job] == [
        (str(run), str(run), 1, "interrupted", DEAD),
        (str(run), str(retry), 2, "succeeded", ELSEWHERE),
    ]
    assert (by_job[0].started_at, by_job[0].finished_at) == (at(0), at(3))
    both = await attempts_of(pool, run_ids=[str(lone)], job_ids=[job.id])
    assert len(both) == 3
    assert not_exactly_once(both, [str(run)]) == []
    assert not_exactly_once(both, [str(lone)]) == [f"run {str(lone)[-12:]}: #1 queued"]


async def test_the_ack_filter_withholds_every_ack_after_the_first_ones(capsys: pytest.CaptureFixture[str]) -> None:
    """What makes `remote-kill9`'s unacknowledged assignments: acks dropped on the wire, alone or
    inside a batch, everything else untouched."""

    def ack(execution_id: str) -> workers_pb2.Ack:
        return workers_pb2.Ack(execution_id=execution_id, claim_token="t")

    async def requests() -> AsyncIterator[workers_pb2.ConnectRequest]:
        yield workers_pb2.ConnectRequest(hello=workers_pb2.Hello(slots=4))
        yield workers_pb2.ConnectRequest(ack=ack("a"))
        yield workers_pb2.ConnectRequest(batch=workers_pb2.RequestBatch(acks=[ack("b"), ack("c")], credit=1))
        yield workers_pb2.ConnectRequest(ack=ack("d"))
        yield workers_pb2.ConnectRequest(batch=workers_pb2.RequestBatch(acks=[ack("e")]))
        yield workers_pb2.ConnectRequest(outcome=workers_pb2.Outcome(execution_id="a", claim_token="t"))

    sent = [request async for request in AckFilter(2)._filter(requests())]
    assert [request.WhichOneof("message") for request in sent] == ["hello", "ack", "batch", "outcome"]
    assert sent[1].ack.execution_id == "a"
    assert ([a.execution_id for a in sent[2].batch.acks], sent[2].batch.credit) == (["b"], 1)
    withheld = [line for line in capsys.readouterr().out.splitlines() if '"withheld"' in line]
    assert [orjson.loads(line)["execution_id"] for line in withheld] == ["c", "d", "e"]
