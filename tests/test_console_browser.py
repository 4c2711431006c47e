"""The web console in a real browser (headless Chromium driven by Playwright) against the real `up`
topology: a supervisor with a server, a scheduler and a worker, on a Valkey of its own (so the last
test can stop it) and the session's PostgreSQL.

Chromium is Debian's `chromium` package (never `playwright install`): without it these tests skip,
except under CI=true, where a missing browser fails them. Each test saves a screenshot of its page
under .data/screenshots/.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import uvloop
from argon2 import PasswordHasher

from scheduler_grpc.embedded import EmbeddedRedis, ServerUrls
from scheduler_grpc.topology import READY_TIMEOUT_SECONDS
from tests.api_helpers import ADMIN_PASSWORD, free_port, metrics_base
from tests.conftest import CHROMIUM_GROUPS

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / ".data" / "screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWER = ("victor", "viewer-password-1")
TIMEOUT_MS = 20_000

if CHROMIUM is None:
    if os.environ.get("CI") == "true":
        pytest.fail("CI=true but no chromium on PATH (.ci/run installs Debian's chromium)", pytrace=False)
    pytest.skip("no chromium on PATH (apt-get install chromium)", allow_module_level=True)

from playwright.sync_api import Browser, BrowserContext, BrowserType, Page, expect, sync_playwright  # noqa: E402


@dataclass
class Topology:
    url: str
    redis: EmbeddedRedis
    process: subprocess.Popen[bytes]
    log: Path


def _sql(database_url: str, *statements: tuple[str, Any]) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            for sql, *args in statements:
                await conn.execute(sql, *args)
        finally:
            await conn.close()

    # In a thread of its own: Playwright's sync API keeps an event loop running on this one.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(uvloop.run, run()).result()


def _wait_for(check: Callable[[], bool], what: str, within: float = 90.0, log: Path | None = None) -> None:
    """Poll `check` until it holds; on a timeout, say what was awaited and the tail of `log`."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)  # polling an observable condition (the banner in a log file), not a sync sleep
    tail = "" if log is None else "\n" + log.read_text(errors="replace")[-4000:]
    raise AssertionError(f"timed out waiting for {what}{tail}")


@pytest.fixture(scope="module")
def topology(servers: ServerUrls, database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    data = tmp_path_factory.mktemp("console-up")
    redis = EmbeddedRedis(data / "valkey")
    redis.start()
    _sql(
        database_url,
        ("TRUNCATE job_executions, jobs, leader_state, api_keys, users CASCADE",),
        (
            "INSERT INTO users (username, password_hash, role) VALUES ($1, $2, 'viewer')",
            VIEWER[0],
            PasswordHasher().hash(VIEWER[1]),
        ),
    )
    http_port, grpc_port, metrics = free_port(), free_port(), metrics_base()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")},
        "REDIS_URL": redis.url,
        "DATABASE_URL": database_url,
        "SCHEDULER_DATA_DIR": str(data),
        "SCHEDULER_GRPC_PORT": str(grpc_port),
        "SCHEDULER_HTTP_PORT": str(http_port),
        "SCHEDULER_LEADER_TTL": "2s",
        "SCHEDULER_VISIBILITY_TIMEOUT": "5s",
        "SCHEDULER_SHUTDOWN_GRACE": "3s",
    }
    log = data / "up.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scheduler_grpc",
                "up",
                "--schedulers",
                "1",
                "--workers",
                "1",
                "--metrics-base",
                str(metrics),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=sink,
            start_new_session=True,
        )
    try:
        # `up` prints its banner anyway after READY_TIMEOUT_SECONDS: wait past it, for the log of why.
        _wait_for(
            lambda: b"scheduler-grpc is up" in log.read_bytes() or process.poll() is not None,
            "the banner",
            within=READY_TIMEOUT_SECONDS + 10,
            log=log,
        )
        banner = log.read_text(errors="replace")
        assert process.poll() is None, banner[-3000:]
        assert "roles not ready yet" not in banner, banner[-3000:]
        match = re.search(r"web console:\s+(\S+)", banner)
        assert match is not None, banner[-3000:]
        assert match.group(1) == f"http://127.0.0.1:{http_port}/"
        yield Topology(match.group(1).rstrip("/"), redis, process, log)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        redis.stop()


