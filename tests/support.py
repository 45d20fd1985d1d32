"""What the tests share besides the harness: probes of sockets and Redis, the API of a test's own, two
"hosts" on one Redis, a job's event stream as a client reads it, small learnable inputs.

The processes themselves (launched in a group of their own, waited for, stopped) are the
harness's (harness/, shared with bench/ and scripts/); its names the tests use are re-exported here.
"""

from __future__ import annotations

import io
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import redis

from harness import REPO as REPO
from harness import Processes as Processes
from harness import free_port as free_port
from harness import wait_for_job as wait_for_job
from harness import wait_until as wait_until
from harness import with_db as with_db

TEST_DB = 13  # a dedicated database; the tests flush this one and nothing else


def connects(host: str, port: int) -> bool:
    """Whether a TCP connection to host:port is accepted (False: refused, or no such address here)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(5)
        try:
            probe.connect((host, port))
        except OSError:
            return False
        return True


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """What a server sent on `sock` until it closed it (or until `timeout` passed without a byte)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def flush(url: str) -> None:
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()


def png_bytes(array) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


@contextmanager
def own_api(redis_url: str, root: Path, **env: str) -> Iterator[dict]:
    """An API of a test's own under `root` (data/, logs/), with `env`; the test starts its workers.
    Yields {"procs", "client", "data_dir"}; everything it started is stopped at the end."""
    procs = Processes(redis_url, root / "data", root / "logs", **env)
    client = httpx.Client(base_url=procs.ready_api(), timeout=60)
    try:
        yield {"procs": procs, "client": client, "data_dir": root / "data"}
    finally:
        client.close()
        procs.stop_all()


@contextmanager
def two_hosts(root: Path, timeout: float = 180, **env: str) -> Iterator[dict]:
    """An embedded Redis the test may kill, the API, and CPU workers on two "hosts" (h1, h2:
    TORCHYARD_NODE_NAME) sharing that Redis and one data dir under `root`, with `env`; yields
    {"client", "procs", "workers", "server", "url", "data_dir"} once both workers are idle. Frozen
    workers are thawed and everything is stopped at the end."""
    import signal

    from app.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis(root / "redis")
    url = server.start()
    procs = Processes(url, root / "data", root / "logs", **env)
    workers = {node: procs.worker("cpu", name=node, TORCHYARD_NODE_NAME=node) for node in ("h1", "h2")}
    port = free_port()
    procs.api(port)
    key = env.get("TORCHYARD_API_KEY")  # the client carries the bootstrap key when the API has one
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                          headers={"Authorization": f"Bearer {key}"} if key else None)
    try:
        wait_until(lambda: {d["id"] for d in client.get("/devices").json()["devices"] if d["status"] == "idle"}
                   >= {"h1/cpu", "h2/cpu"}, timeout=timeout, what="workers h1 and h2")
        yield {"client": client, "procs": procs, "workers": workers, "server": server, "url": url,
               "data_dir": root / "data"}
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        client.close()
        procs.stop_all()
        server.stop()


# ---------------------------------------------------------------------------------------------
# What the end-to-end fault tests read and send (tests/e2e/test_faults*.py, test_gangs.py): a job's
# event stream as a client reads it, the check that a job ran once, and small learnable inputs.

TERMINAL = {"succeeded", "failed", "cancelled"}


def submit_cifar(client: httpx.Client, epochs: int, **params) -> str:
    """A cifar_net job on the built-in `fake` set, early stopping off (long jobs stay long)."""
    created = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": epochs, "patience": 0,
                                         **params})
    assert created.status_code == 202, created.text
    return created.json()["id"]


def get_job(client: httpx.Client, job_id: str) -> dict:
    return client.get(f"/jobs/{job_id}").json()


def read_sse(client: httpx.Client, job_id: str, last_event_id: str | None = None,
             stop_after: int | None = None) -> list[tuple[str, str, dict]]:
    """(id, event, data) triples; stops at the stream's end, or after `stop_after` events."""
    import json

    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    out: list[tuple[str, str, dict]] = []
    current: dict[str, str] = {}
    with client.stream("GET", f"/jobs/{job_id}/events", headers=headers, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line:
                if "id" in current:
                    out.append((current["id"], current["event"], json.loads(current["data"])))
                    if stop_after and len(out) >= stop_after:
                        return out
                current = {}
                continue
            key, _, value = line.partition(": ")
            current[key] = value
    return out


def job_events(client: httpx.Client, job_id: str, last_event_id: str | None = None) -> list[tuple[str, dict]]:
    """(event, data) pairs of a job's whole stream (or from `last_event_id` on)."""
    return [(kind, data) for _, kind, data in read_sse(client, job_id, last_event_id)]


def assert_ran_once(client: httpx.Client, job: dict, epochs: int) -> None:
    """Each epoch recorded once (in the record and in the event stream), one terminal status."""
    assert [m["epoch"] for m in job["metrics"]] == list(range(1, epochs + 1))
    events = job_events(client, job["id"])
    per_epoch = [data["epoch"] for kind, data in events if kind == "metrics"]
    assert sorted(per_epoch) == list(range(1, epochs + 1)), per_epoch
    assert [data["status"] for kind, data in events if kind == "status" and data["status"] in TERMINAL] == [job["status"]]


def pattern_png(label: int) -> bytes:
    """A 32x32 PNG of class `label` of the built-in `fake` set: what its models recognise."""
    import torch

    from worker.data.datasets import fake_images

    image = fake_images(torch.tensor([label]), 3, 32, 32, seed=4242)[0]
    return png_bytes(image.permute(1, 2, 0).numpy())


def pattern_zip() -> bytes:
    """A dataset upload of four pattern PNGs, two classes of two."""
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for label in (1, 2):
            for k in range(2):
                archive.writestr(f"c{label}/{k}.png", pattern_png(label))
    return buffer.getvalue()


_LOCK_HOLDER = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def hold_flock(lock: Path) -> subprocess.Popen:
    """Another worker stuck while it holds a file lock (a decoded set's, worker/data/datasets.py): a process
    that takes the exclusive flock on `lock` and sleeps. Returns once it holds it; the caller kills it."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held", "the lock holder did not start"
    return holder
