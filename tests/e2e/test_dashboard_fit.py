"""The dashboard in Debian's Chromium (headless, driven by Playwright, as tests/e2e/test_dashboard.py)
against the shared stack's API: "Evaluate on" offers the sets that fit the model (its `-test`
sibling by default, the others greyed out with why), the page fits a 420 px phone, and the jobs
table does not say "no jobs yet" before it has asked."""

from __future__ import annotations

import re
import uuid

import pytest

from tests.datagen import shapes_zip
from tests.e2e.test_dashboard import CHROMIUM, needs_chromium
from tests.e2e.test_dashboard import _browser as chromium
from tests.e2e.test_user_words import _upload
from tests.support import wait_for_job

pytestmark = pytest.mark.e2e


@needs_chromium
def test_evaluate_on_defaults_to_a_set_with_the_models_classes_and_the_page_fits_a_phone(stack: dict) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra: `make setup`")
    assert CHROMIUM.exists()
    client, base = stack["client"], f"http://localhost:{stack['port']}"
    name = f"fit-{uuid.uuid4().hex[:6]}"
    trained_on = _upload(client, name, {"pattern_3": 3, "pattern_7": 7})
    sibling = _upload(client, f"{name}-test", {"pattern_3": 3, "pattern_7": 7})
    other = _upload(client, f"{name}-other", {"pattern_1": 1, "pattern_7": 7})
    job = client.post("/jobs", json={"model": "cifar_net", "dataset": trained_on["id"], "epochs": 1}).json()
    assert wait_for_job(client, job["id"], {"succeeded", "failed"})["status"] == "succeeded"
    newer = client.post("/datasets", data={"name": name, "new_version": "true"},
                        files={"file": ("v2.zip", shapes_zip(per_class=3, seed=5, corrupt=None), "application/zip")})
    assert newer.status_code == 201 and newer.json()["version"] == 2, newer.text

    with sync_api.sync_playwright() as playwright:
        browser = chromium(playwright)
        try:
            page = browser.new_page(viewport={"width": 420, "height": 900})
            page.set_default_timeout(30_000)
            held: list = []
            page.route("**/jobs?*", lambda route: held.append(route))  # the first listing, held back
            page.goto(f"{base}/")
            while not held:  # the page asked for the jobs; the answer is not there yet
                page.wait_for_timeout(100)
            assert "no jobs yet" not in page.inner_text("#jobs-table")  # nothing known yet: not "none"
            for route in held:
                route.continue_()
            page.unroute("**/jobs?*")
            page.wait_for_selector(f"#jobs-table tr[data-id='{job['id']}']")

            page.goto(f"{base}/#/jobs/{job['id']}")
            page.wait_for_selector("#evaluations-panel:not([hidden])")
            page.wait_for_selector(f"#evaluate-dataset option[value={other['id']}]", state="attached")
            assert page.input_value("#evaluate-dataset") == sibling["id"]  # the set's -test sibling
            options = page.eval_on_selector_all("#evaluate-dataset option", "os => os.map(o => [o.value, o.disabled, o.title])")
            state = {value: (disabled, title) for value, disabled, title in options}
            assert state[sibling["id"]] == (False, "") and state[trained_on["id"]] == (False, "")
            assert state[other["id"]][0] and "pattern_1" in state[other["id"]][1]
            assert state["fake"][0] and "classes the model does not have" in state["fake"][1]
            assert state["cifar10"][0]  # neither on disk here nor of these classes
            labels = page.eval_on_selector_all("#evaluate-dataset option", "os => os.map(o => o.textContent)")
            assert any(label.startswith(f"{name} v2 ({newer.json()['id']})") for label in labels), labels

            page.wait_for_selector("#evaluation-view:not([hidden])")
            text = page.inner_text("#job-view")
            assert "· 1 epoch ·" in text and not re.search(r"\b1 (epochs|images|classes)\b", text), text

            # A phone's width: nothing wider than the screen (tables scroll inside their card).
            overflow = page.evaluate("document.documentElement.scrollWidth")
            wide = page.evaluate("[...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > 421 && !e.closest('.table-wrap'))"
                                 ".slice(0, 5).map(e => e.id || e.className || e.tagName)")
            assert overflow <= 420, (overflow, wide)
            page.screenshot(path=str(stack["data_dir"] / "dashboard-420.png"), full_page=True)
        finally:
            browser.close()