@contextlib.contextmanager
def chromium(browser_type: BrowserType, *flags: str) -> Iterator[Browser]:
    """Debian's Chromium, launched by Playwright (its flags, its bounded launch) and killed, never
    closed: Browser.close has no timeout and can wait forever on a tab's close that meets a navigation
    commit (crbug.com/536385539, Playwright issue 42366), where SIGKILL to the browser's process group
    (Playwright starts it in one of its own) cannot wait. While it runs, the group is in
    CHROMIUM_GROUPS, for the watchdog of tests/conftest.py; Playwright's driver reaps it."""
    launched = browser_type.launch(executable_path=CHROMIUM, headless=True, args=[*CHROMIUM_FLAGS, *flags])
    cdp = launched.new_browser_cdp_session()
    processes = cdp.send("SystemInfo.getProcessInfo")["processInfo"]
    cdp.detach()
    group = os.getpgid(next(process["id"] for process in processes if process["type"] == "browser"))
    assert group != os.getpgrp(), "Chromium shares pytest's process group"
    CHROMIUM_GROUPS.add(group)
    try:
        yield launched
    finally:
        CHROMIUM_GROUPS.discard(group)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright, chromium(playwright.chromium) as launched:
        yield launched


@pytest.fixture(scope="module")
def admin(browser: Browser, topology: Topology) -> Iterator[BrowserContext]:
    """The admin's browser session, logged in once for the module (argon2id costs a fraction of a second)."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(TIMEOUT_MS)
    try:
        close_tab(log_in(context, topology))
        yield context
    finally:
        close_tabs(context)


def close_tab(tab: Page) -> None:
    """Close a tab with no navigation in flight: Page.close has no timeout, and Chromium can ack a
    close that meets a navigation commit without closing (crbug.com/536385539, Playwright issue
    42366), as a CI run once waited 300 s on a tab closed during a trigger's redirect; a console
    page can also navigate itself (it reloads on an expired session). A finished navigation to
    about:blank (bounded by the default timeout) leaves nothing in flight, and about:blank starts
    nothing. Closed rather than left open: an open console tab keeps its live stream and its renderer
    busy for the rest of the module, on CI's loaded 2 cores. A tab the watchdog's kill of Chromium
    closed is left as it is: the test already failed on it."""
    if tab.is_closed():
        return
    tab.goto("about:blank")
    tab.close()


def close_tabs(context: BrowserContext) -> None:
    """Close every tab of a session by close_tab. The context itself, empty, is left for the module's
    Chromium to end with: BrowserContext.close has no timeout either, and an empty context holds no
    renderer."""
    for tab in context.pages:
        close_tab(tab)


@pytest.fixture
def page(admin: BrowserContext) -> Iterator[Page]:
    """A new tab of the admin's session; the test fails if the page broke its Content-Security-Policy."""
    tab = admin.new_page()
    messages: list[str] = []
    tab.on("console", lambda message: messages.append(message.text))
    try:
        yield tab
    finally:
        close_tab(tab)
    violations = [text for text in messages if "Content Security Policy" in text]
    assert violations == []


def shot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def log_in(
    context: BrowserContext, topology: Topology, username: str = "admin", password: str = ADMIN_PASSWORD
) -> Page:
    page = context.new_page()
    page.goto(f"{topology.url}/login")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    expect(page.locator("h1")).to_have_text("Overview")
    return page


def create_job(page: Page, topology: Topology, name: str, handler: str, **fields: str) -> str:
    page.goto(f"{topology.url}/jobs/new")
    page.fill("#f-name", name)
    page.fill("#f-handler", handler)
    for field, value in fields.items():
        locator = page.locator(f"#f-{field.replace('.', '-')}")
        if locator.evaluate("e => e.tagName") == "SELECT":
            locator.select_option(value)
        else:
            locator.fill(value)
    if "cron" in fields:
        # The preview's fire times land above Save and move it: clicked before they land, Save can
        # be missed (4 of 140 saves on a loaded machine), and the form is never sent.
        expect(page.locator("#preview-list")).to_have_attribute("data-cron", fields["cron"])
    page.click("#save")
    expect(page.locator("#job-name")).to_have_text(name)
    return page.url.rsplit("/", 1)[-1]


