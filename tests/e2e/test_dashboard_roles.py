"""The dashboard shows the key's role and project and hides what the role cannot do; an admin acts
in one project from the top bar (`?project=` on its calls). Debian's Chromium, headless, driven by
Playwright (skipped, saying why, without /usr/bin/chromium), on an API of its own with a key."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import KeyedApi
from tests.e2e.test_dashboard import CHROMIUM_ARGS, needs_chromium

pytestmark = pytest.mark.e2e

KEY = "bootstrap-admin-key-for-the-dashboard-roles"


KEYED_API_KEYS = [(f"{role}-x", role, "vision") for role in ("viewer", "predictor", "trainer")]


@pytest.fixture(scope="module")
def keyed(keyed_api: KeyedApi) -> dict:
    """The module's keyed API (tests/e2e/conftest.py): its base and a secret per role."""
    return {"base": keyed_api.base, "secrets": {**{name.removesuffix("-x"): secret
                                                   for name, secret in keyed_api.secrets.items()}, "admin": KEY}}


def _page(browser, base: str, key: str, project: str = ""):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30_000)
    page.add_init_script(f"localStorage.setItem('torchyard.apiKey', {key!r});"
                         + (f"localStorage.setItem('torchyard.project', {project!r});" if project else ""))
    page.goto(f"{base}/")
    page.wait_for_function("document.body.dataset.role")
    return page


@needs_chromium
def test_the_page_shows_the_role_and_hides_what_it_cannot_do(keyed: dict) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra: `make setup`")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            shown = {}
            for role in ("viewer", "predictor", "trainer", "admin"):
                page = _page(browser, keyed["base"], keyed["secrets"][role])
                shown[role] = (page.inner_text("#whoami"), page.is_visible("#start-job"),
                               page.is_visible(".predict-card"), page.is_visible("#project"))
                page.close()
            assert shown["viewer"][1:] == (False, False, False) and "viewer, project vision" in shown["viewer"][0]
            assert shown["predictor"][1:] == (False, True, False)
            assert shown["trainer"][1:] == (True, True, False) and "trainer, project vision" in shown["trainer"][0]
            assert shown["admin"][1:] == (True, True, True) and "every project" in shown["admin"][0]

            page = _page(browser, keyed["base"], KEY, project="vision")
            page.wait_for_function("document.getElementById('whoami').textContent.includes('project vision')")
            assert page.input_value("#project") == "vision"
            # Its data calls now act in that project (the jobs list refreshes every 3 s).
            with page.expect_request(lambda r: "/jobs?" in r.url and "project=vision" in r.url):
                pass
        finally:
            browser.close()
