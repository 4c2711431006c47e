"""The console with remote workers (issue 23): the Workers page shows them beside the in-process
ones (handlers, slots, SDK, queue, a `remote` marker), and the job form offers their handlers with
this server's, takes one no worker serves yet as free text, and shows the API's errors under their
field. Real server, real stores; the remote worker is the Python SDK over `WorkerService.Connect`,
the in-process one the server's own `Worker`."""

from __future__ import annotations

import asyncio
import contextlib
import html
import os
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import asyncpg
import pytest
from redis.asyncio import Redis
from scheduler_client import __version__ as sdk_version
from scheduler_client.worker import ExecutionContext
from scheduler_client.worker import Worker as SdkWorker

from scheduler_grpc.auth import Principal, Role
from scheduler_grpc.console.security import csrf_token
from scheduler_grpc.db.history import HistoryRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.errors import NotFound
from scheduler_grpc.handlers import HandlerSettings, default_registry
from scheduler_grpc.jobs import JobSpec
from scheduler_grpc.worker import Worker
from tests.engine_helpers import eventually, make_settings
from tests.test_console import Console, login, running_console

QUEUE = "remote"


@pytest.fixture
async def console(redis_url: str, database_url: str, redis: Redis, pool: asyncpg.Pool) -> AsyncIterator[Console]:
    async with running_console(redis_url, database_url, pool) as running:
        yield running


