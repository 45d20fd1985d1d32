"""`torchyard api` as several processes on one port (TORCHYARD_API_WORKERS): requests are spread
over the children, /metrics sums every child's counters whichever child answers the scrape and
reports the cluster once, a SIGKILLed child is replaced, SIGTERM stops them all and removes the
metrics directory, and a SIGKILLed parent takes its children with it."""

from __future__ import annotations

import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from tests.support import Processes, free_port, wait_until

pytestmark = pytest.mark.e2e

WORKERS = 2


def _serving_children(parent: int, port: int) -> list[psutil.Process]:
    """The parent's children that hold the listening socket (not multiprocessing's resource tracker)."""
    serving = []
    for child in psutil.Process(parent).children():
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in child.net_connections("tcp")):
                serving.append(child)
        except psutil.NoSuchProcess:
            pass
    return serving


def _get_on_fresh_connections(url: str, count: int, threads: int = 8) -> list[int]:
    """`count` GETs, each on its own connection, `threads` at a time (so both children accept some)."""
    def one(_: int) -> int:
        with httpx.Client(timeout=30) as client:
            return client.get(url).status_code

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(count)))


def _healthz_count(text: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "torchyard_http_requests_total" and s.labels == {"method": "GET", "route": "/healthz",
                                                                          "status": "200"}:
                return s.value
    return None


def _per_process_healthz(metrics_dir: Path) -> dict[int, float]:
    """Each process's own count, read from its file the way the scrape reads them all."""
    counts = {}
    for path in metrics_dir.glob("counter_*.db"):
        for metric in MultiProcessCollector.merge([str(path)], accumulate=False):
            for s in metric.samples:
                if s.labels.get("route") == "/healthz" and s.name == "torchyard_http_requests_total":
                    counts[int(path.stem.split("_")[1])] = s.value
    return counts


def _start(procs: Processes, tmp: Path) -> tuple[subprocess.Popen, int]:
    """An API of WORKERS processes, its temp dir (where the metrics dir goes) under `tmp`; returns
    once every child has finished its start-up, without a request (the counts start at 0)."""
    port = free_port()
    api = procs.api(port, TORCHYARD_API_WORKERS=str(WORKERS), TMPDIR=str(tmp))
    wait_until(lambda: procs.log(api).count("Application startup complete.") >= WORKERS, timeout=90,
               what=f"{WORKERS} API processes to start")
    wait_until(lambda: len(_serving_children(api.pid, port)) == WORKERS, timeout=10, what="the children listening")
    return api, port


def _metrics_dir(tmp: Path, api: subprocess.Popen) -> Path:
    [path] = tmp.glob(f"torchyard-api-metrics-{api.pid}-*")
    return path


@pytest.fixture
def procs(redis_url: str, tmp_path: Path):
    procs = Processes(redis_url, tmp_path / "data", tmp_path / "logs")
    try:
        yield procs
    finally:
        procs.stop_all()


def test_requests_spread_over_processes_and_metrics_sum_them(procs: Processes, tmp_path: Path) -> None:
    api, port = _start(procs, tmp_path)
    base = f"http://127.0.0.1:{port}"
    sent = 40
    assert _get_on_fresh_connections(f"{base}/healthz", sent) == [200] * sent

    children = {p.pid for p in _serving_children(api.pid, port)}
    metrics_dir = _metrics_dir(tmp_path, api)
    per_process = wait_until(lambda: (c := _per_process_healthz(metrics_dir)) and sum(c.values()) == sent and c,
                             timeout=10, what="every request counted in its process's file")
    served_by = {pid for pid, n in per_process.items() if n > 0}
    assert len(served_by) > 1 and served_by <= children, (per_process, children)

    # Whichever child answers a scrape (fresh connections, so both do), the count is the sum.
    answers = [httpx.get(f"{base}/metrics", timeout=30) for _ in range(8)]
    for answer in answers:
        assert answer.status_code == 200
        assert _healthz_count(answer.text) == sent
        # The cluster's state is read once per scrape, by the answering process only.
        lines = answer.text.splitlines()
        assert sum(line.startswith("torchyard_redis_up ") for line in lines) == 1
        assert lines.count("# TYPE torchyard_jobs gauge") == 1
        assert lines.count("# TYPE torchyard_http_requests_total counter") == 1
    scrapes = _per_process_healthz(metrics_dir)  # unchanged by the scrapes themselves
    assert scrapes == per_process


def test_a_killed_child_is_replaced_and_sigterm_stops_them_all(procs: Processes, tmp_path: Path) -> None:
    api, port = _start(procs, tmp_path)
    base = f"http://127.0.0.1:{port}"
    assert _get_on_fresh_connections(f"{base}/healthz", 10) == [200] * 10
    metrics_dir = _metrics_dir(tmp_path, api)

    victim, survivor = _serving_children(api.pid, port)
    victim.kill()
    victim.wait(10)
    assert _get_on_fresh_connections(f"{base}/healthz", 20) == [200] * 20  # the survivor serves meanwhile
    replacement = wait_until(lambda: [p for p in _serving_children(api.pid, port) if p.pid != survivor.pid],
                             timeout=60, what="uvicorn to start a new child")[0]
    assert replacement.pid != victim.pid
    wait_until(lambda: procs.log(api).count("Application startup complete.") >= WORKERS + 1, timeout=60,
               what="the new child to start")
    # The dead child's requests still count (a counter never goes down).
    assert wait_until(lambda: _healthz_count(httpx.get(f"{base}/metrics").text) == 30, timeout=10,
                      what="30 requests counted")

    children = psutil.Process(api.pid).children(recursive=True)
    assert len(children) >= WORKERS
    started = time.monotonic()
    api.send_signal(signal.SIGTERM)
    assert api.wait(30) == 0
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children),
               timeout=10, what="every child to exit")
    assert time.monotonic() - started < 10
    assert not metrics_dir.exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/healthz")


def test_a_killed_parent_takes_its_children_and_its_stale_metrics_go(procs: Processes, tmp_path: Path) -> None:
    api, port = _start(procs, tmp_path)
    children = _serving_children(api.pid, port)
    metrics_dir = _metrics_dir(tmp_path, api)
    api.kill()  # no chance to clean up: the children die by their parent-death signal
    api.wait(10)
    alive = psutil.wait_procs(children, timeout=15)[1]
    assert alive == [], f"left serving: {[p.pid for p in alive]}"
    assert metrics_dir.exists()

    second, _ = _start(procs, tmp_path)  # its start removes the dead parent's directory
    assert not metrics_dir.exists()
    assert _metrics_dir(tmp_path, second).exists()
