"""The console's job form and flow pages in headless Chromium against the real `up` topology (the
harness of tests/test_console_browser.py: a server, a scheduler and a worker): an unchanged save of
a flow job keeps it whole, a typed cron makes a cron job, and a flow run page draws the DAG with
every node's state, live."""

from __future__ import annotations

import re

from tests.test_console_browser import (
    BrowserContext,
    Page,
    Topology,
    admin,
    browser,
    close_tab,
    create_job,
    expect,
    page,
    shot,
    topology,
)

__all__ = ["admin", "browser", "page", "topology"]  # the harness's fixtures, used by name below


def test_an_unchanged_save_of_a_flow_job_keeps_its_upstreams_rule_and_from_payload(
    page: Page, topology: Topology
) -> None:
    create_job(page, topology, "extract", "test.echo")
    load_id = create_job(
        page,
        topology,
        "load",
        "test.echo",
        payload='{"rows": {"$from": "extract.result.rows"}}',
        depends_on="extract",
        trigger_rule="all_done",
    )
    expect(page.locator("#upstreams")).to_have_text("extract")
    page.goto(f"{topology.url}/jobs/{load_id}/edit")
    expect(page.locator("#f-depends_on")).to_have_value("extract")
    expect(page.locator("#f-trigger_rule")).to_have_value("all_done")
    shot(page, "flow-job-edit")
    page.click("#save")  # nothing changed
    expect(page.locator("#job-name")).to_have_text("load")
    expect(page.locator("#upstreams")).to_have_text("extract")
    expect(page.locator("#trigger-rule")).to_have_text("all_done")
    expect(page.locator("pre").first).to_contain_text('"$from": "extract.result.rows"')


def test_a_cron_typed_into_the_new_form_makes_a_cron_job(page: Page, topology: Topology) -> None:
    page.goto(f"{topology.url}/jobs/new")
    expect(page.locator("#f-schedule_kind")).to_have_value("auto")
    page.fill("#f-name", "typed-cron")
    page.fill("#f-handler", "test.echo")
    page.locator("#f-cron").press_sequentially("*/5 * * * *", delay=10)
    expect(page.locator("#preview-list li")).to_have_count(10)
    page.click("#save")
    expect(page.locator("#job-name")).to_have_text("typed-cron")
    expect(page.locator(".definition")).to_contain_text("*/5 * * * *")
    # A kind chosen as manual follows the cron typed after it (the form shows it), never dropping it.
    page.goto(f"{topology.url}/jobs/new")
    page.fill("#f-name", "typed-cron-manual")
    page.fill("#f-handler", "test.echo")
    page.select_option("#f-schedule_kind", "manual")
    page.locator("#f-cron").press_sequentially("0 9 * * *", delay=10)
    expect(page.locator("#f-schedule_kind")).to_have_value("cron")
    expect(page.locator("#preview-list")).to_have_attribute("data-cron", "0 9 * * *")  # Save has moved (create_job)
    page.click("#save")
    expect(page.locator(".definition")).to_contain_text("0 9 * * *")


def test_a_flow_run_page_shows_the_dag_with_every_nodes_state(
    page: Page, admin: BrowserContext, topology: Topology
) -> None:
    page.on("dialog", lambda dialog: dialog.accept())
    root = create_job(page, topology, "dag-root", "test.echo", payload='{"rows": 3}')
    create_job(page, topology, "dag-left", "test.echo", depends_on="dag-root")
    create_job(
        page, topology, "dag-broken", "test.fail", payload='{"fail_attempts": 5}', depends_on="dag-root",
        **{"retry_policy.max_retries": "0"},
    )  # fmt: skip
    create_job(page, topology, "dag-after-broken", "test.echo", depends_on="dag-broken")
    create_job(page, topology, "dag-cleanup", "test.echo", depends_on="dag-left, dag-broken", trigger_rule="all_done")
    page.goto(f"{topology.url}/jobs/{root}")
    expect(page.locator("#downstreams")).to_contain_text("dag-left")
    expect(page.locator("#downstreams")).to_contain_text("dag-broken")
    page.goto(f"{topology.url}/executions?job=dag-root")  # by name
    expect(page.locator("#live-indicator")).to_have_attribute("data-state", "connected")
    other = admin.new_page()
    other.goto(f"{topology.url}/jobs/{root}")
    other.click("#job-actions button.trigger")
    expect(other).to_have_url(re.compile(r"/executions\?job="))  # the trigger's redirect landed
    close_tab(other)
    # The live row (never reloaded) names the job and the trigger, not an id fragment and a blank.
    row = page.locator("#executions tbody tr").first
    expect(row.locator("td").nth(1)).to_have_text("dag-root")
    expect(row.locator("td").nth(4)).to_have_text("manual")
    row.locator("a").first.click()
    page.click("#flow-link a")
    expect(page).to_have_url(re.compile(r"/flows/[0-9a-f-]{36}$"))
    nodes = page.locator("svg#dag a.node")
    expect(nodes).to_have_count(5)
    # Live: the page is not reloaded while the flow run finishes.
    expect(page.locator("#flow-graph")).to_have_attribute("data-state", "failed")
    expected = {
        "dag-root": "succeeded",
        "dag-left": "succeeded",
        "dag-broken": "dead",
        "dag-after-broken": "upstream_failed",
        "dag-cleanup": "succeeded",
    }
    for name, state in expected.items():
        expect(page.locator(f"svg#dag a.node[data-name='{name}']")).to_have_attribute("data-state", state)
        expect(page.locator(f"#flow-nodes tr:has(a:text-is('{name}')) td.state")).to_have_text(state)
    expect(page.locator("svg#dag a.node[data-name='dag-broken'] title")).to_contain_text("fail")
    expect(page.locator("#flow-nodes tr:has(a:text-is('dag-broken')) .error-text")).not_to_be_empty()
    shot(page, "flow-run")
    page.goto(f"{topology.url}/flows?job=dag-root")
    expect(page.locator("#flow-runs tbody tr")).to_have_count(1)
    expect(page.locator("#flow-runs tbody tr td.state")).to_have_text("failed")
    expect(page.locator("#flow-runs tbody tr")).to_contain_text("5 / 5")
    shot(page, "flow-runs")
