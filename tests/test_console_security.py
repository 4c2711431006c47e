"""The console hardened like the API (issue 21, defects 4 and 5), against real servers.

Host names (DNS rebinding), the dev password on a console beyond loopback, bounded connections and
request heads (with 20,000 half-open connections against a real server process), login CSRF, the
`next=` redirect, the security headers of the live event stream, secrets in payloads and results
(console and API), bidirectional-text controls, and a restart on the same port right after use.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import resource
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp
import asyncpg
import grpc
import orjson
import pytest
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import example, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from scheduler_client.v1 import executions_pb2, executions_pb2_grpc, jobs_pb2, jobs_pb2_grpc

from scheduler_grpc import redaction
from scheduler_grpc.auth import Role
from scheduler_grpc.connections import redis_client
from scheduler_grpc.console import bulk
from scheduler_grpc.console.limits import connection_limit
from scheduler_grpc.console.security import CSP, HostPolicy, csrf_token, safe_next, visible
from scheduler_grpc.errors import ConfigError
from scheduler_grpc.events import EventType, ExecutionEvent, publish
from scheduler_grpc.jobs import JobSpec
from scheduler_grpc.server import preflight, serve
from tests.api_helpers import free_port, start_server, wait_for_server
from tests.engine_helpers import Roles, eventually, make_settings
from tests.test_api_support import FAST_HASHER
from tests.test_console import Console, login, login_token

SECRET = "Bearer s3cr3t-webhook-token"
WEBHOOK = {
    "url": "https://hooks.example.com/deploy",
    "headers": {"Authorization": SECRET, "X-Trace": "visible-value"},
}


@contextlib.asynccontextmanager
async def running(redis_url: str, database_url: str, pool: asyncpg.Pool, **env: str) -> AsyncIterator[Console]:
    settings = make_settings(redis_url, database_url, SCHEDULER_GRPC_PORT="0", SCHEDULER_SHUTDOWN_GRACE="1s", **env)
    client: Redis = redis_client(redis_url)
    try:
        async with serve(settings, client, pool, hasher=FAST_HASHER) as server:
            assert server.console_url is not None
            yield Console(server, server.console_url.rstrip("/"))
    finally:
        await client.aclose()


@pytest.fixture
async def console(redis_url: str, database_url: str, redis: Redis, pool: asyncpg.Pool) -> AsyncIterator[Console]:
    async with running(redis_url, database_url, pool) as started:
        yield started


def _port(console: Console) -> int:
    return int(console.url.rsplit(":", 1)[1])


# -- host names (DNS rebinding) ------------------------------------------------------------------


async def test_a_foreign_host_name_is_refused_before_anything_else(console: Console) -> None:
    port = _port(console)
    async with console.client() as http:
        token = await login(http)
        for path in ("/", "/login", "/jobs", "/static/console.css", "/events"):
            async with http.get(path, headers={"Host": f"evil.example:{port}"}, allow_redirects=False) as reply:
                assert reply.status == 421, path
                assert reply.headers["Content-Security-Policy"] == CSP
        async with http.post(
            "/logout", data={"csrf": csrf_token(token)}, headers={"Host": "evil.example"}, allow_redirects=False
        ) as reply:
            assert reply.status == 421
        # The session survived the refused logout; loopback names and addresses are the console.
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"app.localhost:{port}", f"[::1]:{port}"):
            async with http.get("/jobs", headers={"Host": host}, allow_redirects=False) as reply:
                assert reply.status == 200, host
        # A load balancer's probe by any name still hears "ok" (and nothing else).
        async with http.get("/healthz", headers={"Host": "probe.internal"}) as reply:
            assert reply.status == 200


async def test_configured_host_names_are_accepted(redis_url: str, database_url: str, pool: asyncpg.Pool) -> None:
    async with (
        running(redis_url, database_url, pool, SCHEDULER_HTTP_ALLOWED_HOSTS="console.example.com,.corp.example") as c,
        c.client() as http,
    ):
        for host, status in [("console.example.com", 200), ("a.corp.example", 200), ("corp.example.evil", 421)]:
            async with http.get("/login", headers={"Host": host}) as reply:
                assert reply.status == status, host


async def test_a_console_on_every_interface_answers_to_this_machines_name(
    redis_url: str, database_url: str, pool: asyncpg.Pool
) -> None:
    async with (
        running(
            redis_url, database_url, pool, SCHEDULER_HTTP_HOST="0.0.0.0", SCHEDULER_ADMIN_PASSWORD="a-real-password-1"
        ) as c,
        c.client() as http,
    ):
        for host, status in [(socket.gethostname(), 200), ("127.0.0.1", 200), ("evil.example", 421)]:
            async with http.get("/login", headers={"Host": host}) as reply:
                assert reply.status == status, host


def test_host_policy() -> None:
    wildcard = HostPolicy.build("0.0.0.0", (), machine_names=["build-box", "build-box.lan"])
    assert wildcard.host_ok("build-box:8080")
    assert wildcard.host_ok("BUILD-BOX.lan.:8080")
    assert wildcard.host_ok("10.1.2.3:8080")  # an address is its own origin: no rebinding
    assert not wildcard.host_ok("evil.example")
    assert wildcard.host_ok(None)  # HTTP/1.0 without Host: not a browser, so not a rebinding page
    for malformed in ("", "a b", "evil.example@127.0.0.1", "127.0.0.1/x", "::1", "[::1", "h:99999", "h:x"):
        assert not wildcard.host_ok(malformed), malformed
    named = HostPolicy.build("console.internal", ("*",))
    assert named.host_ok("anything.example")
    loopback = HostPolicy.build("127.0.0.1", ())
    assert loopback.origin_ok("http://127.0.0.1:8080", None, "127.0.0.1:8080")
    assert loopback.origin_ok("http://localhost", None, "localhost:80")
    assert loopback.origin_ok(None, None, "127.0.0.1:8080")  # not a browser
    assert loopback.origin_ok(None, "same-origin", "127.0.0.1:8080")
    assert not loopback.origin_ok(None, "cross-site", "127.0.0.1:8080")
    assert not loopback.origin_ok("http://evil.example", None, "127.0.0.1:8080")
    assert not loopback.origin_ok("http://127.0.0.1:9999", None, "127.0.0.1:8080")
    assert not loopback.origin_ok("null", None, "127.0.0.1:8080")
    proxied = HostPolicy.build("127.0.0.1", ("console.example.com",))
    assert proxied.origin_ok("https://console.example.com", None, "127.0.0.1:8080")


# -- the dev password ----------------------------------------------------------------------------


def test_the_dev_password_is_not_served_by_a_console_beyond_loopback(redis_url: str, database_url: str) -> None:
    exposed = make_settings(redis_url, database_url, SCHEDULER_HTTP_HOST="0.0.0.0")
    with pytest.raises(ConfigError, match=r"SCHEDULER_ADMIN_PASSWORD.*SCHEDULER_HTTP_HOST"):
        preflight(exposed)
    both = make_settings(redis_url, database_url, SCHEDULER_HTTP_HOST="0.0.0.0", SCHEDULER_GRPC_HOST="0.0.0.0")
    with pytest.raises(ConfigError, match="SCHEDULER_GRPC_HOST and SCHEDULER_HTTP_HOST"):
        preflight(both)
    with_password = make_settings(
        redis_url, database_url, SCHEDULER_HTTP_HOST="0.0.0.0", SCHEDULER_ADMIN_PASSWORD="a-real-password"
    )
    assert preflight(with_password)[1] == "a-real-password"
    without_console = make_settings(
        redis_url, database_url, SCHEDULER_HTTP_HOST="0.0.0.0", SCHEDULER_HTTP_ENABLED="false"
    )
    assert preflight(without_console)[1] == "admin123"
    assert preflight(make_settings(redis_url, database_url, SCHEDULER_HTTP_HOST="::1"))[1] == "admin123"


# -- half-sent requests --------------------------------------------------------------------------


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await reader.read(1024) == b""
    except ConnectionError:
        return True


async def test_a_half_sent_request_is_closed_after_the_header_timeout(
    redis_url: str, database_url: str, pool: asyncpg.Pool
) -> None:
    async with running(redis_url, database_url, pool, SCHEDULER_HTTP_HEADER_TIMEOUT="1s") as console:
        port = _port(console)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        slow_body, body_writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            body_writer.write(
                b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                b"Content-Length: 100\r\n\r\nusername=adm"
            )
            started = time.monotonic()
            async with asyncio.timeout(10):
                assert await _closed_by_server(reader)
                assert await _closed_by_server(slow_body)
            assert time.monotonic() - started < 5
        finally:
            writer.close()
            body_writer.close()
        # A request being answered is not cut: the live stream outlasts the timeout.
        async with console.client() as http:
            await login(http)
            async with http.get("/events") as stream:
                assert stream.status == 200
                assert b"event: hello" in await stream.content.readuntil(b"\n\n")
                await asyncio.sleep(1.5)  # longer than the header timeout: the stream must still be open
                assert not stream.connection or not stream.connection.closed  # type: ignore[union-attr]
                assert not stream.content.at_eof()


async def test_past_the_connection_limit_the_longest_waiting_connection_makes_room(
    redis_url: str, database_url: str, pool: asyncpg.Pool
) -> None:
    async with running(redis_url, database_url, pool, SCHEDULER_HTTP_MAX_CONNECTIONS="16") as console:
        port = _port(console)
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(16)]
        try:
            async with console.client() as http, http.get("/login") as reply:
                assert reply.status == 200
            # The first idle connection was closed to make room.
            async with asyncio.timeout(5):
                assert await _closed_by_server(idle[0][0])
        finally:
            for _, writer in idle:
                writer.close()


def test_the_connection_limit_keeps_to_a_quarter_of_the_descriptors() -> None:
    assert connection_limit(1000, soft=1024) == 256
    assert connection_limit(1000, soft=20_000) == 1000
    assert connection_limit(100, soft=20_000) == 100
    assert connection_limit(1000, soft=40) == 16  # never below MIN_CONNECTIONS
    assert connection_limit(1000, soft=resource.RLIM_INFINITY) == 1000


# Opens `count` connections to the console, each sending a partial request line, and holds them.
# A connection counts once the server's kernel has ACKed its bytes (its send queue is empty): a
# handshake whose last packet was dropped because the accept queue was full is retried by the
# kernel only with exponential backoff, so one unconfirmed after a second is replaced by a new one.
# At most IN_FLIGHT are unconfirmed at a time, which paces the flood to the server's accept rate.
_OPENER = r"""
import fcntl, resource, selectors, socket, struct, sys, termios, time
port, count = int(sys.argv[1]), int(sys.argv[2])
IN_FLIGHT = 256
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
selector = selectors.DefaultSelector()
held, dialing, sent = [], {}, {}

