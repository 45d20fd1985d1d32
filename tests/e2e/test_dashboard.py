"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright.

The browser is never downloaded by Playwright: `make setup` installs the `chromium` package with
apt. Without /usr/bin/chromium (no apt on the machine) the browser tests skip and say why.
The page is served by an API of its own that requires an API key, on the shared stack's Redis, so
the stack's worker trains and predicts, and the key path (localStorage + bearer header on every
data call, events over fetch streaming) is what is tested. That API is SIGKILLed and started
again under a live view, which must wait for it and pick up where it left off.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.datagen import zip_of
from tests.support import REPO, Processes, free_port, two_hosts, wait_for_job, wait_until

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
API_KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STATIC = REPO / "app" / "static"
needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: `make setup` installs it "
                                                                   "with apt (apt-get install chromium), which this "
                                                                   "machine lacks")


class KeyedApi:
    """A second API process with TORCHYARD_API_KEY set, on the stack's Redis and data dir, on a
    port it keeps across restarts."""

    def __init__(self, stack: dict) -> None:
        self.procs = Processes(stack["redis_url"], stack["data_dir"], stack["data_dir"] / "logs-dashboard")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = self.procs.api(self.port, TORCHYARD_API_KEY=API_KEY)
        self.wait_ready()

    def wait_ready(self) -> None:
        wait_until(lambda: httpx.get(f"{self.base}/healthz").status_code == 200, timeout=60, what="the API")

    def kill(self) -> None:
        self.procs.stop(self.proc, signal.SIGKILL)

    def start(self) -> None:
        self.proc = self.procs.api(self.port, TORCHYARD_API_KEY=API_KEY)
        self.wait_ready()


@pytest.fixture(scope="module")
def keyed_api(stack: dict) -> Iterator[KeyedApi]:
    api = KeyedApi(stack)
    try:
        yield api
    finally:
        api.procs.stop_all()


def test_page_and_static_files_need_no_key_but_data_does(keyed_api: KeyedApi) -> None:
    base = keyed_api.base
    page = httpx.get(f"{base}/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert '<script type="module" src="/static/js/main.js">' in page.text
    modules = sorted(p.name for p in (STATIC / "js").glob("*.js"))
    assert "main.js" in modules and len(modules) >= 8
    for name, kind in [*((f"js/{m}", "javascript") for m in modules), ("style.css", "css")]:
        static = httpx.get(f"{base}/static/{name}")
        assert static.status_code == 200 and kind in static.headers["content-type"], name
        # All local: no CDN or other host is referenced by the page or its scripts.
        assert "http://" not in static.text and "https://" not in static.text, name
        assert static.text.count("\n") < 400, f"{name}: keep each module small"
    assert "http://" not in page.text and "https://" not in page.text
    assert httpx.get(f"{base}/jobs").status_code == 401
    assert httpx.get(f"{base}/metrics").status_code == 401
    assert httpx.get(f"{base}/metrics", headers=AUTH).status_code == 200
    assert httpx.get(f"{base}/static/missing.js").status_code == 404


def _browser(playwright):
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)


def _visible(page, *selectors: str) -> list[str]:
    return [s for s in selectors if page.is_visible(s)]


TRAINED_ONLY = ("#download-ckpt", "#export-controls", "#promote-form")


