"""The dashboard shows the key's role and project and hides what the role cannot do; an admin acts
in one project from the top bar (`?project=` on its calls). Debian's Chromium, headless, driven by
Playwright (skipped, saying why, without /usr/bin/chromium), on an API of its own with a key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_dashboard import CHROMIUM_ARGS, needs_chromium
from tests.support import Processes, flush, with_db

pytestmark = pytest.mark.e2e

KEY = "bootstrap-admin-key-for-the-dashboard-roles"


@pytest.fixture(scope="module")
def keyed(redis_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    data_dir: Path = tmp_path_factory.mktemp("dashboard-roles")
    url = with_db(redis_base_url, 15)
    flush(url)
    procs = Processes(url, data_dir, data_dir / "logs", TORCHYARD_API_KEY=KEY)
    try:
        base = procs.ready_api()
        auth = {"Authorization": f"Bearer {KEY}"}
        secrets = {role: httpx.post(f"{base}/keys", headers=auth, json={"name": f"{role}-x", "role": role,
                                                                         "project": "vision"}).json()["secret"]
                   for role in ("viewer", "predictor", "trainer")}
        yield {"base": base, "secrets": {**secrets, "admin": KEY}}
    finally:
        procs.stop_all()
        flush(url)


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