def outq(s):
    return struct.unpack("i", fcntl.ioctl(s, termios.TIOCOUTQ, b"\0\0\0\0"))[0]

deadline = time.monotonic() + 80
while len(held) < count and time.monotonic() < deadline:
    while len(dialing) + len(sent) < IN_FLIGHT and len(held) + len(dialing) + len(sent) < count:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        selector.register(s, selectors.EVENT_WRITE)
        dialing[s] = time.monotonic()
    now = time.monotonic()
    for key, _ in selector.select(0.02):
        s = key.fileobj
        selector.unregister(s)
        del dialing[s]
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                raise OSError
            s.send(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Partial: ")
            sent[s] = now
        except OSError:
            s.close()
    for s, since in list(dialing.items()):
        if now - since > 2:
            selector.unregister(s)
            del dialing[s]
            s.close()
    for s, since in list(sent.items()):
        try:
            waiting = outq(s)
        except OSError:
            waiting = -1
        if waiting == 0:
            del sent[s]
            held.append(s)
        elif waiting < 0 or now - since > 1:
            del sent[s]
            s.close()
print(f"ready {len(held)}", flush=True)
sys.stdin.read()
"""


async def _health_within(target: str, seconds: float) -> bool:
    """Whether a NEW channel gets SERVING from Health within `seconds` (a new connection needs a descriptor)."""
    async with grpc.aio.insecure_channel(target) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=seconds)
        except grpc.aio.AioRpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _accept_queue(port: int) -> int:
    """Connections waiting in the accept queue of the socket listening on `port` (Linux's /proc/net/tcp)."""
    waiting = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in rows.readlines()[1:]:
                fields = row.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN: rx_queue
                    waiting += int(fields[4].split(":")[1], 16)
    return waiting


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _soft_fd_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as limits:
        for line in limits:
            if line.startswith("Max open files"):
                soft = line.split()[3]
                return 1 << 30 if soft == "unlimited" else int(soft)
    raise AssertionError("no 'Max open files' line")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's state from /proc")
async def test_20000_half_open_console_connections_leave_grpc_health_answering(roles: Roles) -> None:
    """Acceptance: a server process flooded with half-sent console requests still answers Health in 1 s."""
    http_port = free_port()
    api = start_server(roles, SCHEDULER_HTTP_PORT=str(http_port))
    await wait_for_server(api)
    total = 20_000
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    per_child = min(total, hard - 200)
    openers = []
    held = 0
    try:
        remaining = total
        while remaining > 0:
            count = min(per_child, remaining)
            remaining -= count
            # posix_spawn-friendly (no preexec_fn, no close_fds): gRPC threads exist in this process.
            openers.append(
                subprocess.Popen(  # noqa: ASYNC220 - returns at once
                    [sys.executable, "-c", _OPENER, str(http_port), str(count)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    close_fds=False,
                )
            )
        for opener in openers:
            assert opener.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(opener.stdout.readline), 100)
            assert line.startswith(b"ready"), line
            held += int(line.split()[1])
        assert held >= total - 64, f"only {held} connections reached the server"
        # Every connection reached the server's kernel; wait until the server took them all from its
        # accept queue (or ran out of descriptors trying: the failure this test is about).
        pid = api.server.pid
        soft = _soft_fd_limit(pid)

        async def drained() -> bool:
            return _accept_queue(http_port) == 0 or _open_fds(pid) >= soft - 64

        await eventually(drained, within=30, interval=0.2)
        for _ in range(3):  # each on a new connection, which needs a descriptor of the server's
            started = time.monotonic()
            assert await _health_within(api.target, 1.0), "Health did not answer within 1 s"
            assert time.monotonic() - started < 1.0
        assert _open_fds(pid) < soft // 2
        assert api.server.process.poll() is None
        # And the console itself still serves a newcomer.
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{http_port}/healthz") as reply:
            assert reply.status == 200
    finally:
        for opener in openers:
            assert opener.stdin is not None
            assert opener.stdout is not None
            with contextlib.suppress(OSError):
                opener.stdin.close()  # the opener's cue to exit
            try:
                opener.wait(30)
            except subprocess.TimeoutExpired:
                opener.kill()
                opener.wait()
            opener.stdout.close()


# -- restart on the same port (defect 5) ---------------------------------------------------------


def _time_wait_on(port: int) -> bool:
    """Whether a TCP connection with local port `port` is in TIME_WAIT (state 06 in /proc/net/tcp)."""
    wanted = f":{port:04X} "
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in rows.readlines()[1:]:
                fields = row.split()
                if (fields[1] + " ").endswith(wanted) and fields[3] == "06":
                    return True
    return False


async def test_the_server_restarts_on_its_ports_right_after_console_use(roles: Roles) -> None:
    grpc_port, http_port = free_port(), free_port()
    env = {"SCHEDULER_HTTP_PORT": str(http_port)}
    first = start_server(roles, grpc_port, **env)
    await wait_for_server(first)
    async with (
        aiohttp.ClientSession(f"http://127.0.0.1:{http_port}") as http,
        grpc.aio.insecure_channel(first.target) as channel,
    ):
        await login(http)
        async with http.get("/jobs") as page:
            assert page.status == 200
        assert await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        # Both connections are still open when the server stops: it closes the console's, whose
        # server side then waits in TIME_WAIT (gRPC core sets SO_REUSEADDR on its own sockets).
        first.server.stop()
        assert first.server.process.returncode == 0
    if sys.platform.startswith("linux"):
        assert _time_wait_on(http_port), "the test needs a console connection in TIME_WAIT"
    second = start_server(roles, grpc_port, **env)
    await wait_for_server(second)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{http_port}") as http, http.get("/login") as page:
        assert page.status == 200
    assert not any("address already in use" in line.lower() for line in second.server.log_lines())


# -- login CSRF, origins, redirects ---------------------------------------------------------------


async def test_login_needs_the_login_forms_token_and_a_same_origin_post(console: Console) -> None:
    async with console.client() as http:
        async with http.post(
            "/login", data={"username": "admin", "password": "admin123"}, allow_redirects=False
        ) as reply:
            assert reply.status == 403
            assert "scheduler_session" not in reply.cookies
            assert "did not come from this console" in await reply.text()
        token = await login_token(http)
        forged = {"username": "admin", "password": "admin123", "login_token": "x" * 43}
        async with http.post("/login", data=forged, cookies={"scheduler_login": token}, allow_redirects=False) as reply:
            assert reply.status == 403
        good = {"username": "admin", "password": "admin123", "login_token": token}
        async with http.post(
            "/login",
            data=good,
            cookies={"scheduler_login": token},
            headers={"Origin": "http://evil.example"},
            allow_redirects=False,
        ) as reply:
            assert reply.status == 403
            assert "scheduler_session" not in reply.cookies
        async with http.post(
            "/login",
            data=good,
            cookies={"scheduler_login": token},
            headers={"Origin": console.url, "Sec-Fetch-Site": "same-origin"},
            allow_redirects=False,
        ) as reply:
            assert reply.status == 303
            assert reply.cookies["scheduler_session"].value.startswith("st_")


async def test_a_cross_site_post_with_a_valid_session_and_csrf_token_is_refused(console: Console) -> None:
    job = await console.server.api.control.create_job(JobSpec(name="origin-guarded", handler="test.echo"))
    async with console.client() as http:
        token = await login(http)
        async with http.post(
            f"/jobs/{job.id}/pause",
            data={"csrf": csrf_token(token)},
            headers={"Sec-Fetch-Site": "cross-site"},
            allow_redirects=False,
        ) as reply:
            assert reply.status == 403
    assert (await console.server.api.control.get_job(job.id)).status.value == "active"


@pytest.mark.parametrize(
    "target",
    ["/%09/evil.example", "//evil.example", "/\\evil.example", "/%5Cevil.example", "/%0a/evil.example", "https://e.x/"],
)
async def test_next_never_leaves_the_console(console: Console, target: str) -> None:
    job = await console.server.api.control.create_job(JobSpec(name=f"next-{uuid.uuid4().hex[:8]}", handler="test.echo"))
    async with console.client() as http:
        token = await login(http)
        async with http.post(
            f"/jobs/{job.id}/pause?next={target}", data={"csrf": csrf_token(token)}, allow_redirects=False
        ) as reply:
            assert reply.status == 303
            assert reply.headers["Location"] == f"/jobs/{job.id}"
        async with http.post(
            f"/jobs/{job.id}/resume?next=/jobs%3Fstate%3Dactive",
            data={"csrf": csrf_token(token)},
            allow_redirects=False,
        ) as reply:
            assert reply.headers["Location"] == "/jobs?state=active"


def _browser_resolves(base: str, location: str) -> str:
    """Where a browser goes for `Location: location` (WHATWG URL parsing, the parts that matter here)."""
    cleaned = re.sub(r"[\t\n\r]", "", location).strip(
        "\x00 \x01\x02\x03\x04\x05\x06\x07\x08\x0b\x0c\x0e\x0f"
        "\x10\x11\x12\x13\x14\x15\x16\x17\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f"
    )
    cleaned = cleaned.replace("\\", "/")
    return urljoin(base, cleaned)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from("/\\\t\n\r\x00 .:@?#%abcevil"), max_size=20))
