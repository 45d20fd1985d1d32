"""/predict under what hurts it, with real processes: a worker host whose wall clock is a minute off
either way, a request over its cap refused as it streams, and a device that breaks while it serves
(the CPU twin of a sticky CUDA error in the inference thread). The API's memory budget and its
sends to Redis: tests/e2e/test_predict_budget.py."""

from __future__ import annotations

import io
import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.support import REPO, Processes, free_port, wait_for_job, wait_until

pytestmark = pytest.mark.e2e

TIMEOUT_S = 10
MiB = 1024**2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_base_url: str) -> Iterator[dict]:
    """An API with small /predict limits, and one trained job; the tests start the workers."""
    from tests.support import flush, with_db

    url = with_db(redis_base_url, 14)
    flush(url)
    data_dir = tmp_path_factory.mktemp("hardening")
    procs = Processes(url, data_dir, data_dir / "logs", TORCHYARD_PREDICT_TIMEOUT_S=str(TIMEOUT_S),
                      TORCHYARD_PREDICT_MAX_WAIT_MS="50", TORCHYARD_MAX_IMAGE_BYTES=str(3 * MiB),
                      TORCHYARD_MAX_PREDICT_REQUEST_BYTES=str(4 * MiB),
                      TORCHYARD_PREDICT_MEMORY_BUDGET_BYTES=str(6 * MiB))
    port = free_port()
    procs.api(port)
    worker = procs.worker("cpu")
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT_S + 30)
    try:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=90, what="a worker heartbeat")
        job = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()
        assert wait_for_job(client, job["id"], {"succeeded", "failed"})["status"] == "succeeded"
        procs.stop(worker)
        yield {"client": client, "procs": procs, "job": job["id"], "port": port, "data_dir": Path(data_dir)}
    finally:
        client.close()
        procs.stop_all()
        flush(url)


def _png(seed: int = 0, size: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _padded_png(total: int) -> bytes:
    """A valid PNG, then zeros up to `total` bytes (which decoders ignore after the image's end): a
    large upload that is cheap to make and to decode."""
    return _png() + bytes(total - len(_png()))


def _predict(client: httpx.Client, job: str, images: list[bytes]) -> httpx.Response:
    return client.post("/predict", data={"job_id": job, "top_k": "3"},
                       files=[("file", (f"{i}.png", data, "image/png")) for i, data in enumerate(images)])


def _start_worker(cluster: dict, **env: str):
    procs, client = cluster["procs"], cluster["client"]
    worker = procs.worker("cpu", name=f"worker-{len(procs.procs)}", **env)
    wait_until(lambda: client.get("/readyz").status_code == 200 and worker.poll() is None, timeout=90,
               what="the worker's heartbeat")
    return worker


@pytest.mark.parametrize("offset_s", [60, -60])
def test_a_worker_whose_clock_is_a_minute_off_serves_as_promptly(cluster: dict, offset_s: int) -> None:
    """Deadlines and batching windows are on Redis's clock: a worker ahead by more than the timeout
    does not drop every request as expired (its callers would wait the full timeout for a 503), and
    one behind does not hold a batch open for the skew (a lone request after a burst waits for the
    company the burst promised, for a window of its own, not for a minute)."""
    client, job = cluster["client"], cluster["job"]
    worker = _start_worker(cluster, PYTHONPATH=f"{REPO / 'tests' / 'clockshift'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                           TORCHYARD_TEST_CLOCK_OFFSET_S=str(offset_s))
    try:
        for round_ in range(3):
            with ThreadPoolExecutor(4) as pool:  # a burst of four: the window then expects four
                burst = list(pool.map(lambda i: _predict(client, job, [_png(i)]), range(4)))
            assert [r.status_code for r in burst] == [200] * 4, [r.text for r in burst]
            began = time.monotonic()
            alone = _predict(client, job, [_png(9)])  # then one alone
            assert alone.status_code == 200, alone.text
            assert time.monotonic() - began < TIMEOUT_S / 2, f"round {round_}: a lone request waited for the skew"
    finally:
        cluster["procs"].stop(worker)


def test_a_request_over_the_cap_is_refused_as_it_streams(cluster: dict) -> None:
    """413 naming the limit, decided as the body streams in: the server answers while most of a
    chunked body (which declares nothing) has not been sent."""
    job = cluster["job"]
    with socket.create_connection(("127.0.0.1", cluster["port"]), timeout=10) as sock:
        boundary = "b0undary"
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"job_id\"\r\n\r\n{job}\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.png\"\r\n\r\n")
        sock.sendall((f"POST /predict HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n"
                      f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n").encode())
        chunk = head.encode() + bytes(256 * 1024)
        sent = 0
        answer = b""
        sock.settimeout(0.05)
        while sent < 20 * MiB and b"\r\n\r\n" not in answer:
            try:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                sent += len(chunk)
                chunk = bytes(256 * 1024)
                answer += sock.recv(65536)
            except (TimeoutError, BlockingIOError):
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.settimeout(5)
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 413"), answer[:200]
    # The image's cap as its part grows, or the request's as the body streams (when the server
    # reads several chunks at once, the gate's count of the body can pass its cap first).
    assert b"limit" in body, body
    assert sent < 8 * MiB  # refused at the limit, not after 20 MiB


def test_a_device_that_breaks_while_serving_takes_its_worker_out_of_service_at_once(cluster: dict) -> None:
    """A sticky device error raised by a /predict forward (the CPU twin: the fault file) is classified
    as a training step's would be: the caller gets a 503 saying so, and the worker leaves at once
    with EXIT_OUT_OF_SERVICE for a fresh process, not after its heartbeat probes have failed."""
    client, job = cluster["client"], cluster["job"]
    fault = cluster["data_dir"] / "device-fault"
    worker = _start_worker(cluster, TORCHYARD_DEVICE_FAULT_FILE=str(fault))
    assert _predict(client, job, [_png(1)]).status_code == 200
    fault.write_text("CUDA error: an illegal memory access was encountered")
    response = _predict(client, job, [_png(2)])
    assert response.status_code == 503 and "out of service" in response.json()["detail"], response.text
    wait_until(lambda: worker.poll() is not None, timeout=30, what="the broken worker to exit")
    assert worker.returncode == 3
    assert not fault.exists()
