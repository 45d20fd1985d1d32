"""What large /predict requests cost the API process's memory, and how many messages reach Redis.

    .venv/bin/python scripts/measure_predict_memory.py [--repo DIR] [--mib 128] [--tcp]

Starts a Redis (the embedded one on a unix socket, as `torchyard up` runs it; with --tcp a
redis-server on a TCP port with its append-only file, as compose runs it), a CPU worker and one API process from REPO_DIR (default: this checkout;
point it at an export of an older commit, `git archive <commit> | tar -x -C /tmp/old`, to
compare), trains a small job, then freezes the worker (SIGSTOP: requests stay on its list) and
sends one request of the given size (default 128 MiB: one padded PNG), then three at once. For
each it prints the API's peak RSS above its settled RSS (VmHWM, reset before each send through
/proc/<pid>/clear_refs), the time the sends took to reach the list, and the messages on the
device's list. About two minutes here, most of it training.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import redis
from PIL import Image

MiB = 1024**2


def padded_png(total: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue() + bytes(total - len(buffer.getvalue()))


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def wait(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:
            pass
        time.sleep(0.05)
    raise TimeoutError(what)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--mib", type=int, default=128, help="MiB per request")
    parser.add_argument("--tcp", action="store_true", help="Redis on a TCP port (compose) rather than a unix socket")
    parser.add_argument("--asyncio", action="store_true", help="the API on asyncio's own loop (a host without uvloop)")
    args = parser.parse_args()
    repo, size = args.repo, args.mib * MiB
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from app.embedded_redis import EmbeddedRedis, redis_server_binary
    from harness import cli, spawn, stop

    work = Path(tempfile.mkdtemp(prefix="torchyard-measure-"))
    server = EmbeddedRedis(work / "redis")
    if args.tcp:
        (work / "redis").mkdir()
        tcp = subprocess.Popen([redis_server_binary(), "--port", "18632", "--dir", str(work / "redis"),
                                "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url, redis_pid = "redis://127.0.0.1:18632/0", tcp.pid
        wait(lambda: redis.Redis.from_url(url).ping(), 15, "redis-server")
    else:
        url = server.start()
        assert server.process is not None
        redis_pid = server.process.pid
    port = 18631
    env = {**os.environ, "TORCHYARD_REDIS_URL": url, "TORCHYARD_DATA_DIR": str(work / "data"),
           "TORCHYARD_PORT": str(port), "TORCHYARD_API_WORKERS": "1", "PYTHONUNBUFFERED": "1",
           "TORCHYARD_MAX_PREDICT_REQUEST_BYTES": str(size + MiB), "TORCHYARD_MAX_IMAGE_BYTES": str(size),
           "TORCHYARD_PREDICT_MEMORY_BUDGET_BYTES": str(4 * (size + MiB)), "TORCHYARD_PREDICT_TIMEOUT_S": "60",
           "TORCHYARD_HEARTBEAT_TTL_S": "600", "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5"}
    env.pop("TORCHYARD_API_KEY", None)
    api_env = dict(env)
    if args.asyncio:
        here = Path(__file__).resolve().parent.parent
        api_env["PYTHONPATH"] = os.pathsep.join([str(here / "tests" / "no_uvloop"), env.get("PYTHONPATH", "")])
    procs = [spawn(cli(*command), work / "processes.log", process_env, cwd=Path(repo))
             for command, process_env in ((["worker", "--device", "cpu"], env), (["api"], api_env))]
    worker, api = procs
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    store = redis.Redis.from_url(url)
    try:
        wait(lambda: client.get("/readyz").status_code == 200, 120, "the API and a worker")
        job = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()["id"]
        wait(lambda: client.get(f"/jobs/{job}").json()["status"] in ("succeeded", "failed"), 600, "training")
        assert client.get(f"/jobs/{job}").json()["status"] == "succeeded"
        device = client.get("/devices").json()["devices"][0]["id"]
        queue = f"ty:predict:{device}"
        image = padded_png(size - 4096)
        os.kill(worker.pid, signal.SIGSTOP)

        def send() -> int:
            return client.post("/predict", data={"job_id": job},
                               files=[("file", ("big.png", image, "image/png"))]).status_code

        for count in (1, 3):
            store.delete(queue)
            time.sleep(2)
            settled, redis_settled = status_kib(api.pid, "VmRSS"), status_kib(redis_pid, "VmRSS")
            for pid in (api.pid, redis_pid):
                Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
            began = time.monotonic()
            with ThreadPoolExecutor(count) as pool:
                answers = [pool.submit(send) for _ in range(count)]
                wait(lambda: store.llen(queue) >= count, 120, "the messages on the list")  # noqa: B023
                queued_s = time.monotonic() - began
                time.sleep(8)  # a retry of redis-py's would land meanwhile
                peak, redis_peak = status_kib(api.pid, "VmHWM"), status_kib(redis_pid, "VmHWM")
                on_list = store.llen(queue)
                store.delete(queue)
                statuses = [a.result() for a in answers]
            print(f"{count} × {size / MiB:.0f} MiB: API RSS {settled / 1024:.0f} MiB settled, peak "
                  f"{peak / 1024:.0f} MiB (+{(peak - settled) / 1024:.0f} MiB, {(peak - settled) * 1024 / size:.2f} "
                  f"request sizes); on the list after {queued_s:.1f} s; {on_list} message(s) on the list; "
                  f"answers {statuses}; Redis's peak RSS +{(redis_peak - redis_settled) / 1024:.0f} MiB", flush=True)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        for proc in procs:
            stop(proc, grace=30)
        client.close()
        if args.tcp:
            tcp.terminate()
            tcp.wait()
        server.stop()


if __name__ == "__main__":
    main()