def test_safe_next_stays_on_the_origin(target: str) -> None:
    base = "http://console.test/jobs/1"
    chosen = safe_next(target, "/jobs")
    assert urlsplit(_browser_resolves(base, chosen)).netloc == "console.test"


@example("/\t/evil.example")  # a tab the browser drops: `//evil.example`
@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from("/\\\t\n\r\x00 .:@?#%abcevil"), max_size=20))
def test_the_bulk_bars_return_path_stays_on_the_origin(target: str) -> None:
    # The bulk forms' `back` field is the same kind of redirect target as `next=`.
    chosen = bulk._back_to(target, "/jobs")
    assert urlsplit(_browser_resolves("http://console.test/jobs", chosen)).netloc == "console.test"


# -- security headers of the live stream ---------------------------------------------------------


async def test_the_event_stream_carries_the_security_headers(console: Console) -> None:
    async with console.client() as http:
        await login(http)
        async with http.get("/events") as stream:
            assert stream.status == 200
            assert stream.headers["Content-Type"].startswith("text/event-stream")
            assert stream.headers["Content-Security-Policy"] == CSP
            assert stream.headers["X-Content-Type-Options"] == "nosniff"
            assert stream.headers["X-Frame-Options"] == "DENY"
            assert stream.headers["Cache-Control"] == "no-store"