def test_log_in_and_create_a_cron_job_watching_the_preview(page: Page, topology: Topology) -> None:
    page.goto(f"{topology.url}/")  # the module's admin session logged in through the login form
    expect(page.locator("h1")).to_have_text("Overview")
    expect(page.locator("#leader")).to_contain_text("scheduler-1")  # `up` started one scheduler ...
    expect(page.locator("#standbys")).to_have_text("0 standbys")  # ... so none waits behind it
    shot(page, "overview")
    page.goto(f"{topology.url}/jobs/new")
    page.fill("#f-name", "nightly-report")
    page.fill("#f-handler", "test.echo")
    page.select_option("#f-schedule_kind", "cron")
    preview = page.locator("#preview-list")
    page.locator("#f-cron").press_sequentially("*/5 * * * *", delay=20)
    expect(preview).to_have_attribute("data-cron", "*/5 * * * *")
    expect(preview.locator("li")).to_have_count(10)
    # A typo shows the error on the preview, naming the field, before anything is saved.
    page.fill("#f-cron", "61 * * * *")
    expect(page.locator("#preview-error")).to_contain_text("cron")
    # March Sundays at 02:30 in Paris: the last one falls in the spring-forward gap.
    page.fill("#f-time_zone", "Europe/Paris")
    page.fill("#f-cron", "30 2 * 3 0")
    expect(preview).to_have_attribute("data-cron", "30 2 * 3 0")
    expect(preview.locator(".dst-shifted").first).to_be_visible()
    shot(page, "job-form-preview")
    page.fill("#f-payload", '{"report": "nightly"}')
    page.click("#save")
    expect(page.locator("#job-name")).to_have_text("nightly-report")
    expect(page.locator("#job-state")).to_have_text("active")
    page.goto(f"{topology.url}/jobs")
    expect(page.locator("#jobs tr[data-name=nightly-report]")).to_contain_text("30 2 * 3 0")
    shot(page, "jobs")


def test_trigger_and_watch_the_execution_succeed_live(page: Page, admin: BrowserContext, topology: Topology) -> None:
    job_id = create_job(page, topology, "echo-now", "test.echo", payload='{"hello": "world"}')
    page.goto(f"{topology.url}/executions?job={job_id}")
    expect(page.locator("#live-indicator")).to_have_attribute("data-state", "connected")
    expect(page.locator("#executions tbody tr")).to_have_count(0)
    # Trigger from another tab: this page is never reloaded.
    other = admin.new_page()
    other.goto(f"{topology.url}/jobs/{job_id}")
    other.click("#job-actions button.trigger")
    expect(other).to_have_url(re.compile(r"/executions\?job="))  # the trigger's redirect landed
    close_tab(other)
    row = page.locator("#executions tbody tr").first
    expect(row.locator("td.state")).to_have_text("succeeded")
    expect(row.locator("td.worker")).not_to_be_empty()
    shot(page, "executions-live")
    row.locator("a").first.click()
    attempts = page.locator("#attempts tbody tr")
    expect(attempts).to_have_count(1)
    expect(attempts.first).to_contain_text("succeeded")
    expect(attempts.first).to_contain_text('"hello": "world"')
    shot(page, "execution-attempts")


def test_pause_and_resume(page: Page, topology: Topology) -> None:
    job_id = create_job(page, topology, "pausable", "test.echo", schedule_kind="cron", cron="*/10 * * * *")
    page.click("#job-actions button.pause")
    expect(page.locator("#job-state")).to_have_text("paused")
    page.goto(f"{topology.url}/jobs?state=paused")
    expect(page.locator(f"#jobs tr[data-job='{job_id}'] td.state")).to_have_text("paused")
    page.goto(f"{topology.url}/jobs/{job_id}")
    page.click("#job-actions button.resume")
    expect(page.locator("#job-state")).to_have_text("active")
    shot(page, "job-resumed")


