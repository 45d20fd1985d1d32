"""A worker's /predict intake under the faults that hit it, with real processes: its decoding
processes SIGKILLed while idle and mid-batch (the OOM killer may pick one at any moment), one
SIGSTOPped mid-chunk (a stuck decoder), an image that kills its decoder every time, and a body
whose ignored multipart preamble reads like a preload request. Every request is answered: none
waits out the API's timeout."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from PIL import Image

from core.wire import PreloadRequest
from tests.support import REPO, Processes, flush, free_port, wait_for_job, wait_until, with_db

pytestmark = pytest.mark.e2e

TIMEOUT_S = 20  # the API's: a request no worker answers is a 503 after this
DECODE_TIMEOUT_S = 2  # the worker's: a decoder that holds its chunk longer is taken as stuck
CRASH_MARKER = b"torchyard-test: this image kills its decoder"  # tests/decodercrash/sitecustomize.py


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_base_url: str) -> Iterator[dict]:
    """An API, one trained job, and the worker that serves it: two decoding processes, the decode
    timeout short, and the test-only decoder crash on marked images (tests/decodercrash)."""
    url = with_db(redis_base_url, 14)
    flush(url)
    data_dir = tmp_path_factory.mktemp("intake")
    procs = Processes(url, data_dir, data_dir / "logs", TORCHYARD_PREDICT_TIMEOUT_S=str(TIMEOUT_S))
    port = free_port()
    procs.api(port)
    worker = procs.worker("cpu", TORCHYARD_PREDICT_DECODE_PROCESSES="2",
                          TORCHYARD_PREDICT_DECODE_TIMEOUT_S=str(DECODE_TIMEOUT_S),
                          PYTHONPATH=f"{REPO / 'tests' / 'decodercrash'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT_S + 30)
    try:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=120, what="a worker heartbeat")
        job = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()
        assert wait_for_job(client, job["id"], {"succeeded", "failed"}, timeout=240)["status"] == "succeeded"
        yield {"client": client, "procs": procs, "job": job["id"], "worker": worker, "port": port,
               "data_dir": Path(data_dir)}
    finally:
        client.close()
        procs.stop_all()
        flush(url)


def _jpeg(seed: int, marked: bool = False) -> bytes:
    """256×256 of noise: its decode costs several times DecodeSplit's threshold, so a batch of two
    or more goes to the decoding processes. A marked one kills the decoding process that opens it."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(
        buffer, "JPEG", quality=90)
    return buffer.getvalue() + (CRASH_MARKER if marked else b"")  # after the end of the JPEG: ignored