async def test_the_event_stream_shows_bidi_controls_escaped(console: Console, redis: Redis) -> None:
    job = await console.server.api.control.create_job(JobSpec(name="bidi-events", handler="test.echo"))
    async with console.client() as http:
        await login(http)
        async with http.get(f"/events?job={job.id}", timeout=aiohttp.ClientTimeout(total=20)) as stream:
            assert b"event: hello" in await stream.content.readuntil(b"\n\n")
            # What a worker publishes when a handler fails with a message it does not control.
            failed = ExecutionEvent(
                EventType.FAILED, str(uuid.uuid4()), str(uuid.uuid4()), job.id, 1,
                handler="test.echo", worker_id="w\u202e1", error="upstream said: txt.\u202eexe",
            )  # fmt: skip
            await publish(redis, [failed])
            data = await stream.content.readuntil(b"\n\n")
    text = data.decode()
    assert "\u202e" not in text
    assert "txt.\\\\u202Eexe" in text  # JSON of the six characters backslash-u-2-0-2-E


# -- secrets -------------------------------------------------------------------------------------


async def _webhook_job(console: Console, name: str) -> str:
    job = await console.server.api.control.create_job(JobSpec(name=name, handler="http.webhook", payload=WEBHOOK))
    return job.id


async def test_a_viewer_and_an_operator_see_no_secret_in_the_console(console: Console) -> None:
    job_id = await _webhook_job(console, "deploy-hook")
    for role, shown in [(Role.VIEWER, False), (Role.OPERATOR, False), (Role.ADMIN, True)]:
        async with console.client() as http:
            token = await console.session_for(f"user-{role.value}", role)
            http.cookie_jar.update_cookies({"scheduler_session": token})
            async with http.get(f"/jobs/{job_id}") as page:
                assert page.status == 200
                body = await page.text()
        assert ("s3cr3t-webhook-token" in body) is shown, role
        assert "visible-value" in body  # only the secret goes
        assert ("&lt;redacted&gt;" in body) is not shown


