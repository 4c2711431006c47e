"""The web console's HTTP rules against a real in-process server (real Redis and PostgreSQL):
session cookie flags, CSRF, the API's role table, logout, login throttling, field errors, the
schedule preview and the live event stream's resume."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import ssl
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import aiohttp
import asyncpg
import grpc
import pytest
from redis.asyncio import Redis
from redis.exceptions import ReadOnlyError
from scheduler_client.v1 import auth_pb2, auth_pb2_grpc, jobs_pb2, jobs_pb2_grpc

from scheduler_grpc.auth import Role, Unauthenticated
from scheduler_grpc.connections import redis_client
from scheduler_grpc.console.app import listen_host
from scheduler_grpc.console.security import COOKIE, CSP, LOGIN_COOKIE, LOGIN_FIELD, csrf_token
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.db.queue_shards import QueueShardRepository
from scheduler_grpc.db.users import UserRepository
from scheduler_grpc.errors import ConfigError, Fenced, LeaseLost
from scheduler_grpc.jobs import JobSpec, JobStatus
from scheduler_grpc.leader import LeaderElector
from scheduler_grpc.queue import Queue
from scheduler_grpc.server import RunningServer, serve
from tests.engine_helpers import eventually, make_settings
from tests.test_api_server import make_certificates
from tests.test_api_support import ADMIN_PASSWORD, FAST_HASHER


@dataclass
class Console:
    server: RunningServer
    url: str

    def client(self) -> aiohttp.ClientSession:
        # unsafe=True: keep cookies of an IP-address host (127.0.0.1), as a browser does.
        return aiohttp.ClientSession(self.url, cookie_jar=aiohttp.CookieJar(unsafe=True))

    async def session_for(self, username: str, role: Role) -> str:
        users = UserRepository(self.server.api.control._pool)
        user = await users.upsert(username, FAST_HASHER.hash("irrelevant-password"), role.value)
        return (await self.server.api.auth.open_session(user)).token


@contextlib.asynccontextmanager
async def running_console(redis_url: str, database_url: str, pool: asyncpg.Pool) -> AsyncIterator[Console]:
    settings = make_settings(redis_url, database_url, SCHEDULER_GRPC_PORT="0", SCHEDULER_SHUTDOWN_GRACE="1s")
    client: Redis = redis_client(redis_url)
    try:
        async with serve(settings, client, pool, hasher=FAST_HASHER) as server:
            assert server.console_url is not None
            yield Console(server, server.console_url.rstrip("/"))
    finally:
        await client.aclose()


@pytest.fixture
async def console(redis_url: str, database_url: str, redis: Redis, pool: asyncpg.Pool) -> AsyncIterator[Console]:
    async with running_console(redis_url, database_url, pool) as running:
        yield running


async def login_token(http: aiohttp.ClientSession) -> str:
    """The pre-session token of the login form (the form's hidden field; its cookie is the same)."""
    async with http.get("/login") as page:
        match = re.search(r'name="login_token" value="([^"]+)"', await page.text())
    return match.group(1) if match else ""  # none: the POST says so (403)


async def post_login(http: aiohttp.ClientSession, username: str, password: str) -> aiohttp.ClientResponse:
    """POST the login form as a browser does: with the token of a login page just fetched."""
    token = await login_token(http)
    return await http.post(
        "/login",
        data={"username": username, "password": password, LOGIN_FIELD: token},
        cookies={LOGIN_COOKIE: token},
        allow_redirects=False,
    )


async def login(http: aiohttp.ClientSession, username: str = "admin", password: str = ADMIN_PASSWORD) -> str:
    async with await post_login(http, username, password) as reply:
        assert reply.status == 303, await reply.text()
        return reply.cookies[COOKIE].value


def _with_cookie(http: aiohttp.ClientSession, token: str) -> None:
    http.cookie_jar.update_cookies({COOKIE: token})


async def _job(console: Console, name: str = "console-job") -> str:
    job = await console.server.api.control.create_job(JobSpec(name=name, handler="test.echo"))
    return job.id


async def test_login_sets_a_strict_httponly_cookie_and_logout_ends_the_session(console: Console) -> None:
    async with console.client() as http:
        async with await post_login(http, "admin", ADMIN_PASSWORD) as reply:
            assert reply.status == 303
            cookie = reply.headers["Set-Cookie"]
            token = reply.cookies[COOKIE].value
        assert token.startswith("st_")
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        assert "Path=/" in cookie
        assert "Secure" not in cookie  # plain HTTP on loopback (TLS or SCHEDULER_HTTP_TLS_PROXY add it)
        async with http.get("/", allow_redirects=False) as page:
            assert page.status == 200
            assert page.headers["Content-Security-Policy"] == CSP
            assert "'unsafe-inline'" not in page.headers["Content-Security-Policy"]
            assert page.headers["X-Frame-Options"] == "DENY"
            body = await page.text()
        assert "<script>" not in body
        assert " on" + "click=" not in body
        # The cookie is a Login session token: the API accepts it too, until logout.
        principal = await console.server.api.auth.authenticate(token)
        assert principal.name == "admin"
        async with http.post("/logout", data={"csrf": csrf_token(token)}, allow_redirects=False) as reply:
            assert reply.status == 303
            assert reply.headers["Location"] == "/login"
        with pytest.raises(Unauthenticated):
            await console.server.api.auth.authenticate(token)
    async with console.client() as replay:  # the old cookie, replayed, is a logged-out visitor
        _with_cookie(replay, token)
        async with replay.get("/jobs", allow_redirects=False) as page:
            assert page.status == 303
            assert page.headers["Location"] == "/login"


async def test_a_post_without_the_csrf_token_is_refused(console: Console) -> None:
    job_id = await _job(console)
    async with console.client() as http:
        token = await login(http)
        async with http.post(f"/jobs/{job_id}/pause", data={}, allow_redirects=False) as reply:
            assert reply.status == 403
            assert "CSRF" in await reply.text()
        async with http.post(f"/jobs/{job_id}/pause", data={"csrf": "0" * 64}, allow_redirects=False) as reply:
            assert reply.status == 403
        assert (await console.server.api.control.get_job(job_id)).status is JobStatus.ACTIVE
        async with http.post(f"/jobs/{job_id}/pause", data={"csrf": csrf_token(token)}, allow_redirects=False) as reply:
            assert reply.status == 303
        assert (await console.server.api.control.get_job(job_id)).status is JobStatus.PAUSED
        # The header works as well as the form field (for script-made requests).
        async with http.post(
            f"/jobs/{job_id}/resume", headers={"X-CSRF-Token": csrf_token(token)}, allow_redirects=False
        ) as reply:
            assert reply.status == 303
        assert (await console.server.api.control.get_job(job_id)).status is JobStatus.ACTIVE


async def test_a_viewer_sees_no_action_and_a_forged_post_is_refused(console: Console) -> None:
    job_id = await _job(console)
    token = await console.session_for("victor", Role.VIEWER)
    async with console.client() as http:
        _with_cookie(http, token)
        async with http.get(f"/jobs/{job_id}") as page:
            assert page.status == 200
            body = await page.text()
        assert "console-job" in body
        for action in ("/trigger", "/pause", "/delete", "/edit"):
            assert f"/jobs/{job_id}{action}" not in body, action
        async with http.get("/jobs") as page:
            assert "New job" not in await page.text()
        # A forged POST, even with the viewer's own valid CSRF token: PauseJob needs operator.
        csrf = csrf_token(token)
        for action in ("pause", "trigger", "delete"):
            async with http.post(f"/jobs/{job_id}/{action}", data={"csrf": csrf}, allow_redirects=False) as reply:
                assert reply.status == 403, action
                assert "you are viewer" in await reply.text()
        async with http.post("/jobs", data={"csrf": csrf, "name": "x", "handler": "test.echo"}) as reply:
            assert reply.status == 403
        async with http.get("/api-keys") as page:
            assert page.status == 403  # ListApiKeys is admin-only in the API's table
    job = await console.server.api.control.get_job(job_id)
    assert job.status is JobStatus.ACTIVE
    assert await console.server.api.control.list_executions(job_id=job_id) is not None
    assert (await console.server.api.control.list_executions(job_id=job_id)).executions == []


async def test_an_operator_may_trigger_but_not_delete(console: Console) -> None:
    job_id = await _job(console)
    token = await console.session_for("olivia", Role.OPERATOR)
    async with console.client() as http:
        _with_cookie(http, token)
        csrf = csrf_token(token)
        async with http.post(f"/jobs/{job_id}/trigger", data={"csrf": csrf}, allow_redirects=False) as reply:
            assert reply.status == 303
        async with http.post(f"/jobs/{job_id}/delete", data={"csrf": csrf}, allow_redirects=False) as reply:
            assert reply.status == 403
    assert len((await console.server.api.control.list_executions(job_id=job_id)).executions) == 1


async def test_login_is_throttled_with_the_api(console: Console) -> None:
    """Failures through the console count against the same limits as Login over gRPC."""
    statuses = []
    async with console.client() as http:
        for _ in range(12):
            async with await post_login(http, "admin", "wrong") as reply:
                statuses.append(reply.status)
                if reply.status == 429:
                    assert "try again in" in await reply.text()
                    break
    assert statuses[0] == 401
    assert statuses[-1] == 429, statuses
    async with grpc.aio.insecure_channel(console.server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await auth_pb2_grpc.AuthServiceStub(channel).Login(
                auth_pb2.LoginRequest(username="admin", password="wrong"), timeout=10
            )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_job_form_errors_are_shown_on_their_field(console: Console) -> None:
    async with console.client() as http:
        token = await login(http)
        form = {"csrf": csrf_token(token), "name": "bad-cron", "handler": "test.echo", "schedule_kind": "cron"}
        async with http.post("/jobs", data={**form, "cron": "61 * * * *"}) as reply:
            assert reply.status == 400
            body = await reply.text()
        assert re.search(r'class="field-error" data-field="cron"', body), body
        assert 'value="bad-cron"' in body  # what was typed is kept
        async with http.post("/jobs", data={**form, "cron": "* * * * *", "payload": "{not json"}) as reply:
            assert reply.status == 400
            assert 'data-field="payload"' in await reply.text()
        async with http.post("/jobs", data={**form, "cron": "* * * * *", "time_zone": "Mars/Olympus"}) as reply:
            assert reply.status == 400
            assert 'data-field="time_zone"' in await reply.text()
        async with http.post("/jobs", data={**form, "cron": "*/5 * * * *"}, allow_redirects=False) as reply:
            assert reply.status == 303
            job_id = reply.headers["Location"].rsplit("/", 1)[-1]
    job = await console.server.api.control.get_job(job_id)
    assert (job.name, job.cron, job.next_run_time is not None) == ("bad-cron", "*/5 * * * *", True)


async def test_schedule_preview_flags_dst_shifts(console: Console) -> None:
    async with console.client() as http:
        await login(http)
        # 02:30 on March's Sundays in Paris: on the last one 02:30 does not exist (02:00 -> 03:00).
        query = {"cron": "30 2 * 3 0", "time_zone": "Europe/Paris"}
        async with http.get("/api/preview", params=query) as reply:
            assert reply.status == 200
            fires = (await reply.json())["fire_times"]
        assert len(fires) == 10
        assert {fire["dst"] for fire in fires} >= {"shifted", "none"}
        async with http.get("/api/preview", params={"cron": "99 * * * *"}) as reply:
            assert reply.status == 400
            assert (await reply.json())["field"] == "cron"


async def test_the_event_stream_resumes_after_the_last_event_id(console: Console) -> None:
    job_id = await _job(console)
    async with console.client() as http:
        token = await login(http)

        async def read_events(response: aiohttp.ClientResponse, until_type: str) -> list[dict[str, str]]:
            events: list[dict[str, str]] = []
            current: dict[str, str] = {}
            async for raw in response.content:
                line = raw.decode().rstrip("\n")
                if not line:
                    if current:
                        events.append(current)
                        if until_type in current.get("data", ""):
                            return events
                    current = {}
                    continue
                key, _, value = line.partition(": ")
                current[key] = value
            raise AssertionError(f"the stream ended after {events}")

        async with http.get(f"/events?job={job_id}", timeout=aiohttp.ClientTimeout(total=20)) as stream:
            assert stream.headers["Content-Type"].startswith("text/event-stream")
            hello = (await read_events(stream, "{}"))[0]
            assert hello["event"] == "hello"
            async with http.post(f"/jobs/{job_id}/trigger", data={"csrf": csrf_token(token)}) as reply:
                assert reply.status == 200
            created = (await read_events(stream, '"created"'))[-1]
        assert job_id in created["data"]
        # Reconnecting with the hello's id as Last-Event-ID delivers the event missed meanwhile.
        async with http.get(
            f"/events?job={job_id}", headers={"Last-Event-ID": hello["id"]}, timeout=aiohttp.ClientTimeout(total=20)
        ) as resumed:
            again = await read_events(resumed, '"created"')
        assert again[-1]["id"] == created["id"]


async def test_api_keys_page_shows_a_new_secret_once_and_revokes(console: Console) -> None:
    async with console.client() as http:
        token = await login(http)
        csrf = csrf_token(token)
        async with http.post("/api-keys", data={"csrf": csrf, "display_name": "ci-bot", "role": "operator"}) as reply:
            assert reply.status == 200
            body = await reply.text()
        match = re.search(r'<pre id="new-key-secret">(sk_[^<]+)</pre>', body)
        assert match is not None, body
        principal = await console.server.api.auth.authenticate(match.group(1))
        assert (principal.name, principal.role) == ("api-key:ci-bot", Role.OPERATOR)
        async with http.get("/api-keys") as page:
            listing = await page.text()
        assert "ci-bot" in listing
        assert match.group(1) not in listing  # shown once: never again
        key_id = principal.subject_id
        async with http.post(f"/api-keys/{key_id}/revoke", data={"csrf": csrf}, allow_redirects=False) as reply:
            assert reply.status == 303
    with pytest.raises(Unauthenticated):
        await console.server.api.auth.authenticate(match.group(1))


async def test_workers_and_overview_pages_render(console: Console) -> None:
    async with console.client() as http:
        await login(http)
        for path in ("/", "/workers", "/jobs", "/executions", "/dead-letters"):
            async with http.get(path) as page:
                assert page.status == 200, path
                body = await page.text()
                assert 'id="outage"' not in body, path  # both stores answer: no warning


async def test_the_overview_shows_a_sharded_queues_depth_summed_and_its_shards(
    console: Console, pool: asyncpg.Pool, redis: Redis
) -> None:
    await QueueShardRepository(pool).set_shards("default", 3, lead=timedelta(0))
    for shard, item in ((1, "on-one"), (2, "on-two")):
        assert await Queue(redis, "default", shard=shard).enqueue(item)
    async with console.client() as http:
        await login(http)

        async def shows_shards() -> str:
            async with http.get("/") as page:
                body = await page.text()
            return body if "(3 shards)" in body else ""

        body = await eventually(shows_shards, within=15)
    row = re.search(r'<tr><td>default <span class="muted">\(3 shards\)</span></td>(.*?)</tr>', body)
    assert row is not None, body
    assert row.group(1).startswith("<td>2</td>"), row.group(1)  # ready: both shards' items


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
async def test_under_tls_the_console_is_https_and_its_cookie_secure(
    redis_url: str, database_url: str, redis: Redis, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    files = await asyncio.to_thread(make_certificates, tmp_path)
    settings = make_settings(
        redis_url, database_url, SCHEDULER_GRPC_PORT="0", SCHEDULER_SHUTDOWN_GRACE="1s",
        SCHEDULER_TLS_CERT=str(files["server.pem"]), SCHEDULER_TLS_KEY=str(files["server.key"]),
    )  # fmt: skip
    client: Redis = redis_client(redis_url)
    trust = ssl.create_default_context(cafile=str(files["ca.pem"]))
    try:
        async with serve(settings, client, pool, hasher=FAST_HASHER) as server:
            assert server.console_url is not None
            assert server.console_url.startswith("https://127.0.0.1:")
            async with (
                aiohttp.ClientSession(
                    server.console_url.rstrip("/"), connector=aiohttp.TCPConnector(ssl=trust)
                ) as http,
                await post_login(http, "admin", ADMIN_PASSWORD) as reply,
            ):
                assert reply.status == 303
                cookie = reply.headers["Set-Cookie"]
        assert "Secure" in cookie
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
    finally:
        await client.aclose()


def test_production_needs_an_explicit_console_host(redis_url: str, database_url: str) -> None:
    settings = make_settings(redis_url, database_url, SCHEDULER_ENV="production", SCHEDULER_GRPC_HOST="0.0.0.0")
    with pytest.raises(ConfigError, match="SCHEDULER_HTTP_HOST"):
        listen_host(settings)
    disabled = make_settings(
        redis_url,
        database_url,
        SCHEDULER_ENV="production",
        SCHEDULER_GRPC_HOST="0.0.0.0",
        SCHEDULER_HTTP_ENABLED="false",
    )
    assert not disabled.http_enabled
    explicit = make_settings(
        redis_url,
        database_url,
        SCHEDULER_ENV="production",
        SCHEDULER_HTTP_HOST="0.0.0.0",
        SCHEDULER_GRPC_HOST="0.0.0.0",
    )
    assert listen_host(explicit) == "0.0.0.0"


async def test_the_overview_counts_standby_schedulers(console: Console, redis_url: str, pool: asyncpg.Pool) -> None:
    """Two real electors campaign: one leads, the other waits as a standby."""
    clients = [redis_client(redis_url), redis_client(redis_url)]
    leading = asyncio.Event()

    async def lead(term: object) -> None:
        leading.set()
        await asyncio.Event().wait()  # lead until cancelled

    electors = [
        LeaderElector(client, LeadershipRepository(pool), holder=f"scheduler-{i}", ttl=timedelta(seconds=5))
        for i, client in enumerate(clients)
    ]
    tasks = [asyncio.create_task(elector.run(lead)) for elector in electors]
    try:
        await asyncio.wait_for(leading.wait(), 10)
        await eventually(lambda: _count(console), within=10)
        async with console.client() as http:
            await login(http)
            async with http.get("/") as page:
                body = await page.text()
        assert re.search(r'<p id="standbys">1 standby</p>', body), body
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in clients:
            await client.aclose()


async def _count(console: Console) -> bool:
    return await console.server.api.cluster.electors() == 2


async def test_an_operator_cancels_a_waiting_run_from_its_page(console: Console) -> None:
    job_id = await _job(console)
    execution = await console.server.api.control.trigger_execution(job_id)  # no worker: it stays queued
    token = await console.session_for("olivia", Role.OPERATOR)
    async with console.client() as http:
        _with_cookie(http, token)
        async with http.get(f"/executions/{execution.id}") as page:
            body = await page.text()
        assert f'action="/executions/{execution.id}/cancel"' in body
        async with http.post(
            f"/executions/{execution.id}/cancel", data={"csrf": csrf_token(token)}, allow_redirects=False
        ) as reply:
            assert reply.status == 303
        async with http.get(f"/executions/{execution.id}") as page:
            body = await page.text()
        assert "s-cancelled" in body
        assert f'action="/executions/{execution.id}/cancel"' not in body  # finished: nothing to cancel
        async with http.post(f"/executions/{execution.id}/cancel", data={"csrf": csrf_token(token)}) as reply:
            assert reply.status == 409  # FAILED_PRECONDITION, as over gRPC
    assert (await console.server.api.control.get_execution(execution.id)).status.value == "cancelled"


async def test_a_run_not_yet_due_or_held_says_when_it_is_due(console: Console, pool: asyncpg.Pool) -> None:
    """Runs fired ahead of their slot (or backing off before a retry) wait queued: the list says so,
    rather than showing them like runs a worker should be taking now."""
    job_id = await _job(console)
    later = await console.server.api.control.trigger_execution(job_id)  # no worker: they stay queued
    now = await console.server.api.control.trigger_execution(job_id)
    held = await console.server.api.control.trigger_execution(job_id)
    await pool.execute(
        "UPDATE job_executions SET due_at = now() + interval '1 hour' WHERE id = $1", uuid.UUID(later.id)
    )
    # A worker's reservation: claimed ahead, `running` with the start it expects.
    await pool.execute(
        """UPDATE job_executions SET status = 'running', claim_token = 't', worker_id = 'w',
                  due_at = now() + interval '1 hour', started_at = now() + interval '1 hour' WHERE id = $1""",
        uuid.UUID(held.id),
    )
    token = await console.session_for("vera", Role.VIEWER)
    async with console.client() as http:
        _with_cookie(http, token)
        async with http.get("/executions") as page:
            body = await page.text()
    rows = {row.split('"', 1)[0]: row for row in body.split('data-execution="')[1:]}
    assert 'class="not-due"' in rows[later.id], rows[later.id]
    assert 'class="not-due"' not in rows[now.id], rows[now.id]
    assert '">starts ' in rows[held.id], rows[held.id]


@pytest.mark.parametrize(
    ("error", "grpc_code", "http_status"),
    [
        # A replica after a failover: a store that cannot serve now, not a bug of ours.
        (ReadOnlyError("READONLY You can't write against a read only replica."), grpc.StatusCode.UNAVAILABLE, 503),
        (Fenced("term 3 is no longer current"), grpc.StatusCode.ABORTED, 409),
        (LeaseLost("lease lost"), grpc.StatusCode.ABORTED, 409),
    ],
)
async def test_the_console_and_the_api_answer_an_error_alike(
    console: Console, monkeypatch: pytest.MonkeyPatch, error: Exception, grpc_code: grpc.StatusCode, http_status: int
) -> None:
    # One mapping of errors to outcomes: the same failure of the same Control call is the same
    # answer whichever door it came through.
    job_id = await _job(console)

    async def fails(job_id: str) -> None:
        raise error

    monkeypatch.setattr(console.server.api.control, "pause_job", fails)
    async with console.client() as http:
        token = await login(http)
        async with http.post(f"/jobs/{job_id}/pause", data={"csrf": csrf_token(token)}, allow_redirects=False) as reply:
            got_http = reply.status
    async with grpc.aio.insecure_channel(console.server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await jobs_pb2_grpc.JobServiceStub(channel).PauseJob(
                jobs_pb2.PauseJobRequest(id=job_id), metadata=(("authorization", f"Bearer {token}"),), timeout=10
            )
    assert (refused.value.code(), got_http) == (grpc_code, http_status)