@needs_chromium
def test_dashboard_views_of_every_job_kind(stack: dict, keyed_api: KeyedApi, tmp_path: Path) -> None:
    """Train from the form, follow it live, evaluate, predict, promote, export, delete; each job
    kind's view at its own URL with only the controls that fit it; the toolbar inside its card at
    1400 px; the live view through an API restart."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra: `make setup`")
    screenshot = Path(os.environ.get("TORCHYARD_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
    base, origin = keyed_api.base, urlparse(keyed_api.base).netloc
    requests: list[tuple[str, str, str | None]] = []
    errors: list[str] = []

    with sync_api.sync_playwright() as playwright:
        browser = _browser(playwright)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(30_000)
            page.on("request", lambda r: requests.append((r.url, r.method, r.headers.get("authorization"))))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{base}/")

            # Without a key the page says what is missing; with it the data arrives.
            page.wait_for_selector("#banner:not([hidden])")
            assert "API key" in page.inner_text("#banner")
            # No job in view: none of a job's controls shows (`hidden` beats the CSS's inline-flex).
            assert _visible(page, "#cancel-job", "#delete-job", "#job-progress-box", "#train-view",
                            *TRAINED_ONLY) == []
            page.fill("#api-key", API_KEY)
            page.click("#save-key")
            page.wait_for_selector("#model option[value=cifar_net]", state="attached")
            page.wait_for_selector("#devices .device[data-device$='/cpu']")
            keyed_from = len(requests)

            page.select_option("#model", "cifar_net")
            page.select_option("#dataset", "fake")
            page.fill("#epochs", "2")
            page.click("#start-job")

            # The job view has the job's URL, and follows its event stream to the end.
            page.wait_for_function("location.hash.startsWith('#/jobs/')")
            job_id = page.evaluate("decodeURIComponent(location.hash.slice('#/jobs/'.length))")
            assert page.inner_text("#job-title").strip() == job_id
            page.wait_for_selector("#job-view[data-kind=train] #train-view:not([hidden])")
            page.wait_for_function("Number(document.querySelector('#loss-chart').dataset.points) > 0",
                                   timeout=180_000)
            page.wait_for_selector("#job-status[data-status=succeeded]", timeout=60_000)
            # two epochs, a train and a val point each, in both charts
            assert page.get_attribute("#loss-chart", "data-points") == "4"
            assert page.get_attribute("#acc-chart", "data-points") == "4"
            page.wait_for_selector(f"#jobs-table tr[data-id='{job_id}'][data-status=succeeded]")
            assert "pattern_3" in page.inner_text("#per-class")
            page.wait_for_selector("#promote-form:not([hidden])")
            assert _visible(page, "#cancel-job", "#download-results", "#download-export", "#job-gang") == []
            assert _visible(page, "#delete-job", *TRAINED_ONLY) == ["#delete-job", *TRAINED_ONLY]
            # At 1400 px every action sits inside the job's card, none cut off.
            card = page.locator("#job-view").bounding_box()
            for control in ("#download-ckpt", "#export-job", "#promote-job", "#delete-job"):
                box = page.locator(control).bounding_box()
                assert box["x"] >= card["x"] and box["x"] + box["width"] <= card["x"] + card["width"], control
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

            # The evaluation's own view, from its link: its result, no curves, no model actions.
            page.click("#evaluations tr[data-status=succeeded] a")
            page.wait_for_selector("#job-view[data-kind=evaluate] #job-status[data-status=succeeded]")
            page.wait_for_selector("#evaluation-view:not([hidden]) #confusion td")
            assert "evaluates the checkpoint of job" in page.inner_text("#job-meta")
            assert _visible(page, "#train-view", "#cancel-job", *TRAINED_ONLY) == []
            assert "0/0" not in page.inner_text("#job-progress-text")
            page.go_back()  # the URL history: back to the training job
            page.wait_for_selector("#job-view[data-kind=train] #job-status[data-status=succeeded]")

            # Export: the button waits out the export job's 202s, then the file downloads.
            page.select_option("#export-format", "torchscript")
            with page.expect_download(timeout=120_000) as download:
                page.click("#export-job")
            exported = tmp_path / download.value.suggested_filename
            download.value.save_as(exported)
            assert exported.name.endswith(".torchscript.pt") and exported.stat().st_size > 10_000
            export_job = httpx.get(f"{base}/jobs/{job_id}/export", params={"format": "torchscript"},
                                   headers=AUTH).headers["X-Export-Job"]
            # The export job's view (by URL): its format and source, its file; no "0/0", no curves.
            page.goto(f"{base}/#/jobs/{export_job}")
            page.wait_for_selector("#job-view[data-kind=export] #job-status[data-status=succeeded]")
            assert "TorchScript file of job" in page.inner_text("#export-summary")
            assert "0/0" not in page.inner_text("#job-progress-text")
            assert _visible(page, "#download-export", "#train-view", "#evaluation-view", *TRAINED_ONLY) == \
                ["#download-export"]

            # A predict job over an upload: its images and its results file.
            labelled = {f"c{k}/{n}.png": (REPO / "examples" / f"pattern_{k}.png").read_bytes()
                        for k in (3, 7) for n in range(3)}
            uploaded = httpx.post(f"{base}/datasets", headers=AUTH, data={"name": "dash-folder"},
                                  files={"file": ("d.zip", zip_of(labelled), "application/zip")})
            assert uploaded.status_code == 201, uploaded.text
            predict_job = httpx.post(f"{base}/jobs", headers=AUTH, json={
                "kind": "predict", "job_id": job_id, "dataset": uploaded.json()["id"]}).json()["id"]
            page.goto(f"{base}/#/jobs/{predict_job}")
            page.wait_for_selector("#job-view[data-kind=predict] #job-status[data-status=succeeded]", timeout=60_000)
            page.wait_for_function("document.querySelector('#predict-summary').textContent.includes('6 images')")
            assert "6 of 6 images" in page.inner_text("#job-progress-text")
            assert _visible(page, "#download-results", "#train-view", *TRAINED_ONLY) == ["#download-results"]
            page.reload()  # a bookmark: the same view again
            page.wait_for_selector("#job-view[data-kind=predict] #job-status[data-status=succeeded]")
            assert page.inner_text("#job-title").strip() == predict_job

            # The live view through an API restart: a longer job, opened by its URL; the API is
            # SIGKILLed once it trains and started again; the view waits and draws every epoch.
            long_job = httpx.post(f"{base}/jobs", headers=AUTH, json={
                "model": "cifar_net", "dataset": "fake", "epochs": 2, "batch_size": 8, "patience": 0}).json()["id"]
            page.goto(f"{base}/#/jobs/{long_job}")
            page.wait_for_function("document.querySelector('#job-progress-text').textContent.includes('step')",
                                   timeout=120_000)
            assert page.is_visible("#cancel-job") and _visible(page, "#delete-job", *TRAINED_ONLY) == []
            keyed_api.kill()
            page.wait_for_selector("#stream-note:not([hidden])", timeout=30_000)
            assert "waiting for the server" in page.inner_text("#stream-note")
            keyed_api.start()
            page.wait_for_selector("#job-status[data-status=succeeded]", timeout=240_000)
            page.wait_for_selector("#stream-note", state="hidden")
            assert page.get_attribute("#loss-chart", "data-points") == "4"

            # Delete: refused while the alias points at the job (the API's reason is shown), done once
            # it is gone; the job leaves the list and takes its export with it.
            page.goto(f"{base}/#/jobs/{job_id}")
            page.wait_for_selector("#job-view[data-kind=train] #delete-job:not([hidden])")
            page.on("dialog", lambda dialog: dialog.accept())
            page.click("#delete-job")
            page.wait_for_function("document.querySelector('#job-note').textContent.includes('alias')")
            assert httpx.delete(f"{base}/aliases/dash-pets", headers=AUTH).status_code == 204
            page.click("#delete-job")
            page.wait_for_function("document.querySelector('#job-meta').textContent.includes('deleted')")
            page.wait_for_selector(f"#jobs-table tr[data-id='{job_id}']", state="detached")
            assert page.evaluate("location.hash") == "#/"
            assert httpx.get(f"{base}/jobs/{job_id}", headers=AUTH).status_code == 404
            assert httpx.get(f"{base}/jobs/{export_job}", headers=AUTH).status_code == 404

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


# Long enough to still hold both workers while the second gang job is looked at, on any host; cancelled then.
GANG_JOB = {"model": "cifar_net", "dataset": "fake", "epochs": 40, "batch_size": 32, "patience": 0, "world_size": 2}


@needs_chromium
def test_a_gang_job_shows_its_size_elasticity_and_ranks(tmp_path: Path) -> None:
    """Two CPU workers as two hosts (h1, h2, as tests/e2e/test_gangs.py runs them): an elastic job
    of world size 2 shows, in its line and its view, its size, that it is elastic and the devices and
    nodes its ranks hold; a second one, not elastic, queued behind it, shows that it waits for both
    and that no rank is placed yet; the first, cancelled, still shows where its ranks ran."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra: `make setup`")
    errors: list[str] = []
    with two_hosts(tmp_path, timeout=240, TORCHYARD_ADVERTISE_ADDRESS="127.0.0.1", OMP_NUM_THREADS="1") as hosts, \
            sync_api.sync_playwright() as playwright:
        client, base = hosts["client"], str(hosts["client"].base_url).rstrip("/")
        elastic = client.post("/jobs", json={**GANG_JOB, "elastic": True}).json()["id"]
        browser = _browser(playwright)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{base}/#/jobs/{elastic}")
            # The view follows the job: its ranks appear once the gang forms (the `gang` event).
            gang = page.wait_for_selector("#job-gang[data-ranks='2']", timeout=180_000)
            ranks = {r.get_attribute("data-rank"): r.get_attribute("data-device")
                     for r in page.query_selector_all("#job-gang .rank")}
            assert sorted(ranks) == ["0", "1"] and sorted(ranks.values()) == ["h1/cpu", "h2/cpu"], ranks
            nodes = [ranks[r].split("/")[0] for r in ("0", "1")]
            assert (gang.get_attribute("data-world-size"), gang.get_attribute("data-elastic"),
                    gang.get_attribute("data-nodes")) == ("2", "true", " ".join(nodes))
            said = page.inner_text("#job-gang")
            assert "data-parallel over 2 devices" in said and "elastic: after a fault it may resume on fewer" in said
            assert f"ranks: 0 on {ranks['0']}, 1 on {ranks['1']}" in said and f"nodes {', '.join(nodes)}" in said
            # Its line in the jobs table: size, elastic, both devices, rank 0's first.
            line = page.wait_for_selector(f"#jobs-table tr[data-id='{elastic}'] td.gang[data-devices~='h2/cpu']"
                                          f"[data-devices~='h1/cpu']")
            assert line.inner_text().split() == ["×2", "elastic", ranks["0"], ranks["1"]], line.inner_text()

            # Not elastic, and both devices busy: queued, no rank placed; the view says what it waits for.
            waiting = client.post("/jobs", json=GANG_JOB).json()["id"]
            page.goto(f"{base}/#/jobs/{waiting}")
            page.wait_for_selector("#job-gang[data-world-size='2'][data-elastic='false'][data-ranks='0']")
            said = page.inner_text("#job-gang")
            assert "not elastic: after a fault it waits for all 2" in said and "ranks not placed yet" in said, said
            line = page.wait_for_selector(f"#jobs-table tr[data-id='{waiting}'] td.gang[data-elastic='false']")
            assert line.inner_text().split()[0] == "×2" and "elastic" not in line.inner_text()
            assert page.is_visible("#cancel-job")  # the view of a job that has not started yet
            assert client.post(f"/jobs/{waiting}/cancel").status_code == 202

            # Ended, the record keeps its last attempt's ranks: the view (a bookmark) shows them.
            assert client.post(f"/jobs/{elastic}/cancel").status_code == 202
            done = wait_for_job(client, elastic, {"succeeded", "failed", "cancelled"}, timeout=120)
            assert done["status"] == "cancelled", done["error"]
            page.goto(f"{base}/#/jobs/{elastic}")
            page.wait_for_selector("#job-status[data-status=cancelled]")
            page.wait_for_selector("#job-gang[data-ranks='2'][data-elastic='true']")
            assert {r.get_attribute("data-device") for r in page.query_selector_all("#job-gang .rank")} == \
                {"h1/cpu", "h2/cpu"}
            page.wait_for_selector(f"#jobs-table tr[data-id='{elastic}'][data-status=cancelled] td.gang")
        finally:
            browser.close()
    assert not errors, errors