async def test_the_api_redacts_secrets_below_admin(console: Console, pool: asyncpg.Pool) -> None:
    job_id = await _webhook_job(console, "api-hook")
    echo = await console.server.api.control.create_job(JobSpec(name="echo", handler="test.echo"))
    run = await console.server.api.control.trigger_execution(echo.id)
    await pool.execute(
        "UPDATE job_executions SET result = $1 WHERE id = $2",
        {"echo": {"password": "hunter22", "n": 1}},  # the pool's jsonb codec encodes it
        run.id,
    )
    async with grpc.aio.insecure_channel(console.server.address) as channel:
        jobs = jobs_pb2_grpc.JobServiceStub(channel)
        executions = executions_pb2_grpc.ExecutionServiceStub(channel)
        for role, shown in [(Role.VIEWER, False), (Role.OPERATOR, False), (Role.ADMIN, True)]:
            token = await console.session_for(f"api-{role.value}", role)
            meta = (("authorization", f"Bearer {token}"),)
            got = (await jobs.GetJob(jobs_pb2.GetJobRequest(id=job_id), metadata=meta)).job
            assert (got.payload["headers"]["Authorization"] == SECRET) is shown
            assert got.payload["headers"]["X-Trace"] == "visible-value"
            listed = (await jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=meta)).jobs
            hook = next(j for j in listed if j.id == job_id)
            assert (hook.payload["headers"]["Authorization"] == SECRET) is shown
            asked = executions_pb2.GetExecutionRequest(id=run.id)
            result = MessageToDict((await executions.GetExecution(asked, metadata=meta)).execution.result)
            assert (result["echo"]["password"] == "hunter22") is shown
            assert result["echo"]["n"] == 1
            page = await executions.ListExecutions(executions_pb2.ListExecutionsRequest(job_id=echo.id), metadata=meta)
            assert (MessageToDict(page.executions[0].result)["echo"]["password"] == "hunter22") is shown
    # Redaction is on the way out: the stored job keeps its secret.
    assert (await console.server.api.control.get_job(job_id)).payload["headers"]["Authorization"] == SECRET


