"""The console's job form (every field of the API, edits that change only what they changed, the
schedule kind following what was filled), names where ids were, 404s, and the flow pages, over
HTTP against a real in-process server (real Redis and PostgreSQL; no scheduler or worker runs, so a
flow run stays where its root run left it)."""

from __future__ import annotations

import re
from dataclasses import replace
from html import unescape

import aiohttp
import asyncpg
import pytest

from scheduler_grpc.console.security import csrf_token
from scheduler_grpc.flows import TriggerRule
from scheduler_grpc.jobs import JobSpec, ScheduleKind
from tests.test_console import Console, login
from tests.test_console import console as console  # noqa: PLC0414 (the fixture, shared)

FROM_PAYLOAD = {"rows": {"$from": "extract.result.rows"}, "mode": "append"}


async def _flow(console: Console) -> tuple[str, str, str]:
    """extract -> transform -> load, and extract -> load (all_done, a `$from` payload)."""
    control = console.server.api.control
    extract = await control.create_job(JobSpec(name="extract", handler="test.echo"))
    transform = await control.create_job(JobSpec(name="transform", handler="test.echo", depends_on=("extract",)))
    load = await control.create_job(
        JobSpec(
            name="load",
            handler="test.echo",
            payload=FROM_PAYLOAD,
            depends_on=("transform", "extract"),
            trigger_rule=TriggerRule.ALL_DONE,
        )
    )
    return extract.id, transform.id, load.id


def _form_fields(html: str) -> dict[str, str]:
    """The fields a browser would submit from the job form as rendered (inputs, selects, textarea)."""
    fields: dict[str, str] = {}
    for tag in re.findall(r"<input [^>]*>", html):
        name = re.search(r'name="([^"]+)"', tag)
        if name is None:
            continue
        kind = re.search(r'type="([^"]+)"', tag)
        if kind and kind.group(1) == "checkbox":
            if " checked" in tag:
                fields[name.group(1)] = "on"
            continue
        value = re.search(r'value="([^"]*)"', tag)
        fields[name.group(1)] = unescape(value.group(1)) if value else ""
    for name, body in re.findall(r'<select name="([^"]+)"[^>]*>(.*?)</select>', html, re.S):
        chosen = re.search(r"<option selected>([^<]*)</option>", body) or re.search(r"<option>([^<]*)</option>", body)
        fields[name] = unescape(chosen.group(1)) if chosen else ""
    for name, body in re.findall(r'<textarea name="([^"]+)"[^>]*>(.*?)</textarea>', html, re.S):
        fields[name] = unescape(body).replace("\n", "\r\n")  # as a browser submits a textarea
    return fields


async def test_an_unchanged_edit_of_a_flow_job_keeps_its_upstreams_rule_and_from_payload(console: Console) -> None:
    extract_id, transform_id, load_id = await _flow(console)
    async with console.client() as http:
        await login(http)
        async with http.get(f"/jobs/{load_id}/edit") as page:
            assert page.status == 200
            form = _form_fields(await page.text())
        assert form["depends_on"] == "transform, extract"
        assert form["trigger_rule"] == "all_done"
        async with http.post(f"/jobs/{load_id}", data=form, allow_redirects=False) as saved:
            assert saved.status == 303, await saved.text()
    job = await console.server.api.control.get_job(load_id)
    assert job.depends_on == (transform_id, extract_id)
    assert job.trigger_rule is TriggerRule.ALL_DONE
    assert job.payload == FROM_PAYLOAD


async def test_an_edit_changes_only_the_fields_it_changed(console: Console) -> None:
    extract_id, _, load_id = await _flow(console)
    async with console.client() as http:
        await login(http)
        async with http.get(f"/jobs/{load_id}/edit") as page:
            form = _form_fields(await page.text())
        # A change of priority, and of the upstreams (by name) with the rule.
        form.update({"priority": "7", "depends_on": "extract", "trigger_rule": "any_failed"})
        form["payload"] = '{"rows": {"$from": "extract.result.rows"}}'
        async with http.post(f"/jobs/{load_id}", data=form, allow_redirects=False) as saved:
            assert saved.status == 303, await saved.text()
    job = await console.server.api.control.get_job(load_id)
    assert (job.priority, job.depends_on, job.trigger_rule) == (7, (extract_id,), TriggerRule.ANY_FAILED)
    assert job.payload == {"rows": {"$from": "extract.result.rows"}}
    assert job.retry.jitter is True
    assert job.queue == "default"


