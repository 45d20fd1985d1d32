"""/predict's memory in the API and its sends to Redis, with real processes over real sockets: what
an API process really holds for large requests (its resident memory, on uvloop and on asyncio's
own loop), that a request reaches Redis once however slow the link or late the reply, and that
bodies which hold bytes without sending them (silent, trickled, many from one address) cannot
refuse everybody else's requests."""

from __future__ import annotations

import io
import os
import select
import signal
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
from PIL import Image

from tests.faulty_link import FaultyLink
from tests.support import REPO, Processes, flush, free_port, read_until_closed, wait_for_job, wait_until, with_db

pytestmark = pytest.mark.e2e

MiB = 1024**2
DB = 12
TIMEOUT_S = 60
# A test's worker keeps its device alive this long after it is SIGKILLed: the API still counts on
# it, so the requests it is sent stay on its list, to be counted (a frozen worker's intake would
# take the first one off the list into its socket).
DEAD_TTL_S = "120"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_base_url: str) -> Iterator[dict]:
    """One trained job; each test starts the API (its limits) and the worker it needs."""
    url = with_db(redis_base_url, DB)
    flush(url)
    data_dir = tmp_path_factory.mktemp("budget")
    procs = Processes(url, data_dir, data_dir / "logs", TORCHYARD_PREDICT_TIMEOUT_S=str(TIMEOUT_S))
    worker = procs.worker("cpu")
    try:
        client, _ = _api(procs, "trainer")
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=90, what="a worker heartbeat")
        job = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()
        assert wait_for_job(client, job["id"], {"succeeded", "failed"})["status"] == "succeeded"
        device = client.get("/devices").json()["devices"][0]["id"]
        procs.stop(worker)
        yield {"procs": procs, "job": job["id"], "url": url, "redis_base_url": redis_base_url,
               "queue": f"ty:predict:{device}", "redis": redis.Redis.from_url(url)}
    finally:
        procs.stop_all()
        flush(url)


def _api(procs: Processes, name: str, **env: str) -> tuple[httpx.Client, subprocess.Popen]:
    port = free_port()
    proc = procs.spawn(f"api-{name}", "api", TORCHYARD_PORT=str(port), **env)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT_S + 60)
    wait_until(lambda: client.get("/healthz").status_code == 200, timeout=60, what=f"the API {name}")
    return client, proc


def _worker(cluster: dict, client: httpx.Client) -> subprocess.Popen:
    worker = cluster["procs"].worker("cpu", name=f"worker-{uuid.uuid4().hex[:6]}", TORCHYARD_HEARTBEAT_TTL_S=DEAD_TTL_S)
    wait_until(lambda: client.get("/readyz").status_code == 200 and worker.poll() is None, timeout=90,
               what="the worker's heartbeat")
    return worker


def _image(total: int, marker: bytes = b"") -> bytes:
    """A valid PNG, then `marker` and zeros up to `total` bytes (decoders stop at the image's end)."""
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(buffer, "PNG")
    head = buffer.getvalue() + marker
    return head + bytes(total - len(head))


def _predict(client: httpx.Client, job: str, image: bytes, name: str = "x.png") -> httpx.Response:
    return client.post("/predict", data={"job_id": job}, files=[("file", (name, image, "image/png"))])


