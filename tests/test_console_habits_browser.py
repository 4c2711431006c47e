"""The console's bulk actions and everyday habits in headless Chromium, against the real `up`
topology of test_console_browser (its fixtures): a bulk cancel of 100 runs by filter, the 390 px
layout without horizontal scroll, the dark theme when the browser prefers it, flash messages and
relative times."""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest
import uvloop

from tests.test_console_browser import (  # noqa: F401 - fixtures
    CHROMIUM,
    TIMEOUT_MS,
    Topology,
    admin,
    browser,
    close_tab,
    close_tabs,
    create_job,
    log_in,
    page,
    shot,
    topology,
)

if CHROMIUM is None:  # pragma: no cover - test_console_browser skips the module first
    pytest.skip("no chromium", allow_module_level=True)

from playwright.sync_api import Browser, BrowserContext, Page, expect

MAIN_PAGES = ("/", "/jobs", "/executions", "/workers", "/dead-letters", "/charts", "/api-keys")


def _fetchval(database_url: str, sql: str, *args: Any) -> Any:
    async def run() -> Any:
        conn = await asyncpg.connect(database_url)
        try:
            return await conn.fetchval(sql, *args)
        finally:
            await conn.close()

    # In a thread of its own: Playwright's sync API keeps an event loop running on this one.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(uvloop.run, run()).result()


def test_bulk_cancel_of_100_runs_by_filter(page: Page, topology: Topology, database_url: str) -> None:  # noqa: F811
    # A queue no worker serves: the runs stay queued until the bulk cancel.
    job_id = create_job(page, topology, "bulk-parked", "test.echo", queue="parked")
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    assert csrf
    for _ in range(100):
        reply = page.request.post(
            f"{topology.url}/jobs/{job_id}/trigger", form={"csrf": csrf}, max_redirects=0, timeout=TIMEOUT_MS
        )
        assert reply.status == 303, reply.text()
    other = create_job(page, topology, "bulk-kept", "test.echo", queue="parked")
    page.request.post(f"{topology.url}/jobs/{other}/trigger", form={"csrf": csrf}, max_redirects=0)

    page.goto(f"{topology.url}/executions?job_name=bulk-parked&state=queued")
    expect(page.locator("#executions tbody tr")).to_have_count(50)  # one page of the 100
    page.select_option("#bulk-action", "cancel")
    page.click("#bulk-filter")
    expect(page.locator("#bulk-question")).to_contain_text("Cancel the runs of 100 executions matching")
    expect(page.locator("#bulk-confirm")).to_have_text("Cancel 100")
    shot(page, "bulk-confirm")
    assert _fetchval(database_url, "SELECT count(*) FROM job_executions WHERE status = 'cancelled'") == 0
    page.click("#bulk-confirm")
    expect(page.locator("#flash")).to_have_text("100 runs cancelled")
    expect(page.locator("#no-executions")).to_be_visible()  # nothing queued matches any more
    shot(page, "bulk-cancelled")
    cancelled = (
        "SELECT count(*) FROM job_executions e JOIN jobs j ON j.id = e.job_id WHERE j.name = $1 AND e.status = $2"
    )
    assert _fetchval(database_url, cancelled, "bulk-parked", "cancelled") == 100
    assert _fetchval(database_url, cancelled, "bulk-kept", "queued") == 1


def test_selected_jobs_paused_with_a_flash_and_relative_times(page: Page, topology: Topology) -> None:  # noqa: F811
    ids = [
        create_job(page, topology, f"sel-{n}", "test.echo", schedule_kind="cron", cron="*/5 * * * *") for n in range(3)
    ]
    page.goto(f"{topology.url}/jobs?q=sel-")
    for job_id in ids[:2]:
        page.check(f"input[name=id][value='{job_id}']")
    page.select_option("#bulk-action", "pause")
    page.click("#bulk-selected")
    expect(page.locator("#bulk-question")).to_have_text("Pause the 2 selected jobs?")
    page.click("#bulk-confirm")
    expect(page.locator("#flash")).to_have_text("2 jobs paused")
    for job_id, state in zip(ids, ["paused", "paused", "active"], strict=True):
        expect(page.locator(f"tr[data-job='{job_id}'] td.state")).to_have_text(state)
    # The next run of the active job is relative, with the exact time on hover.
    moment = page.locator(f"tr[data-job='{ids[2]}'] time")
    expect(moment).to_have_text(re.compile(r"^in \d+ (s|min)$|^now$"))
    expect(moment).to_have_attribute("title", re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$"))
    # Single actions say what they did too.
    page.goto(f"{topology.url}/jobs/{ids[2]}")
    page.click("form[action$='/pause'] button")
    expect(page.locator("#flash")).to_have_text("Job paused")


@pytest.fixture
def phone(browser: Browser, topology: Topology) -> Iterator[BrowserContext]:  # noqa: F811
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    context.set_default_timeout(TIMEOUT_MS)
    try:
        close_tab(log_in(context, topology))
        yield context
    finally:
        close_tabs(context)


def test_no_horizontal_scroll_at_390_px_and_the_navigation_folds(phone: BrowserContext, topology: Topology) -> None:  # noqa: F811
    tab = phone.new_page()
    for path in MAIN_PAGES:
        tab.goto(f"{topology.url}{path}")
        widths = tab.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert widths[0] <= widths[1], (path, widths)
    shot(tab, "phone-charts")
    tab.goto(f"{topology.url}/executions")
    expect(tab.locator("#nav")).to_be_hidden()
    tab.click("#nav-toggle")
    expect(tab.locator("#nav")).to_be_visible()
    tab.click("#nav a[href='/jobs']")
    expect(tab.locator("h1")).to_have_text("Jobs")
    shot(tab, "phone-jobs")


@pytest.mark.parametrize(("scheme", "dark"), [("dark", True), ("light", False)])
def test_the_theme_follows_the_browser_preference(
    browser: Browser,  # noqa: F811
    topology: Topology,  # noqa: F811
    scheme: str,
    dark: bool,
) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme=scheme)  # type: ignore[arg-type]
    context.set_default_timeout(TIMEOUT_MS)
    try:
        tab = log_in(context, topology)
        tab.wait_for_load_state("load")  # the stylesheet too: the heading shows before it applies
        background = tab.evaluate("getComputedStyle(document.body).backgroundColor")
        red, green, blue = (int(part) for part in re.findall(r"\d+", background)[:3])
        assert (red + green + blue < 150) is dark, background
        tab.goto(f"{topology.url}/jobs")
        table = tab.evaluate("getComputedStyle(document.querySelector('table')).backgroundColor")
        assert (sum(int(part) for part in re.findall(r"\d+", table)[:3]) < 200) is dark, table
        shot(tab, f"theme-{scheme}")
        icon = tab.request.get(f"{topology.url}/static/favicon.svg")
        assert icon.status == 200
        assert icon.headers["content-type"].startswith("image/svg+xml")
    finally:
        close_tabs(context)