async def test_a_viewer_sees_no_secret_on_the_flow_run_page(console: Console, pool: asyncpg.Pool) -> None:
    control = console.server.api.control
    first = await control.create_job(JobSpec(name="hook-first", handler="test.echo"))
    await control.create_job(JobSpec(name="hook-then", handler="test.echo", depends_on=("hook-first",)))
    root = await control.trigger_execution(first.id)
    # A failed node's error quoting a credential (as a webhook's error may): its table row and the
    # drawing's tooltip show it.
    await pool.execute(
        "UPDATE job_executions SET error = $1 WHERE id = $2",
        "HTTP 401 from https://deploy:pw-9x7q@hooks.example/x: Bearer s3cr3t-webhook-token refused",
        root.id,
    )
    for role, shown in [(Role.VIEWER, False), (Role.OPERATOR, False), (Role.ADMIN, True)]:
        async with console.client() as http:
            token = await console.session_for(f"flow-{role.value}", role)
            http.cookie_jar.update_cookies({"scheduler_session": token})
            for path in (f"/flows/{root.run_id}", f"/flows/{root.run_id}/graph"):
                async with http.get(path) as page:
                    assert page.status == 200, path
                    body = await page.text()
                assert ("s3cr3t-webhook-token" in body) is shown, (role, path)
                assert ("pw-9x7q" in body) is shown, (role, path)
                assert "hooks.example/x" in body  # only the credentials go
                assert ("&lt;redacted&gt;" in body) is not shown