def _slow_png(seed: int) -> bytes:
    """3000×3000, smooth: a small upload whose decode keeps a decoding process busy for a while."""
    axis = np.linspace(0, 255, 3000)
    rows, cols = np.meshgrid(axis, axis)
    pixels = np.stack([rows, cols, np.full_like(rows, seed % 256)], axis=-1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def _predict(client: httpx.Client, job: str, images: list[bytes]) -> httpx.Response:
    return client.post("/predict", data={"job_id": job, "top_k": "3"},
                       files=[("file", (f"{i}.img", data, "application/octet-stream")) for i, data in enumerate(images)])


def _burst(client: httpx.Client, job: str, requests: int = 20, seed: int = 0) -> list[httpx.Response]:
    """`requests` concurrent requests of two photos each."""
    with ThreadPoolExecutor(requests) as pool:
        return list(pool.map(lambda i: _predict(client, job, [_jpeg(seed + 2 * i), _jpeg(seed + 2 * i + 1)]),
                             range(requests)))


def _statuses(responses: list[httpx.Response]) -> list[int]:
    return [r.status_code for r in responses]


def _decoders(worker) -> list[psutil.Process]:
    """The worker's decoding processes: the children of its forkserver."""
    servers = [p for p in psutil.Process(worker.pid).children()
               if "multiprocessing.forkserver" in " ".join(p.cmdline())]
    return [child for server in servers for child in server.children()]


def _serving(cluster: dict) -> list[psutil.Process]:
    """The decoding processes, once a batch has gone to them (the first one is decoded by the
    intake thread, which measures what an image costs): the pool's two, and the quarantine's one
    once a chunk was lost."""
    client, job = cluster["client"], cluster["job"]
    for seed in (900, 902):
        response = _predict(client, job, [_jpeg(seed), _jpeg(seed + 1)])
        assert response.status_code == 200, response.text
    return wait_until(lambda: len(found := _decoders(cluster["worker"])) >= 2 and found, timeout=30,
                      what="the worker's decoding processes")


def _caught_decoding(cluster: dict, pool: ThreadPoolExecutor):
    """A request of two slow images on its way, and the decoding process caught decoding one."""
    client, job, worker = cluster["client"], cluster["job"], cluster["worker"]
    _serving(cluster)
    slow = pool.submit(_predict, client, job, [_slow_png(1), _slow_png(2)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not slow.done():
        for process in _decoders(worker):
            try:
                if process.status() == psutil.STATUS_RUNNING:
                    return slow, process
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.002)
    raise AssertionError(f"no decoding process was seen decoding the slow request: {slow}")


def test_a_decoder_killed_while_idle_costs_no_request(cluster: dict) -> None:
    """The pool broke while idle; the intake's submit raised BrokenProcessPool and every later batch
    of two or more photos was taken off Redis and never answered (a 503 after the timeout)."""
    decoders = _serving(cluster)
    assert len(decoders) == 2  # the pool's: nothing has been lost yet on this worker
    victim = decoders[0]
    victim.kill()
    victim.wait(30)
    responses = _burst(cluster["client"], cluster["job"])
    assert _statuses(responses) == [200] * 20, [r.text for r in responses if r.status_code != 200]
    assert _statuses(_burst(cluster["client"], cluster["job"], seed=100)) == [200] * 20


def test_a_decoder_killed_mid_batch_costs_no_request(cluster: dict) -> None:
    """Killed while it decodes a batch's chunk, with later batches' chunks queued behind it in the
    same pool: every chunk that pool held is lost, and each batch's images are decoded again."""
    with ThreadPoolExecutor(2) as pool:
        slow, decoding = _caught_decoding(cluster, pool)
        burst = pool.submit(_burst, cluster["client"], cluster["job"], 20, 200)
        time.sleep(0.2)  # the burst's first batches go to the pool behind the slow one meanwhile
        decoding.kill()
        assert slow.result().status_code == 200, slow.result().text
        assert _statuses(burst.result()) == [200] * 20
    assert cluster["worker"].poll() is None


def test_a_stopped_decoder_holds_no_request_past_the_decode_timeout(cluster: dict) -> None:
    """A decoder that stops mid-chunk (SIGSTOP here; a stuck decode alike) held its batch and every
    batch behind it for ever. Now, once TORCHYARD_PREDICT_DECODE_TIMEOUT_S has passed, the worker
    kills it, replaces the pool and decodes the chunk's images again: every request is a 200."""
    with ThreadPoolExecutor(2) as pool:
        slow, decoding = _caught_decoding(cluster, pool)
        try:
            decoding.suspend()
            burst = pool.submit(_burst, cluster["client"], cluster["job"], 20, 300)
            assert slow.result().status_code == 200, slow.result().text
            assert _statuses(burst.result()) == [200] * 20
            wait_until(lambda: not decoding.is_running() or decoding.status() == psutil.STATUS_ZOMBIE, timeout=30,
                       what="the worker to kill its stopped decoding process")
        finally:
            if decoding.is_running():
                decoding.kill()
    assert cluster["worker"].poll() is None


def test_an_image_that_kills_its_decoder_is_refused_alone(cluster: dict) -> None:
    """It kills its decoder in the batch's chunk, and again alone: a 415 for its own request, and
    every other request of the batch (and after it) answered."""
    client, job = cluster["client"], cluster["job"]
    _serving(cluster)
    with ThreadPoolExecutor(2) as pool:
        burst = pool.submit(_burst, client, job, 10, 400)
        crashing = pool.submit(_predict, client, job, [_jpeg(450), _jpeg(451, marked=True)])
        refused = crashing.result()
        assert refused.status_code == 415, refused.text
        assert "1.img" in refused.json()["detail"] and "crashed the decoder" in refused.json()["detail"]
        assert _statuses(burst.result()) == [200] * 10
    assert cluster["worker"].poll() is None
    assert _statuses(_burst(client, job, seed=500)) == [200] * 20


def test_a_body_whose_preamble_reads_like_a_preload_request_is_answered(cluster: dict) -> None:
    """The multipart preamble (before the first boundary) is ignored by the API but travels at the
    start of the frame; the worker took a frame that began with the preload prefix (`warm ` then)
    for a preload request and dropped it as malformed: a 503 after the timeout for a valid request."""
    boundary = "b0undary"
    body = (PreloadRequest.PREFIX.encode() + b"{\"job_id\": \"x\"}\r\n"
            + f"--{boundary}\r\nContent-Disposition: form-data; name=\"job_id\"\r\n\r\n{cluster['job']}\r\n".encode()
            + f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jpg\"\r\n"
              f"Content-Type: image/jpeg\r\n\r\n".encode()
            + _jpeg(600) + f"\r\n--{boundary}--\r\n".encode())
    response = cluster["client"].post("/predict", content=body,
                                      headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert response.status_code == 200, response.text
    assert [r["filename"] for r in response.json()["results"]] == ["a.jpg"]
