"""MLflow tracking's cost to a training job: cifar_net on `fake`, the same job with the worker
tracking to a real `mlflow server` and without, on one embedded Redis and one API, in rounds that
alternate which side goes first (on/off, off/on, ...), so a drift in a shared host's load falls
on both sides alike.

Two figures, because on a shared host the first is noisy:
- the speed ratio: the worker's own images/s per epoch (the job's `metrics`; at a fixed batch,
  steps/s times the batch), each job's first epoch left out (its warm-up); per round, the median
  epoch of the "on" job over that of the "off" job; the median ratio over the rounds, with its
  spread (min, quartiles, max);
- the tracking thread's CPU, load-independent: the thread names its native id in the worker's log
  ("mlflow tracking: client ready (thread N)"), and its utime + stime are read from
  /proc/<pid>/task/<N>/stat when the job is submitted (MLflow's import is over by then) and when it
  ends; against the whole worker process's CPU over the same window, that is the share of the
  job's CPU that tracking took (what a CPU-bound job can lose), and against the window's wall, the
  most it could slow a job even if every one of its ticks stalled the training loop.
Every "on" job's run is checked complete (its record says nothing is behind) before the next job.

    python bench/tracking.py [--rounds 8] [--epochs 4]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import load_average, machine
from harness import Processes, free_port, wait_for_job, wait_until
from harness.mlflow_server import MlflowServer

READY = re.compile(r"mlflow tracking: client ready \(thread (\d+)\)")


def cpu_seconds(stat: Path) -> float:
    """utime + stime of a /proc stat file (a process's, or one thread's under task/), in seconds."""
    fields = stat.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_job(procs: Processes, client: Any, epochs: int, tracking: str | None, name: str) -> dict[str, Any]:
    env = {"TORCHYARD_MLFLOW_TRACKING_URI": tracking} if tracking else {}
    worker = procs.worker("cpu", name=name, **env)  # a log of its own: the thread's id is this process's
    process = Path(f"/proc/{worker.pid}/stat")
    try:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=180, what="the worker")
        thread = None
        if tracking:
            found = wait_until(lambda: READY.findall(procs.log(worker)), timeout=180, what="the tracking thread")
            thread = Path(f"/proc/{worker.pid}/task/{found[-1]}/stat")
        before = (cpu_seconds(process), cpu_seconds(thread) if thread else 0.0, time.monotonic())
        created = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": epochs, "patience": 0,
                                             "seed": 5})
        created.raise_for_status()
        job_id = created.json()["id"]
        job = wait_for_job(client, job_id, {"succeeded", "failed"}, timeout=1800, interval=0.2)
        after = (cpu_seconds(process), cpu_seconds(thread) if thread else 0.0, time.monotonic())
        if job["status"] != "succeeded":
            raise RuntimeError(f"benchmark job failed: {job['error']}")
        shipped = 0.0
        if tracking:
            wait_until(lambda: (run := client.get(f"/jobs/{job_id}").json().get("mlflow")) and run["status"] == "FINISHED"
                       and not run["behind"], timeout=120, what="the run to be complete")
            assert thread is not None
            shipped = cpu_seconds(thread) - after[1]  # the end: status, weights and evaluation uploaded
        return {"ips": [m["images_per_second"] for m in job["metrics"][1:]], "process_cpu": after[0] - before[0],
                "thread_cpu": after[1] - before[1], "wall": after[2] - before[2], "end_cpu": shipped}
    finally:
        procs.stop(worker)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    import httpx

    from app.embedded_redis import EmbeddedRedis

    load_before = load_average()
    loads: list[float] = []
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp:
        root = Path(tmp)
        server = MlflowServer(root / "mlflow").start()
        redis = EmbeddedRedis(root / "redis")
        redis.start()
        procs = Processes(redis.url, root / "data", root / "logs", defaults={},
                          TORCHYARD_VERIFY_BUILTIN_CHECKSUMS="false")
        port = free_port()
        procs.api(port)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        started = time.monotonic()
        try:
            wait_until(lambda: client.get("/healthz").status_code == 200, timeout=60, what="the API")
            for k in range(args.rounds):
                order = ("on", "off") if k % 2 == 0 else ("off", "on")
                result = {side: one_job(procs, client, args.epochs, server.url if side == "on" else None,
                                        f"bench-{k}-{side}") for side in order}
                rounds.append(result)
                loads.append(load_average())
                ratio = statistics.median(result["on"]["ips"]) / statistics.median(result["off"]["ips"])
                print(f"round {k + 1} ({'/'.join(order)}): on {statistics.median(result['on']['ips']):.0f}, "
                      f"off {statistics.median(result['off']['ips']):.0f} images/s, ratio {ratio:.3f}; tracking "
                      f"thread {1000 * result['on']['thread_cpu']:.0f} ms of CPU in a {result['on']['wall']:.1f} s "
                      f"job ({100 * result['on']['thread_cpu'] / result['on']['process_cpu']:.2f} % of the "
                      f"worker's {result['on']['process_cpu']:.1f} s; off: {result['off']['process_cpu']:.1f} s in "
                      f"{result['off']['wall']:.1f} s); load {loads[-1]:.1f}", flush=True)
        finally:
            client.close()
            procs.stop_all()
            redis.stop()
            server.stop()
    ratios = [statistics.median(r["on"]["ips"]) / statistics.median(r["off"]["ips"]) for r in rounds]
    on = [r["on"] for r in rounds]
    thread_cpu = sum(r["thread_cpu"] for r in on)
    process_cpu = sum(r["process_cpu"] for r in on)
    wall = sum(r["wall"] for r in on)
    epochs = args.epochs * len(on)
    q1, med, q3 = quartiles(ratios)
    print(f"host: {machine()}; load average {load_before:.1f} before, {min(loads):.1f}-{max(loads):.1f} between "
          f"rounds, {load_average():.1f} after; {time.monotonic() - started:.0f} s")
    print(f"cifar_net on fake, {args.rounds} rounds (on/off, then off/on, ...) of one {args.epochs}-epoch job each "
          "side (first epoch of each job left out)")
    print(f"speed on / off per round: median {med:.3f}, quartiles {q1:.3f}-{q3:.3f}, min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}; rounds >= 0.97: {sum(r >= 0.97 for r in ratios)} of {len(ratios)}")
    print(f"images/s, all epochs: on median {statistics.median(x for r in on for x in r['ips']):.0f}, "
          f"off median {statistics.median(x for r in rounds for x in r['off']['ips']):.0f}")
    print(f"tracking thread during the jobs: {1000 * thread_cpu:.0f} ms of CPU over {wall:.0f} s and {epochs} epochs "
          f"= {1000 * thread_cpu / wall:.1f} ms per second ({100 * thread_cpu / wall:.2f} % of a core), "
          f"{1000 * thread_cpu / epochs:.1f} ms per epoch, {100 * thread_cpu / process_cpu:.2f} % of the worker "
          f"process's {process_cpu:.0f} s of CPU")
    print(f"after each job's end (status, weights, evaluation): median "
          f"{1000 * statistics.median(r['end_cpu'] for r in on):.0f} ms of CPU, off the job's time")


if __name__ == "__main__":
    main()
