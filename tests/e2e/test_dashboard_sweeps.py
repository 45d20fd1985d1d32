"""The dashboard's sweep view in a real browser (Debian's Chromium, headless, Playwright, as
tests/e2e/test_dashboard.py): a finished two-trial sweep at #/sweeps/<id> shows its trials (sorted
by a click on a column), the best-so-far curve and the parallel-coordinates plot drawn in the page,
and "promote best" points an alias at the best trial's job."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.test_dashboard import API_KEY, AUTH, KeyedApi, _browser, needs_chromium
from tests.e2e.test_sweeps import sweep_body
from tests.support import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def keyed(stack: dict) -> Iterator[KeyedApi]:
    api = KeyedApi(stack)
    try:
        yield api
    finally:
        api.procs.stop_all()


@needs_chromium
def test_the_sweep_view_draws_its_trials_and_promotes_the_best(keyed: KeyedApi) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra: `make setup`")
    client = httpx.Client(base_url=keyed.base, headers=AUTH, timeout=60)
    body = sweep_body(base={"model": "cifar_net", "dataset": "fake", "epochs": 1},
                      space={"learning_rate": {"type": "categorical", "choices": [0.03, 1e-7]}}, sampler="grid")
    sweep_id = client.post("/sweeps", json=body).json()["id"]
    sweep = wait_until(lambda: (s := client.get(f"/sweeps/{sweep_id}").json())["status"] == "succeeded" and s,
                       timeout=240, interval=0.5, what="the sweep")
    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = _browser(playwright)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(30_000)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{keyed.base}/")
            page.fill("#api-key", API_KEY)
            page.click("#save-key")
            page.wait_for_selector(f"#sweeps-table tr[data-sweep='{sweep_id}']")
            page.click(f"#sweeps-table tr[data-sweep='{sweep_id}'] a")
            page.wait_for_selector("#sweep-trials tbody tr[data-trial]")
            assert page.inner_text("#sweep-title").strip() == sweep_id
            assert page.locator("#sweep-trials tbody tr").count() == 2
            assert page.get_attribute("#sweep-best-chart", "data-points") == "2"
            assert page.get_attribute("#sweep-parallel", "data-lines") == "2"

            page.click("#sweep-trials th[data-key=value]")  # ascending, then descending: the best first
            page.click("#sweep-trials th[data-key=value]")
            first = page.get_attribute("#sweep-trials tbody tr:first-child", "data-trial")
            assert first == str(sweep["best"]["number"])

            page.fill("#sweep-promote-name", "sweep-best")
            page.click("#sweep-promote-button")
            page.wait_for_function("document.querySelector('#sweep-best').textContent.includes('alias sweep-best')")
        finally:
            browser.close()
    assert client.get("/aliases/sweep-best").json()["job_id"] == sweep["best"]["job_id"]
    assert errors == []
    client.close()