def test_a_failing_job_is_dead_lettered_and_requeued_from_the_page(page: Page, topology: Topology) -> None:
    page.on("dialog", lambda dialog: dialog.accept())  # the confirmation
    # Fails its first attempt only; no retry, so the run is dead-lettered at once.
    job_id = create_job(
        page, topology, "fails-once", "test.fail", payload='{"fail_attempts": 1}', **{"retry_policy.max_retries": "0"}
    )
    page.click("#job-actions button.trigger")
    row = page.locator("#executions tbody tr").first
    expect(row.locator("td.state")).to_have_text("dead")
    run_id = row.get_attribute("data-run")

    def listed() -> bool:
        page.goto(f"{topology.url}/dead-letters")
        return page.locator(f"#dead-letters tr[data-run='{run_id}']").count() == 1

    _wait_for(listed, "the run in the dead-letter page", within=20)
    page.check(f"#dead-letters tr[data-run='{run_id}'] input[type=checkbox]")
    shot(page, "dead-letters")
    page.click("#requeue-selected")
    expect(page.locator("#dead-notice")).to_have_text("requeued 1")
    page.goto(f"{topology.url}/executions?job={job_id}")
    expect(page.locator("#executions tbody tr").first.locator("td.state")).to_have_text("succeeded")
    page.locator("#executions tbody tr").first.locator("a").first.click()
    expect(page.locator("#attempts tbody tr")).to_have_count(2)
    expect(page.locator("#attempts tbody tr").nth(0)).to_contain_text("dead")
    expect(page.locator("#attempts tbody tr").nth(1)).to_contain_text("succeeded")
    shot(page, "requeued-attempts")


def test_a_viewer_cannot_act_and_requests_without_csrf_are_refused(
    page: Page, browser: Browser, topology: Topology
) -> None:
    job_id = create_job(page, topology, "guarded", "test.echo")
    # Without the CSRF token, even the admin's own session is refused.
    refused = page.request.post(f"{topology.url}/jobs/{job_id}/pause", form={}, max_redirects=0)
    assert refused.status == 403
    viewer_context = browser.new_context(viewport={"width": 1280, "height": 800})
    viewer_context.set_default_timeout(TIMEOUT_MS)
    try:
        viewer = log_in(viewer_context, topology, *VIEWER)
        viewer.goto(f"{topology.url}/jobs/{job_id}")
        expect(viewer.locator("#job-name")).to_have_text("guarded")
        expect(viewer.locator("#job-actions button")).to_have_count(0)  # no trigger, pause, delete
        expect(viewer.locator("#edit-job")).to_have_count(0)
        expect(viewer.locator("a[href='/api-keys']")).to_have_count(0)
        shot(viewer, "viewer-job")
        # A forged POST with the viewer's own, valid CSRF token: TriggerJob needs operator.
        csrf = viewer.locator("form.logout input[name=csrf]").get_attribute("value")
        assert csrf
        forged = viewer.request.post(f"{topology.url}/jobs/{job_id}/trigger", form={"csrf": csrf}, max_redirects=0)
        assert forged.status == 403
        assert "you are viewer" in forged.text()
    finally:
        close_tabs(viewer_context)
    page.goto(f"{topology.url}/executions?job={job_id}")
    expect(page.locator("#no-executions")).to_be_visible()  # nothing ran


def test_a_dns_rebinding_host_name_is_refused(browser: Browser, topology: Topology) -> None:
    """A page of evil.example whose name now resolves to 127.0.0.1 (DNS rebinding) gets no console."""
    port = topology.url.rsplit(":", 1)[1]
    with chromium(browser.browser_type, "--host-resolver-rules=MAP evil.example 127.0.0.1") as rebinding:
        tab = rebinding.new_page()
        response = tab.goto(f"http://evil.example:{port}/login")
        assert response is not None
        assert response.status == 421
        expect(tab.locator("input[name=password]")).to_have_count(0)
        shot(tab, "dns-rebinding-refused")
        # The same browser reaching the console by a loopback name is served.
        served = tab.goto(f"http://localhost:{port}/login")
        assert served is not None
        assert served.status == 200