def test_the_secret_reader_is_the_role_that_writes_jobs() -> None:
    from scheduler_grpc.auth import required_role

    assert required_role("/scheduler.v1.JobService/UpdateJob") is redaction.SECRET_READER
    assert required_role("/scheduler.v1.JobService/CreateJob") is redaction.SECRET_READER


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"headers": {"Authorization": "x"}}, {"headers": {"Authorization": "<redacted>"}}),
        ({"headers": {"proxy-authorization": "x", "X-Api-Key": "k", "Cookie": "c"}},
         {"headers": {"proxy-authorization": "<redacted>", "X-Api-Key": "<redacted>", "Cookie": "<redacted>"}}),
        ({"client_secret": "s", "accessToken": "t", "db": {"password": "p"}, "max_tokens": 5},
         {"client_secret": "<redacted>", "accessToken": "<redacted>", "db": {"password": "<redacted>"},
          "max_tokens": 5}),
        ({"note": "Bearer abc"}, {"note": "<redacted>"}),
        ({"cookie": None, "token": ""}, {"cookie": None, "token": "<redacted>"}),  # an unset value stays unset
        ({"dsn": "postgresql://app:pw@db:5432/x"}, {"dsn": "postgresql://app:<redacted>@db:5432/x"}),
        ({"token": {"$from": "login.result.token"}}, {"token": "<redacted>"}),
        ({"author": "ann", "list": ["basic dXNlcg==", 1, None]}, {"author": "ann", "list": ["<redacted>", 1, None]}),
    ],
)  # fmt: skip
def test_the_redaction_rule(value: Any, expected: Any) -> None:
    assert redaction.redact(value) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("POST https://hooks.example/x: 401 (Authorization: Bearer eyJhbGciOi.x9)",
         "POST https://hooks.example/x: 401 (Authorization: <redacted>)"),
        ("got Bearer s3cr3t-webhook-token back", "got Bearer <redacted> back"),
        ("connect postgresql://app:pw@db:5432/x failed", "connect postgresql://app:<redacted>@db:5432/x failed"),
        ('password=hunter2 api_key: "k-123"', 'password=<redacted> api_key: "<redacted>"'),
        # Prose that only names a secret word keeps every word.
        ("basic auth failed: unexpected token in JSON at 5", "basic auth failed: unexpected token in JSON at 5"),
        ("", ""),
    ],
)  # fmt: skip
def test_the_redaction_rule_in_free_text(text: str, expected: str) -> None:
    assert redaction.redact_text(text) == expected
    assert redaction.redact_text(expected) == expected  # idempotent
    assert redaction.error_for(Role.ADMIN, text) == text
    assert redaction.error_for(Role.VIEWER, text) == expected


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_redaction_keeps_the_shape_and_is_idempotent(value: Any) -> None:
    once = redaction.redact(value)
    assert redaction.redact(once) == once

    def same_shape(a: Any, b: Any) -> None:
        if isinstance(a, dict):
            assert isinstance(b, dict)
            assert list(a) == list(b)
            for key in a:
                if redaction.secret_key(key) and a[key] is not None:
                    assert b[key] == redaction.REDACTED
                else:
                    same_shape(a[key], b[key])
        elif isinstance(a, list):
            assert isinstance(b, list)
            assert len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                same_shape(x, y)
        elif not isinstance(a, str):
            assert a == b

    same_shape(value, once)