@needs_chromium
def test_docs_render_offline_behind_the_key(keyed_api: KeyedApi) -> None:
    """/docs is Swagger UI from files the API serves itself: it renders with every request to
    another host refused. The page and the OpenAPI document need the key; Swagger's files do not."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra: `make setup`")
    base = keyed_api.base
    assert httpx.get(f"{base}/docs").status_code == 401
    assert httpx.get(f"{base}/openapi.json").status_code == 401
    assert httpx.get(f"{base}/docs/assets/swagger-ui-bundle.js").status_code == 200
    elsewhere: list[str] = []

    def offline(route) -> None:
        if urlparse(route.request.url).hostname in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort("internetdisconnected")

    with sync_api.sync_playwright() as playwright:
        browser = _browser(playwright)
        try:
            context = browser.new_context(extra_http_headers=AUTH)
            context.route("**/*", offline)
            page = context.new_page()
            page.goto(f"{base}/docs")
            page.wait_for_selector(".swagger-ui .info .title", timeout=30_000)
            assert "torchyard" in page.inner_text(".swagger-ui .info .title")
            page.wait_for_selector(".opblock-summary-path[data-path='/jobs']")
            assert len(page.query_selector_all(".opblock")) >= 20
        finally:
            browser.close()
    assert elsewhere == [], elsewhere