def test_a_viewer_cannot_see_a_webhook_secret(page: Page, browser: Browser, topology: Topology) -> None:
    secret = "Bearer browser-s3cr3t"
    payload = (
        '{"url": "https://hooks.example.com/deploy", "headers": {"Authorization": "' + secret + '", "X-Env": "prod"}}'
    )
    job_id = create_job(page, topology, "deploy-webhook", "http.webhook", payload=payload)
    expect(page.locator("main")).to_contain_text(secret)  # the admin writes jobs: it reads their secrets
    viewer_context = browser.new_context(viewport={"width": 1280, "height": 800})
    viewer_context.set_default_timeout(TIMEOUT_MS)
    try:
        viewer = log_in(viewer_context, topology, *VIEWER)
        viewer.goto(f"{topology.url}/jobs/{job_id}")
        expect(viewer.locator("#job-name")).to_have_text("deploy-webhook")
        expect(viewer.locator("main")).to_contain_text('"Authorization": "<redacted>"')
        expect(viewer.locator("main")).to_contain_text('"X-Env": "prod"')
        assert "browser-s3cr3t" not in viewer.content()
        shot(viewer, "viewer-redacted-secret")
    finally:
        close_tabs(viewer_context)


def test_an_admin_creates_a_user_and_changes_its_role_which_its_live_session_gets_at_once(
    page: Page, browser: Browser, topology: Topology
) -> None:
    page.on("dialog", lambda dialog: dialog.accept())  # the confirmations
    page.goto(f"{topology.url}/")
    page.click("header nav a[href='/users']")
    expect(page.locator("h1")).to_have_text("Users")
    # A refused form keeps what was typed and says why under it.
    page.fill("#u-username", "nora")
    page.fill("#u-password", "too-short")
    page.select_option("#u-role", "operator")
    # The server's rule, not the browser's: without the attribute the form is sent.
    page.evaluate("document.querySelector('#u-password').removeAttribute('minlength')")
    page.click("#create-user")
    expect(page.locator("#u-password-error")).to_contain_text("at least 12 characters")
    expect(page.locator("#u-username")).to_have_value("nora")
    expect(page.locator("#u-role")).to_have_value("operator")
    page.fill("#u-password", "nora-password-123")
    page.click("#create-user")
    expect(page.locator("#users-notice")).to_have_text("created nora (operator)")
    row = page.locator("#users tr[data-user=nora]")
    expect(row.locator("td.role select")).to_have_value("operator")
    expect(row.locator("td.state")).to_have_text("active")
    shot(page, "users")

    nora_context = browser.new_context(viewport={"width": 1280, "height": 800})
    nora_context.set_default_timeout(TIMEOUT_MS)
    try:
        nora = log_in(nora_context, topology, "nora", "nora-password-123")
        expect(nora.locator("header .who")).to_have_text("nora (operator)")
        expect(nora.locator("header nav a[href='/users']")).to_have_count(0)
        assert nora.request.get(f"{topology.url}/users", max_redirects=0).status == 403
        # Demoted to viewer in the admin's tab: her open session is a viewer's on its next page.
        row.locator("td.role select").select_option("viewer")
        row.locator("button.set-role").click()
        expect(page.locator("#users-notice")).to_have_text("nora is now viewer")
        expect(page.locator("#users tr[data-user=nora] td.role select")).to_have_value("viewer")
        nora.reload()
        expect(nora.locator("header .who")).to_have_text("nora (viewer)")
        # Disabled: her session ends at once.
        page.locator("#users tr[data-user=nora] button.disable").click()
        expect(page.locator("#users-notice")).to_have_text("disabled nora (its sessions ended)")
        expect(page.locator("#users tr[data-user=nora] td.state")).to_have_text("disabled")
        nora.reload()
        expect(nora).to_have_url(re.compile(r"/login$"))
    finally:
        close_tabs(nora_context)
    # The last enabled admin cannot demote itself; the refusal is shown by its row.
    admin_row = page.locator("#users tr[data-user=admin]")
    admin_row.locator("td.role select").select_option("viewer")
    admin_row.locator("button.set-role").click()
    expect(page.locator("#user-error")).to_contain_text("last enabled admin")
    expect(page.locator("#users tr[data-user=admin] td.role select")).to_have_value("admin")
    shot(page, "users-last-admin")


def test_redis_stopped_shows_the_warning(page: Page, topology: Topology) -> None:
    """Last in the module: it stops the topology's Redis."""
    page.goto(f"{topology.url}/")
    expect(page.locator("#outage")).to_have_count(0)
    topology.redis.stop()

    def warned() -> bool:
        page.goto(f"{topology.url}/")
        return page.locator("#outage").count() == 1

    _wait_for(warned, "the outage banner", within=20)
    expect(page.locator("#outage")).to_contain_text("Redis is down")
    shot(page, "redis-down")