async def test_a_stale_edit_form_is_refused_not_merged(console: Console) -> None:
    _, _, load_id = await _flow(console)
    async with console.client() as http:
        await login(http)
        async with http.get(f"/jobs/{load_id}/edit") as page:
            form = _form_fields(await page.text())
        await console.server.api.control.merge_job(load_id, lambda job: replace(job, priority=3))
        form["priority"] = "9"
        async with http.post(f"/jobs/{load_id}", data=form, allow_redirects=False) as saved:
            assert saved.status == 409
    assert (await console.server.api.control.get_job(load_id)).priority == 3


async def test_a_cron_typed_without_a_kind_makes_a_cron_job(console: Console) -> None:
    async with console.client() as http:
        token = await login(http)
        async with http.get("/jobs/new") as page:
            form = _form_fields(await page.text())
        assert form["schedule_kind"] == "auto"  # the new form's default: the kind follows what is filled
        form.update({"name": "typed-cron", "handler": "test.echo", "cron": "*/5 * * * *", "csrf": csrf_token(token)})
        async with http.post("/jobs", data=form, allow_redirects=False) as saved:
            assert saved.status == 303, await saved.text()
            job_id = saved.headers["Location"].rsplit("/", 1)[-1]
    job = await console.server.api.control.get_job(job_id)
    assert (job.schedule_kind, job.cron) == (ScheduleKind.CRON, "*/5 * * * *")
    assert job.next_run_time is not None


@pytest.mark.parametrize(
    ("kind", "filled", "field"),
    [("manual", {"cron": "*/5 * * * *"}, "cron"), ("cron", {"cron": "* * * * *", "run_at": "2031-01-01T00:00:00Z"},
                                                   "run_at"), ("once", {"cron": "* * * * *"}, "cron")],
)  # fmt: skip
async def test_a_field_the_chosen_kind_cannot_use_is_refused_under_it(
    console: Console, kind: str, filled: dict[str, str], field: str
) -> None:
    async with console.client() as http:
        token = await login(http)
        data = {"name": f"kind-{kind}", "handler": "test.echo", "schedule_kind": kind, "csrf": csrf_token(token)}
        async with http.post("/jobs", data={**data, **filled}, allow_redirects=False) as refused:
            assert refused.status == 400
            body = await refused.text()
    assert re.search(rf'<span class="field-error" data-field="{field}">[^<]*kind', body), body
    with pytest.raises(Exception, match="not found"):
        await console.server.api.control.get_job_by_name(f"kind-{kind}")


async def test_unknown_paths_are_404_and_the_favicon_is_served(console: Console) -> None:
    async with console.client() as http:
        async with http.get("/favicon.ico") as icon:
            assert icon.status == 200
            assert icon.headers["Content-Type"].startswith("image/svg+xml")
            assert b"<svg" in await icon.read()
        async with http.get("/no/such/page", allow_redirects=False) as anonymous:
            assert anonymous.status == 404
        await login(http)
        for path in ("/no/such/page", "/jobs/x/y/z", "/favicon.png"):
            async with http.get(path, allow_redirects=False) as missing:
                assert missing.status == 404, path
                assert "Content-Security-Policy" in missing.headers


async def test_the_executions_filter_takes_a_job_name(console: Console, pool: asyncpg.Pool) -> None:
    control = console.server.api.control
    job = await control.create_job(JobSpec(name="named-runs", handler="test.echo"))
    other = await control.create_job(JobSpec(name="other-runs", handler="test.echo"))
    mine = await control.trigger_execution(job.id)
    theirs = await control.trigger_execution(other.id)
    async with console.client() as http:
        await login(http)
        async with http.get("/executions", params={"job": "named-runs"}) as page:
            assert page.status == 200, await page.text()
            body = await page.text()
        assert f'data-execution="{mine.id}"' in body
        assert f'data-execution="{theirs.id}"' not in body
        async with http.get("/executions", params={"job": "no-such-job"}) as missing:
            assert missing.status == 404
            assert "no-such-job" in await missing.text()


