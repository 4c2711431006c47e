"""The console's Limits page over HTTP (issue 22): limits with their busiest keys, a key's state,
pause/resume with CSRF and the API's roles (viewers read, operators pause), and the blocked reason
on the executions list and the execution page.

Key state is made directly through `Queue` (a definition, runs with limit keys, a lease), so these
tests do not depend on how runs get their limit keys when they are fired."""

from __future__ import annotations

import html
import uuid
from datetime import timedelta

import asyncpg
from redis.asyncio import Redis

from scheduler_grpc.auth import Role
from scheduler_grpc.console.security import csrf_token
from scheduler_grpc.gcra import LimitDefinition, LimitKey
from scheduler_grpc.jobs import JobSpec
from scheduler_grpc.limits import LimitKind, LimitRef, LimitSpec, Override
from scheduler_grpc.queue import NewItem, Queue, key_counts
from tests.test_console import Console, _with_cookie, console  # noqa: F401 - `console` is a fixture

VT = timedelta(seconds=60)
QUEUE = "limq"
PAUSE = 'action="/limits/pause"'
RESUME = 'action="/limits/resume"'


async def busy_key(console: Console, redis: Redis) -> tuple[Queue, str]:  # noqa: F811
    """Limit `per-customer` (concurrency 1, override acme=3) named by a job on QUEUE; key `c1`
    holds its unit and has one run waiting. Returns the queue and the job's id."""
    control = console.server.api.control
    await control.limits.create_limit(
        LimitSpec("per-customer", LimitKind.CONCURRENCY, 1, overrides={"acme": Override(3)})
    )
    job = await control.create_job(
        JobSpec(
            name="sync",
            handler="test.echo",
            queue=QUEUE,
            payload={"customer_id": "c1"},
            limits=(LimitRef("per-customer", "payload.customer_id"),),
        )
    )
    queue = Queue(redis, QUEUE)
    await queue.put_limit_definitions([LimitDefinition("per-customer", "concurrency", 1)])
    await queue.enqueue_many([NewItem(f"run-{n}", limits=(LimitKey("per-customer", "c1"),)) for n in range(2)])
    assert [lease.id for lease in await queue.dequeue("w", VT, 2)] == ["run-0"]
    return queue, job.id


async def test_the_limits_page_shows_limits_and_busiest_keys(console: Console, redis: Redis) -> None:  # noqa: F811
    await busy_key(console, redis)
    token = await console.session_for("vic", Role.VIEWER)
    async with console.client() as http:
        _with_cookie(http, token)
        async with http.get("/") as page:
            assert 'href="/limits"' in await page.text()
        async with http.get("/limits") as page:
            assert page.status == 200
            body = await page.text()
        assert 'data-limit="per-customer"' in body
        assert "1 at once per key" in body
        assert "<code>acme</code>=3" in body
        assert 'data-key="c1"' in body
        row = body.split('data-key="c1"', 1)[1].split("</tr>", 1)[0]
        assert "<td>limq</td><td>1</td><td>1</td>" in row  # queue, running units, queued runs
        # A viewer sees no pause or resume buttons; a forged POST (even with a valid CSRF token) is 403.
        assert PAUSE not in body
        assert RESUME not in body
        for action in ("/limits/pause", "/limits/resume"):
            form = {"csrf": csrf_token(token), "limit": "per-customer", "key": "c1", "duration": "5m"}
            async with http.post(action, data=form, allow_redirects=False) as reply:
                assert reply.status == 403, action
    state = await console.server.api.control.limit_keys.key_state("per-customer", "c1")
    assert state.queues[0].state.paused_until is None