def _kib(pid: int, field: str) -> int:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith(field + ":"))
    return int(line.split()[1])


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_the_budget_bounds_what_the_api_process_really_holds(cluster: dict, loop: str) -> None:
    """With the worker frozen, two 23 MiB requests fill most of a 48 MiB budget and a third is
    refused (503, Retry-After); meanwhile the API's peak resident memory grows by what the budget
    counts, not more: sending a request to Redis makes no whole copy of it (asyncio's transport
    made three of each request it wrote), and each request is on the list once."""
    job, store, queue, procs = cluster["job"], cluster["redis"], cluster["queue"], cluster["procs"]
    env = {"TORCHYARD_MAX_IMAGE_BYTES": str(23 * MiB), "TORCHYARD_MAX_PREDICT_REQUEST_BYTES": str(24 * MiB),
           "TORCHYARD_PREDICT_MEMORY_BUDGET_BYTES": str(48 * MiB), "TORCHYARD_PREDICT_MEMORY_PER_CLIENT_BYTES": "0"}
    if loop == "asyncio":
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "no_uvloop"), os.environ.get("PYTHONPATH", "")])
    client, api = _api(procs, loop, **env)
    worker = _worker(cluster, client)
    image = _image(23 * MiB - 4096)
    try:
        assert _predict(client, job, _image(64 * 1024)).status_code == 200  # what a first request loads
        procs.stop(worker, signal.SIGKILL)
        settled = _kib(api.pid, "VmRSS")
        Path(f"/proc/{api.pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(_predict, client, job, image) for _ in range(2)]
            wait_until(lambda: store.llen(queue) == 2, timeout=60, what="both requests on the dead worker's list")
            refused = _predict(client, job, image)
            assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
            assert "TORCHYARD_PREDICT_MEMORY_BUDGET_BYTES" in refused.json()["detail"]
            grown_mib = (_kib(api.pid, "VmHWM") - settled) / 1024
            assert store.llen(queue) == 2  # each once: nothing was sent again
            worker = _worker(cluster, client)  # takes over the device of the one that crashed, and its list
            answers = [f.result() for f in held]
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        # The budget (48 MiB) and what the process needs besides, never a copy per request.
        assert grown_mib < 48 + 16, f"the API grew by {grown_mib:.0f} MiB for 48 MiB of budget"
        # Once they are answered their bytes are given back: the same request is admitted again.
        assert _predict(client, job, image).status_code == 200
    finally:
        procs.stop(worker)
        procs.stop(api)
        store.delete(queue)


@pytest.fixture
def link(cluster: dict) -> Iterator[FaultyLink]:
    faulty = FaultyLink(cluster["redis_base_url"])
    yield faulty
    faulty.close()


def test_a_request_slower_to_send_than_the_socket_timeout_reaches_redis_once(cluster: dict,
                                                                           link: FaultyLink) -> None:
    """The API's Redis behind a 1 MiB/s link: an 8 MiB request takes 8 s to send, longer than
    redis-py's 5 s socket timeout. It used to be cut at 5 s and sent again, up to four times (or
    queued several times when the first had in fact arrived), then answered 503; now a send may
    take as long as its size needs, as long as Redis keeps taking bytes, and it is answered."""
    job, procs = cluster["job"], cluster["procs"]
    marker = uuid.uuid4().hex.encode()
    client, api = _api(procs, "slow-link", TORCHYARD_REDIS_URL=link.url(DB), TORCHYARD_MAX_IMAGE_BYTES=str(9 * MiB),
                       TORCHYARD_MAX_PREDICT_REQUEST_BYTES=str(10 * MiB))
    worker = _worker(cluster, client)
    try:
        link.rate = MiB
        link.count(marker)
        answer = _predict(client, job, _image(8 * MiB, marker))
        link.rate = None
        assert answer.status_code == 200, answer.text
        assert link.marked == 1  # sent once
    finally:
        procs.stop(worker)
        procs.stop(api)


def test_a_request_whose_queueing_reply_is_lost_is_not_queued_again(cluster: dict, link: FaultyLink) -> None:
    """Redis runs the script that queues a request, and its reply never comes back (held on the
    link). The API used to send it again on a fresh connection, three times: four copies on the
    list, each computed. It is now sent once; the caller gets a 503 (Redis did not answer), and
    the one copy is what the worker computes."""
    job, procs, store, queue = cluster["job"], cluster["procs"], cluster["redis"], cluster["queue"]
    client, api = _api(procs, "lost-reply", TORCHYARD_REDIS_URL=link.url(DB))
    worker = _worker(cluster, client)
    try:
        assert _predict(client, job, _image(4096)).status_code == 200
        procs.stop(worker, signal.SIGKILL)  # what reaches the list stays there to be counted
        marker = uuid.uuid4().hex.encode()
        link.hold_replies_after(marker)
        answer = _predict(client, job, _image(64 * 1024, marker))
        link.release()
        assert answer.status_code == 503 and "Redis" in answer.json()["detail"], answer.text
        assert link.marked == 1
        assert store.llen(queue) == 1
    finally:
        link.release()
        procs.stop(worker)
        procs.stop(api)
        store.delete(queue)


def _multipart_head(port: int, job: str, boundary: str, declared: int | None) -> bytes:
    length = f"Content-Length: {declared}\r\n" if declared is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST /predict HTTP/1.1\r\nHost: localhost:{port}\r\n{length}"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n").encode()