async def test_live_events_carry_the_job_name_and_trigger(console: Console) -> None:
    job = await console.server.api.control.create_job(JobSpec(name="live-named", handler="test.echo"))
    async with console.client() as http:
        token = await login(http)
        async with http.get(f"/events?job={job.id}", timeout=aiohttp.ClientTimeout(total=20)) as stream:
            data = ""
            async for raw in stream.content:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: hello"):
                    async with http.post(f"/jobs/{job.id}/trigger", data={"csrf": csrf_token(token)}) as reply:
                        assert reply.status == 200
                if line.startswith("data: ") and '"created"' in line:
                    data = line
                    break
    assert '"job_name":"live-named"' in data
    assert '"trigger":"manual"' in data


async def test_the_job_page_lists_upstreams_downstreams_and_the_rule(console: Console) -> None:
    extract_id, transform_id, load_id = await _flow(console)
    async with console.client() as http:
        await login(http)
        async with http.get(f"/jobs/{transform_id}") as page:
            body = await page.text()
    upstreams = re.search(r'<td id="upstreams">(.*?)</td>', body, re.S)
    downstreams = re.search(r'<td id="downstreams">(.*?)</td>', body, re.S)
    assert upstreams
    assert downstreams
    assert f'href="/jobs/{extract_id}"' in upstreams.group(1)
    assert "extract" in upstreams.group(1)
    assert f'href="/jobs/{load_id}"' in downstreams.group(1)
    assert "all_done" in downstreams.group(1)
    assert re.search(r'<td id="trigger-rule">all_succeeded', body)


async def test_a_flow_run_page_draws_every_node_and_links_from_its_executions(console: Console) -> None:
    control = console.server.api.control
    extract_id, transform_id, load_id = await _flow(console)
    root = await control.trigger_execution(extract_id)
    async with console.client() as http:
        await login(http)
        async with http.get(f"/flows/{root.run_id}") as page:
            assert page.status == 200, await page.text()
            body = await page.text()
        # The DAG: one node per job with its state (the root queued, the others waiting), and edges.
        states = dict(
            re.findall(r'<a href="[^"]+" class="node n-[a-z_]+" data-job="([^"]+)"[^>]*data-state="([a-z_]+)"', body)
        )
        assert states == {extract_id: "queued", transform_id: "pending", load_id: "pending"}
        assert body.count('class="edge') == 3
        assert 'id="flow-state"' in body
        assert "s-running" in body
        async with http.get(f"/flows/{root.run_id}/graph") as fragment:
            assert 'id="dag"' in await fragment.text()
        async with http.get(f"/executions/{root.id}") as execution:
            assert f'href="/flows/{root.run_id}"' in await execution.text()
        for query in ({}, {"job": "extract"}, {"state": "running"}, {"job": extract_id}):
            async with http.get("/flows", params=query) as listing:
                assert listing.status == 200
                assert f'data-flow="{root.run_id}"' in await listing.text(), query
        for query in ({"state": "succeeded"}, {"job": "load"}):
            async with http.get("/flows", params=query) as listing:
                assert f'data-flow="{root.run_id}"' not in await listing.text(), query
        async with http.get("/flows", params={"state": "sideways"}) as bad:
            assert bad.status == 400


async def test_a_200_node_flow_is_listed_with_its_counts(console: Console) -> None:
    control = console.server.api.control
    root = await control.create_job(JobSpec(name="fan-root", handler="test.echo"))
    for index in range(199):
        await control.create_job(JobSpec(name=f"fan-{index:03d}", handler="test.echo", depends_on=("fan-root",)))
    run = await control.trigger_execution(root.id)
    view = await control.flow_reads.flow_run_view(run.run_id)
    assert len(view.nodes) == 200
    rows = await control.flow_reads.list_flow_runs(root_job_id=root.id, limit=10)
    assert [(row.id, row.nodes, row.finished_nodes, row.root_job_name) for row in rows] == [
        (run.run_id, 200, 0, "fan-root")
    ]