@contextlib.asynccontextmanager
async def remote_worker(console: Console, *handlers: str, slots: int = 4) -> AsyncIterator[SdkWorker]:
    """A Python SDK worker serving `handlers` on the remote queue, connected (welcomed)."""
    creator = Principal("test", Role.ADMIN, "api_key", "test", b"")
    key = (await console.server.api.auth.create_api_key(creator, "worker-key", Role.WORKER, None)).secret
    worker = SdkWorker(console.server.address, key, queue=QUEUE, slots=slots, reconnect_max=1.0)

    async def run(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        return payload

    for name in handlers:
        worker.handler(name, description=f"{name} for tests")(run)
    task = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(10):
            await worker.connected.wait()
        yield worker
    finally:
        worker.stop()
        async with asyncio.timeout(15):
            await task


@contextlib.asynccontextmanager
async def in_process_worker(console: Console, redis_url: str, database_url: str, redis: Redis) -> AsyncIterator[str]:
    """The server's own kind of worker (its handlers, the default queue), running; its id."""
    pool = console.server.api.control._pool
    registry = default_registry(HandlerSettings(dev_mode=True))
    worker = Worker(
        redis, RunRepository(pool), registry, make_settings(redis_url, database_url),
        history=HistoryRepository(pool), worker_id="host:1:in-process", concurrency=3,
    )  # fmt: skip
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        yield worker.id
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
        await registry.aclose()


async def page(http: aiohttp.ClientSession, path: str) -> str:
    async with http.get(path) as reply:
        assert reply.status == 200, path
        return await reply.text()


def row(body: str, kind: str) -> str:
    """The Workers page's row of the (one) worker of `kind` (`remote` or `in-process`)."""
    rows = re.findall(rf'<tr data-worker="[^"]+" data-kind="{kind}">.*?</tr>', body, re.S)
    assert len(rows) == 1, body
    return str(rows[0])


async def test_the_workers_page_shows_remote_workers_with_handlers_slots_and_sdk(
    console: Console, redis_url: str, database_url: str, redis: Redis
) -> None:
    async with console.client() as http, in_process_worker(console, redis_url, database_url, redis) as local_id:
        await login(http)
        async with remote_worker(console, "acme.sync", "acme.report", slots=4) as sdk:

            async def both_listed() -> str:
                body = await page(http, "/workers")
                return body if 'data-kind="remote"' in body and 'data-kind="in-process"' in body else ""

            body = await eventually(both_listed, within=10)
            remote = row(body, "remote")
            assert f'data-worker="{sdk.worker_id}"' in remote  # the id the server welcomed it with
            assert '<span class="tag remote">remote</span>' in remote
            assert '<td class="queue">remote</td>' in remote
            assert '<td class="slots">0 / 4</td>' in remote
            assert "<code>acme.sync</code>" in remote
            assert "<code>acme.report</code>" in remote
            assert f'<td class="sdk">scheduler-client-python/{sdk_version}</td>' in remote
            assert "/ 0</td>" not in remote  # a remote worker has no pid of ours: its host only
            local = row(body, "in-process")
            assert f'data-worker="{local_id}"' in local
            assert '<td class="kind">in-process</td>' in local
            assert f"/ {os.getpid()}</td>" in local
            assert '<td class="queue">default</td>' in local
            assert '<td class="slots">0 / 3</td>' in local
            assert "<code>test.echo</code>" in local
            assert '<td class="sdk">—</td>' in local
            assert "2 live: 1 in-process, 1 remote" in body
            # The page shows what ListWorkers (the same ClusterView) lists, no more.
            listed = {w.id: w.remote for w in await console.server.api.cluster.workers()}
            assert listed == {sdk.worker_id: True, local_id: False}
            assert '<span id="remote-workers">1 remote</span>' in await page(http, "/")

        # Its stream ended: it leaves the page, the in-process worker stays.
        async def remote_gone() -> bool:
            return 'data-kind="remote"' not in await page(http, "/workers")

        await eventually(remote_gone, within=10)
        assert f'data-worker="{local_id}"' in await page(http, "/workers")
        assert 'id="remote-workers"' not in await page(http, "/")


def field_error(body: str, field: str) -> str:
    """The text of the error shown under form field `field` ("" if none)."""
    match = re.search(rf'<span class="field-error" data-field="{re.escape(field)}">([^<]*)</span>', body)
    return html.unescape(match.group(1)) if match else ""


def input_value(body: str, field_id: str) -> str:
    match = re.search(rf'<input name="[^"]+" id="{field_id}" [^>]*value="([^"]*)"', body)
    assert match, body
    return html.unescape(match.group(1))


async def test_the_job_form_offers_remote_handlers_and_free_text_with_the_apis_errors(console: Console) -> None:
    control = console.server.api.control
    async with console.client() as http:
        token = await login(http)
        csrf = csrf_token(token)
        new = await page(http, "/jobs/new")
        # Free text with suggestions: this server's handlers; no remote worker is connected yet.
        assert re.search(r'<input name="handler" id="f-handler" list="handler-choices"', new), new
        assert re.search(r'<option value="test.echo" label="this server\'s[^"]*"></option>', new), new
        assert '<code data-handler="test.echo">test.echo</code>' in new
        assert re.search(r'id="handlers-remote">.*?none connected', new, re.S), new

        async def post(path: str, form: dict[str, str]) -> tuple[int, str, str]:
            async with http.post(path, data={"csrf": csrf, **form}, allow_redirects=False) as reply:
                return reply.status, reply.headers.get("Location", ""), await reply.text()

        # A remote handler on the in-process workers' queue: the API's `job.queue` error, under Queue.
        status, _, body = await post("/jobs", {"name": "sync", "handler": "acme.sync", "queue": "default"})
        assert status == 400
        assert "in-process workers' queue" in field_error(body, "queue"), body
        assert not field_error(body, "handler")
        assert (input_value(body, "f-handler"), input_value(body, "f-queue")) == ("acme.sync", "default")
        with pytest.raises(NotFound):
            await control.get_job_by_name("sync")
        # A name breaking the naming rule is no handler at all: under Handler.
        status, _, body = await post("/jobs", {"name": "sync", "handler": "Acme Sync", "queue": QUEUE})
        assert status == 400
        assert "naming rule" in field_error(body, "handler"), body
        assert input_value(body, "f-handler") == "Acme Sync"  # what was typed is kept
        # A handler no worker serves yet, on a queue of its own: created, and the job page says so.
        status, location, _ = await post("/jobs", {"name": "sync", "handler": "acme.sync", "queue": QUEUE})
        assert status == 303, location
        job = await control.get_job_by_name("sync")
        assert (job.handler, job.queue) == ("acme.sync", QUEUE)
        assert location == f"/jobs/{job.id}"
        assert 'id="handler-not-served"' in await page(http, location)

        async with remote_worker(console, "acme.sync", "acme.report"):
            # The form now offers the remote worker's handlers, with the queue they are served on.
            async def offered() -> str:
                body = await page(http, "/jobs/new")
                return body if '<code data-handler="acme.sync">' in body else ""

            new = await eventually(offered, within=10)
            assert '<option value="acme.sync" label="remote, queue remote"></option>' in new
            assert '<option value="acme.report" label="remote, queue remote"></option>' in new
            assert re.search(r'id="handlers-remote">.*<code data-handler="acme.report">acme.report</code> on '
                             r'<code data-queue="remote">remote</code> \(1 worker\)', new, re.S), new  # fmt: skip
            assert re.search(r'<datalist id="queue-choices">\s*<option value="default"></option>'
                             r'<option value="remote"></option>', new), new  # fmt: skip
            assert 'id="handler-not-served"' not in await page(http, location)

            # The edit form shows the job's remote handler as it is, and an edit may change it.
            edit = await page(http, f"/jobs/{job.id}/edit")
            assert input_value(edit, "f-handler") == "acme.sync"
            status, _, _ = await post(f"/jobs/{job.id}", {"version": str(job.version), "handler": "acme.report"})
            assert status == 303
            assert (await control.get_job(job.id)).handler == "acme.report"

        # A built-in job moved to a remote handler on the in-process queue: `job.queue`, nothing stored.
        echo = await control.create_job(JobSpec(name="echo", handler="test.echo"))
        status, _, body = await post(f"/jobs/{echo.id}", {"version": str(echo.version), "handler": "acme.sync"})
        assert status == 400
        assert "in-process workers' queue" in field_error(body, "queue"), body
        assert input_value(body, "f-handler") == "acme.sync"
        assert (await control.get_job(echo.id)).handler == "test.echo"
        # An error on a part of a field (`depends_on[0]`) is shown under that field, naming the part.
        status, _, body = await post("/jobs", {"name": "loop", "handler": "test.echo", "depends_on": "loop"})
        assert status == 400
        assert field_error(body, "depends_on").startswith("depends_on[0]: would create a cycle"), body