async def test_an_operator_pauses_and_resumes_a_key_with_csrf(console: Console, redis: Redis) -> None:  # noqa: F811
    await busy_key(console, redis)
    keys = console.server.api.control.limit_keys
    token = await console.session_for("olive", Role.OPERATOR)
    async with console.client() as http:
        _with_cookie(http, token)
        async with http.get("/limits") as page:
            body = await page.text()
        assert PAUSE in body
        assert RESUME in body
        form = {"limit": "per-customer", "key": "c1", "queue": QUEUE, "duration": "10m"}
        async with http.post("/limits/pause", data=form, allow_redirects=False) as reply:
            assert reply.status == 403  # no CSRF token
        assert (await keys.key_state("per-customer", "c1")).queues[0].state.paused_until is None
        async with http.post("/limits/pause", data={**form, "csrf": csrf_token(token)}, allow_redirects=False) as reply:
            assert reply.status == 303
            assert reply.headers["Location"].startswith("/limits?limit=per-customer&key=c1&queue=limq")
        paused = (await keys.key_state("per-customer", "c1")).queues[0].state.paused_until
        assert paused is not None
        # The page it returns to shows the key, paused, and says what was done.
        async with http.post("/limits/pause", data={**form, "csrf": csrf_token(token)}) as page:
            body = html.unescape(await page.text())
        assert "Paused key c1 of per-customer for 10m on limq" in body
        assert 'id="key-state"' in body
        assert paused.strftime("%Y-%m-%d %H:%M") in body
        # Bad input is refused naming the field, and changes nothing.
        async with http.post("/limits/pause", data={**form, "csrf": csrf_token(token), "duration": "soon"}) as reply:
            assert reply.status == 400
            assert "duration" in await reply.text()
        async with http.post("/limits/pause", data={**form, "csrf": csrf_token(token), "limit": "nope"}) as reply:
            assert reply.status == 404
        async with http.post("/limits/resume", data={**form, "csrf": csrf_token(token)}) as page:
            assert "Resumed key c1 of per-customer on limq" in html.unescape(await page.text())
    assert (await keys.key_state("per-customer", "c1")).queues[0].state.paused_until is None


async def test_executions_show_the_key_they_wait_for(
    console: Console,  # noqa: F811
    redis: Redis,
    pool: asyncpg.Pool,
) -> None:
    queue, job_id = await busy_key(console, redis)
    control = console.server.api.control
    execution = await control.trigger_execution(job_id)  # no worker: it stays queued
    await pool.execute(
        "UPDATE job_executions SET limit_keys = $2 WHERE id = $1", uuid.UUID(execution.id), [["per-customer", "c1", 1]]
    )
    await queue.remove_many([execution.run_id])
    await queue.enqueue_many([NewItem(execution.run_id, limits=(LimitKey("per-customer", "c1"),))])
    assert list(await queue.dequeue("w", VT, 1)) == []  # its group is found blocked and parked
    token = await console.session_for("vic", Role.VIEWER)
    async with console.client() as http:
        _with_cookie(http, token)
        async with http.get("/executions") as page:
            body = await page.text()
        row = body.split(f'data-execution="{execution.id}"', 1)[1].split("</tr>", 1)[0]
        assert "waits for per-customer <code>c1</code> (concurrency)" in row
        async with http.get(f"/executions/{execution.id}") as page:
            body = await page.text()
        assert 'id="blocked-by"' in body
        assert "key <code>c1</code> (concurrency)" in body


async def test_key_counts_read_at_most_about_their_bound(redis: Redis) -> None:
    queue = Queue(redis, QUEUE)
    await queue.put_limit_definitions(
        [LimitDefinition("many", "concurrency", 1), LimitDefinition("other", "concurrency", 1)]
    )
    await queue.enqueue_many([NewItem(f"m{n}", limits=(LimitKey("many", f"k{n}"),)) for n in range(1500)])
    await queue.enqueue_many([NewItem("o", limits=(LimitKey("other", "x"),))])
    whole = await key_counts(queue, ["many"], max_fields=10_000)
    assert whole.complete
    assert len(whole.counts) == 1500  # only the limits asked for
    assert whole.counts["many", "k7"] == (0, 1)
    part = await key_counts(queue, ["many", "other"], max_fields=500)
    assert not part.complete
    assert 0 < len(part.counts) < 1501