# -- bidirectional text ---------------------------------------------------------------------------


async def test_bidi_controls_are_shown_escaped(console: Console) -> None:
    spoof = "report\u202egpj.exe"
    job = await console.server.api.control.create_job(
        JobSpec(name="bidi-job", handler="test.echo", payload={"file": spoof, "isolate": "a\u2066b\u2069"})
    )
    async with console.client() as http:
        token = await login(http)
        async with http.get(f"/jobs/{job.id}") as page:
            body = await page.text()
        async with http.get(f"/jobs/{job.id}/edit") as page:
            form = await page.text()
        async with http.post(
            "/api-keys", data={"csrf": csrf_token(token), "display_name": "key\u202ename", "role": "viewer"}
        ) as page:
            keys = await page.text()
    for text in (body, form, keys):
        assert not any(c in text for c in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f")
    assert "report\\u202Egpj.exe" in body
    assert "key\\u202Ename" in keys
    # In the edit form, the escape is the same JSON: saving it unchanged keeps the character.
    match = re.search(r'<textarea name="payload"[^>]*>(.*?)</textarea>', form, re.S)
    assert match is not None
    import html

    assert orjson.loads(html.unescape(match.group(1)))["file"] == spoof
    assert visible("\u200f") == "\\u200F"


async def test_an_error_search_finds_no_run_by_a_secret_it_cannot_read(console: Console, pool: asyncpg.Pool) -> None:
    """Searching error text is no oracle for credentials: below admin the search looks at the error as
    the caller reads it (redacted), on the executions page and the dead-letter search alike."""
    echo = await console.server.api.control.create_job(JobSpec(name="leaky", handler="test.echo"))
    run = await console.server.api.control.trigger_execution(echo.id)
    await pool.execute(
        "UPDATE job_executions SET status = 'dead', finished_at = now(), error = $1 WHERE id = $2",
        "login refused: password=hunter2secret for deploy",
        run.id,
    )
    for role, finds_secret in [(Role.VIEWER, False), (Role.OPERATOR, False), (Role.ADMIN, True)]:
        async with console.client() as http:
            token = await console.session_for(f"user-{role.value}", role)
            http.cookie_jar.update_cookies({"scheduler_session": token})
            for path in ("/executions?error=", "/dead-letters?error="):
                async with http.get(path + "hunter2") as page:
                    assert page.status == 200
                    assert (run.run_id in await page.text()) is finds_secret, (role, path)
                async with http.get(path + "login refused") as page:  # what it can read is found
                    assert run.run_id in await page.text(), (role, path)
