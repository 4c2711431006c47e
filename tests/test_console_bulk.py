"""The console's bulk actions, searches, charts and flash messages over HTTP, against a real
in-process server (real Redis and PostgreSQL). The browser side is in test_console_habits_browser."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
from redis.asyncio import Redis

from scheduler_grpc.auth import Role
from scheduler_grpc.console import humane
from scheduler_grpc.console.flash import COOKIE as FLASH_COOKIE
from scheduler_grpc.console.security import csrf_token
from scheduler_grpc.executions import ExecutionStatus
from scheduler_grpc.jobs import JobSpec, JobStatus, ScheduleKind
from tests.test_console import Console, _with_cookie, console  # noqa: F401 - `console` is a fixture


async def _manual(console: Console, name: str, handler: str = "test.echo") -> str:  # noqa: F811
    job = await console.server.api.control.create_job(
        JobSpec(name=name, handler=handler, schedule_kind=ScheduleKind.MANUAL)
    )
    return job.id


async def test_bulk_cancel_by_filter_confirms_the_count_then_cancels(console: Console) -> None:  # noqa: F811
    control = console.server.api.control
    target = await _manual(console, "bulk-nightly")
    other = await _manual(console, "bulk-hourly")
    runs = [(await control.trigger_job(target))[0].run_id for _ in range(12)]
    await control.trigger_job(other)
    token = await console.session_for("olivia", Role.OPERATOR)
    async with console.client() as http:
        _with_cookie(http, token)
        form = {
            "csrf": csrf_token(token),
            "action": "cancel",
            "scope": "filter",
            "filter": "job_name=NIGHTLY&state=queued",
            "back": "/executions?job_name=nightly",
        }
        async with http.post("/executions/bulk", data=form) as page:
            assert page.status == 200
            body = await page.text()
        assert re.search(r"Cancel the runs of 12 executions matching job name contains &#39;NIGHTLY&#39;", body)
        assert {e.status for e in await control._history.history(target)} == {ExecutionStatus.QUEUED}
        pinned = re.search(r'name="filter" value="([^"]*)"', body)
        assert pinned is not None
        assert "until=" in pinned.group(1), "the confirmed filter is pinned to the count"
        confirm = {**form, "confirm": "1", "filter": pinned.group(1).replace("&amp;", "&")}
        async with http.post("/executions/bulk", data=confirm, allow_redirects=False) as reply:
            assert reply.status == 303
            assert reply.headers["Location"] == "/executions?job_name=nightly"
            assert FLASH_COOKIE in reply.cookies
        async with http.get("/executions?job_name=nightly") as page:
            body = await page.text()
        assert '<p class="flash" role="status" id="flash">12 runs cancelled</p>' in body
        async with http.get("/executions?job_name=nightly") as page:
            assert 'id="flash"' not in await page.text(), "a flash is shown once"
    assert {e.status for e in await control._history.history(target)} == {ExecutionStatus.CANCELLED}
    assert {e.run_id for e in await control._history.history(target)} == set(runs)
    assert {e.status for e in await control._history.history(other)} == {ExecutionStatus.QUEUED}


async def test_bulk_actions_are_role_checked(console: Console) -> None:  # noqa: F811
    job = await _manual(console, "guarded")
    viewer = await console.session_for("victor", Role.VIEWER)
    operator = await console.session_for("olivia", Role.OPERATOR)
    async with console.client() as http:
        _with_cookie(http, viewer)
        async with http.get("/executions") as page:
            assert 'id="bulk-form"' not in await page.text()
        data = {"csrf": csrf_token(viewer), "action": "cancel", "scope": "filter", "filter": "", "confirm": "1"}
        async with http.post("/executions/bulk", data=data) as reply:
            assert reply.status == 403
        _with_cookie(http, operator)
        async with http.get("/jobs") as page:
            body = await page.text()
        assert 'value="pause"' in body
        assert 'value="delete"' not in body
        data = {"csrf": csrf_token(operator), "action": "delete", "scope": "selected", "id": job, "confirm": "1"}
        async with http.post("/jobs/bulk", data=data) as reply:
            assert reply.status == 403
            assert "BatchDeleteJobs" in await reply.text()
        data = {"csrf": csrf_token(operator), "action": "pause", "scope": "selected", "id": job, "confirm": "1"}
        async with http.post("/jobs/bulk", data=data, allow_redirects=False) as reply:
            assert reply.status == 303
    assert (await console.server.api.control._jobs.get(job)).status is JobStatus.PAUSED


async def test_executions_search_by_job_name_and_error_text(console: Console, pool: asyncpg.Pool) -> None:  # noqa: F811
    control = console.server.api.control
    export = await _manual(console, "search-export")
    other = await _manual(console, "search-import")
    failed = (await control.trigger_job(export))[0].run_id
    await control.trigger_job(export)
    await control.trigger_job(other)
    await pool.execute(
        "UPDATE job_executions SET status = 'failed', started_at = now(), worker_id = 'w', finished_at = now(),"
        " error = 'Disk FULL on /var'"
        " WHERE id = $1",
        uuid.UUID(failed),
    )
    async with console.client() as http:
        _with_cookie(http, await console.session_for("victor", Role.VIEWER))
        async with http.get("/executions", params={"job_name": "EXPORT"}) as page:
            body = await page.text()
        assert body.count('data-execution="') == 2
        assert "search-import" not in body
        async with http.get("/executions", params={"job_name": "export", "error": "disk full"}) as page:
            body = await page.text()
        assert re.findall(r'data-execution="([^"]+)"', body) == [failed]
        async with http.get("/executions", params={"job_name": "no-such-job"}) as page:
            assert 'id="no-executions"' in await page.text()


async def test_dead_letters_show_job_handler_error_and_age_and_search(
    console: Console,  # noqa: F811
    redis: Redis,
) -> None:
    control = console.server.api.control
    job = await _manual(console, "dlq-billing")
    other = await _manual(console, "dlq-reports")
    runs = [(await control.trigger_job(job))[0].run_id for _ in range(2)]
    other_run = (await control.trigger_job(other))[0].run_id
    await control._recovery.mark_runs_dead([*runs, other_run], "card declined: insufficient funds")
    queue = control._queues.get("default")
    for lease in await queue.dequeue("test-worker", timedelta(seconds=30), count=10):
        await queue.dead_letter(lease.id, lease.token, "card declined")
    async with console.client() as http:
        _with_cookie(http, await console.session_for("olivia", Role.OPERATOR))
        async with http.get("/dead-letters") as page:
            body = await page.text()
        assert "dlq-billing" in body
        assert "dlq-reports" in body
        assert "test.echo" in body
        assert "<time datetime=" in body
        async with http.get("/dead-letters", params={"job_name": "billing", "error": "INSUFFICIENT"}) as page:
            body = await page.text()
        assert sorted(re.findall(r'<tr data-run="([^"]+)"', body)) == sorted(runs)
        assert 'id="requeue-matching"' in body
        requeue = re.search(r'id="dead-bulk">(.*?)</form>', body, re.S)
        assert requeue is not None
        fields = dict(re.findall(r'name="([^"]+)" value="([^"]*)"', requeue.group(1)))
        fields = {k: v.replace("&amp;", "&") for k, v in fields.items()}
        async with http.post("/executions/bulk", data={**fields, "confirm": "1"}, allow_redirects=False) as reply:
            assert reply.status == 303
    assert (await queue.stats()).dead == 1
    assert [item.id for item in (await queue.list_dead()).items] == [other_run]


async def test_charts_page_draws_outcomes_lateness_and_sampled_depth(console: Console, pool: asyncpg.Pool) -> None:  # noqa: F811
    control = console.server.api.control
    job = await _manual(console, "charted")
    run = (await control.trigger_job(job))[0].run_id
    await pool.execute(
        """UPDATE job_executions SET status = 'succeeded', trigger = 'schedule', started_at = now(), worker_id = 'w',
                  scheduled_for = now() - interval '2 seconds', finished_at = now() WHERE id = $1""",
        uuid.UUID(run),
    )
    await control.trigger_job(job)
    assert await control.sample_queue_depths(datetime.now(UTC).timestamp() + 120)
    async with console.client() as http:
        _with_cookie(http, await console.session_for("victor", Role.VIEWER))
        for window in ("hour", "day"):
            async with http.get("/charts", params={"window": window, "queue": "default"}) as page:
                assert page.status == 200
                body = await page.text()
            assert 'id="chart-outcomes"' in body
            assert "succeeded: 1" in body
            assert "p50: 2.00 s" in body
            assert "ready: 2" in body  # both runs are in Redis (the first was finished in PostgreSQL only)
            assert '<text class="tick"' in body
        async with http.get("/charts", params={"window": "week"}) as page:
            assert page.status == 400
            assert "window" in await page.text()
        async with http.get(f"/jobs/{job}") as page:
            body = await page.text()
        assert 'id="run-times"' in body
        assert "attempt 1:" in body


def test_one_duration_format_and_relative_times() -> None:
    assert [humane.duration(s) for s in (0.34, 4.2, 42, 192, 7500, 273600)] == [
        "340 ms",
        "4.20 s",
        "42.0 s",
        "3 min 12 s",
        "2 h 5 min",
        "3 d 4 h",
    ]
    assert humane.duration(None) == "—"
    now = datetime(2026, 5, 1, 9, 0, tzinfo=UTC)
    assert humane.relative_text(now - timedelta(minutes=3, seconds=5), now) == "3 min ago"
    assert humane.relative_text(now + timedelta(seconds=20), now) == "in 20 s"
    element = humane.relative(now - timedelta(hours=2), now)
    assert element == ('<time datetime="2026-05-01T07:00:00+00:00" title="2026-05-01 07:00:00 UTC">2 h ago</time>')
