"""The browser tests' watchdog (tests/conftest.py), proved armed: a Playwright call that never
returns fails once the watchdog kills Chromium, instead of hanging until pytest-timeout ends the
whole session (as it does here without the watchdog). A file of its own, with a Chromium of its
own: the watchdog kills every running Chromium, and another module's is down by the time this runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Error, Page, sync_playwright

from tests.test_console_browser import chromium


@pytest.fixture(scope="module")
def doomed() -> Iterator[Page]:
    with sync_playwright() as playwright, chromium(playwright.chromium) as launched:
        yield launched.new_page()


def test_a_tab_opens(doomed: Page) -> None:
    """Chromium starts and opens its tab in a test of its own: the next one's budget is its call's alone."""
    assert doomed.evaluate("1 + 1") == 2


@pytest.mark.timeout(8)  # the watchdog fires at 4 s
def test_a_call_that_never_returns_fails_once_the_watchdog_kills_chromium(doomed: Page) -> None:
    with pytest.raises(Error, match="has been closed"):
        doomed.evaluate("new Promise(() => {})")  # never settles, and evaluate has no timeout
    assert doomed.is_closed()
