"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright.

The browser is never downloaded by Playwright: `make setup` installs the `chromium` package with
apt. Without /usr/bin/chromium (no apt on the machine) the browser test skips and says why.
The page is served by an API of its own that requires an API key, on the shared stack's Redis, so
the stack's worker trains and predicts, and the key path (localStorage + bearer header on every
data call, events over fetch streaming) is what is tested.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.support import REPO, Processes

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
API_KEY = "dashboard-test-key"


@pytest.fixture(scope="module")
def keyed_api(stack: dict) -> str:
    """A second API process with TORCHYARD_API_KEY set, on the stack's Redis and data dir."""
    procs = Processes(stack["redis_url"], stack["data_dir"], stack["data_dir"] / "logs-dashboard")
    try:
        yield procs.ready_api(TORCHYARD_API_KEY=API_KEY)
    finally:
        procs.stop_all()


def test_page_and_static_files_need_no_key_but_data_does(keyed_api: str) -> None:
    page = httpx.get(f"{keyed_api}/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'src="/static/app.js"' in page.text
    for name, kind in (("app.js", "javascript"), ("style.css", "css")):
        static = httpx.get(f"{keyed_api}/static/{name}")
        assert static.status_code == 200 and kind in static.headers["content-type"]
    # All local: no CDN or other host is referenced by the page or its script.
    for text in (page.text, httpx.get(f"{keyed_api}/static/app.js").text):
        assert "http://" not in text and "https://" not in text
    assert httpx.get(f"{keyed_api}/jobs").status_code == 401
    assert httpx.get(f"{keyed_api}/metrics").status_code == 401
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{keyed_api}/metrics", headers=auth).status_code == 200
    assert httpx.get(f"{keyed_api}/static/missing.js").status_code == 404


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make setup` installs it with apt "
                                                    "(apt-get install chromium), which this machine lacks")
def test_dashboard_trains_streams_and_predicts(keyed_api: str, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra: `make setup`")
    screenshot = Path(os.environ.get("TORCHYARD_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
    origin = urlparse(keyed_api).netloc
    requests: list[tuple[str, str, str | None]] = []
    errors: list[str] = []

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(30_000)
            page.on("request", lambda r: requests.append((r.url, r.method, r.headers.get("authorization"))))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{keyed_api}/")

            # Without a key the page says what is missing; with it the data arrives.
            page.wait_for_selector("#banner:not([hidden])")
            assert "API key" in page.inner_text("#banner")
            page.fill("#api-key", API_KEY)
            page.click("#save-key")
            page.wait_for_selector("#model option[value=cifar_net]", state="attached")
            page.wait_for_selector("#devices .device[data-device$='/cpu']")
            keyed_from = len(requests)

            page.select_option("#model", "cifar_net")
            page.select_option("#dataset", "fake")
            page.fill("#epochs", "2")
            page.click("#start-job")

            # The job view follows the event stream: the loss curve gets its points, then the job ends.
            page.wait_for_function("Number(document.querySelector('#loss-chart').dataset.points) > 0",
                                   timeout=180_000)
            page.wait_for_selector("#job-status[data-status=succeeded]", timeout=60_000)
            job_id = page.inner_text("#job-title").strip()
            # two epochs, a train and a val point each, in both charts
            assert page.get_attribute("#loss-chart", "data-points") == "4"
            assert page.get_attribute("#acc-chart", "data-points") == "4"
            page.wait_for_selector(f"#jobs-table tr[data-id='{job_id}'][data-status=succeeded]")
            assert "pattern_3" in page.inner_text("#per-class")
            # The kept weights' validation: per-class bars and the confusion matrix as a heat-map table.
            page.wait_for_selector("#evaluation-view:not([hidden]) #confusion td")
            assert len(page.query_selector_all("#confusion tbody tr")) == 10
            assert len(page.query_selector_all("#confusion td")) == 100
            assert "pattern_3" in page.inner_text("#eval-bars")
            # An evaluation on another draw of the same classes, from the job view.
            page.select_option("#evaluate-dataset", "fake")
            page.click("#evaluate-start")
            page.wait_for_selector("#evaluations tr[data-status=succeeded]", timeout=60_000)
            assert "Evaluation" in page.inner_text("#evaluation-title")

            # Predict with the job just trained: the top bar is the image's class.
            page.wait_for_function(f"document.querySelector('#predict-job').value === '{job_id}'")
            page.set_input_files("#predict-file", str(REPO / "examples" / "pattern_3.png"))
            top = page.wait_for_selector("#predict-results .pred-row.top")
            assert top.get_attribute("data-label") == "pattern_3"
            assert len(page.query_selector_all("#predict-results .pred-row")) == 5
            # Promote it: the aliases table shows the name pointing at the job (PUT with the key).
            page.fill("#promote-name", "dash-pets")
            page.click("#promote-job")
            page.wait_for_selector(f"#aliases-table tr[data-alias=dash-pets][data-job='{job_id}']")
            # The live device panel: the worker is idle again and keeps the model resident.
            page.wait_for_selector("#devices .device[data-device$='/cpu'] .pill.idle", timeout=15_000)
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)

            # Export: the button waits out the export job's 202s, then the file downloads.
            page.select_option("#export-format", "torchscript")
            with page.expect_download(timeout=120_000) as download:
                page.click("#export-job")
            exported = tmp_path / download.value.suggested_filename
            download.value.save_as(exported)
            assert exported.name.endswith(".torchscript.pt") and exported.stat().st_size > 10_000
            export_job = httpx.get(f"{keyed_api}/jobs/{job_id}/export", params={"format": "torchscript"},
                                   headers={"Authorization": f"Bearer {API_KEY}"}).headers["X-Export-Job"]

            # Delete: refused while the alias points at the job (the API's reason is shown), done once
            # it is gone; the job leaves the list and takes its export with it.
            page.on("dialog", lambda dialog: dialog.accept())
            page.click("#delete-job")
            page.wait_for_function("document.querySelector('#job-meta').textContent.includes('alias')")
            auth = {"Authorization": f"Bearer {API_KEY}"}
            assert httpx.delete(f"{keyed_api}/aliases/dash-pets", headers=auth).status_code == 204
            page.click("#delete-job")
            page.wait_for_function("document.querySelector('#job-meta').textContent.includes('deleted')")
            page.wait_for_selector(f"#jobs-table tr[data-id='{job_id}']", state="detached")
            assert httpx.get(f"{keyed_api}/jobs/{job_id}", headers=auth).status_code == 404
            assert httpx.get(f"{keyed_api}/jobs/{export_job}", headers=auth).status_code == 404

            # The key survives a reload (localStorage).
            page.reload()
            assert page.input_value("#api-key") == API_KEY
        finally:
            browser.close()

    assert not errors, errors
    network = [(url, auth) for url, _, auth in requests if urlparse(url).scheme not in ("blob", "data")]
    assert all(urlparse(url).netloc == origin for url, _ in network), f"the page reached another host: {network}"
    data_calls = [(url, auth) for url, _, auth in requests[keyed_from:] if urlparse(url).scheme == "http"
                  and not urlparse(url).path.startswith("/static/") and urlparse(url).path != "/"]
    assert any(f"/jobs/{job_id}/events" in url for url, _ in data_calls)
    assert all(auth == f"Bearer {API_KEY}" for _, auth in data_calls), data_calls
    assert screenshot.stat().st_size > 10_000