def _part_start(job: str, boundary: str) -> bytes:
    return (f"--{boundary}\r\nContent-Disposition: form-data; name=\"job_id\"\r\n\r\n{job}\r\n--{boundary}\r\n"
            f"Content-Disposition: form-data; name=\"file\"; filename=\"slow.png\"\r\n\r\n").encode()


def test_silent_trickling_and_one_address_bodies_do_not_refuse_others(cluster: dict) -> None:
    """Budget 8 MiB, requests up to 4 MiB. Four connections declare 4 MiB and send nothing, a fifth
    trickles: a declared length used to be reserved whole before a byte arrived, so they held the
    budget and every honest /predict got 503 for as long as they waited. Then one other address
    sends 1.25 MiB on each of four connections and holds them: it gets its share (the budget less
    one largest request) and no more. Through both, an honest request gets its 200."""
    job, procs = cluster["job"], cluster["procs"]
    client, api = _api(procs, "slow-bodies", TORCHYARD_MAX_IMAGE_BYTES=str(3 * MiB),
                       TORCHYARD_MAX_PREDICT_REQUEST_BYTES=str(4 * MiB),
                       TORCHYARD_PREDICT_MEMORY_BUDGET_BYTES=str(8 * MiB))
    worker = _worker(cluster, client)
    port, boundary, honest = int(client.base_url.port or 0), "b0undary", _image(int(2.9 * MiB))
    held: list[socket.socket] = []
    stop = threading.Event()
    try:
        for _ in range(4):  # silent: the head only
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(_multipart_head(port, job, boundary, 4 * MiB))
            held.append(sock)
        trickler = socket.create_connection(("127.0.0.1", port))
        held.append(trickler)
        trickler.sendall(_multipart_head(port, job, boundary, 4 * MiB) + _part_start(job, boundary))

        def trickle() -> None:
            while not stop.wait(0.1):
                trickler.sendall(bytes(1024))

        threading.Thread(target=trickle, daemon=True).start()
        answer = _predict(client, job, honest)
        assert answer.status_code == 200, answer.text

        # One address (127.0.0.2) holding bytes it did send, on as many connections as it likes.
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
            held.append(sock)
            sock.sendall(_multipart_head(port, job, boundary, None))
            body = _part_start(job, boundary) + bytes(int(1.25 * MiB))
            sock.sendall(f"{len(body):x}\r\n".encode() + body + b"\r\n")
        # The one past its share is answered (503) and closed; the others wait, holding their bytes.
        readable, _, _ = select.select(held[-4:], [], [], 30)
        refusals = [read_until_closed(sock) for sock in readable]
        assert refusals and all(r.startswith(b"HTTP/1.1 503") and b"TORCHYARD_PREDICT_MEMORY_PER_CLIENT_BYTES" in r
                                for r in refusals), refusals
        answer = _predict(client, job, honest)
        assert answer.status_code == 200, answer.text
    finally:
        stop.set()
        for sock in held:
            sock.close()
        procs.stop(worker)
        procs.stop(api)
