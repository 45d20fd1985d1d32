"""MLflow tracking's cost to a training job: cifar_net on `fake`, the same jobs with the worker
tracking to a real `mlflow server` and without, alternated in one run (on, off, on, off, ...) on
one embedded Redis and one API, so drift in the host's load falls on both sides alike.

The figure is the worker's own images/s per epoch (the job's `metrics`; at a fixed batch, steps/s
times the batch), the first epoch of each job left out (its warm-up), medians per side; the
ratio on/off is what docs/benchmarks.md "MLflow tracking's cost" quotes. Every "on" job's run is
checked to be complete (its record says nothing is behind), so the cost counted is the real one.

    python bench/tracking.py [--rounds 3] [--epochs 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import load_average, machine
from harness import Processes, free_port, wait_for_job, wait_until
from harness.mlflow_server import MlflowServer


def one_job(procs: Processes, client: object, epochs: int, tracking: str | None) -> list[float]:
    import httpx

    assert isinstance(client, httpx.Client)
    env = {"TORCHYARD_MLFLOW_TRACKING_URI": tracking} if tracking else {}
    worker = procs.worker("cpu", name="bench", **env)
    try:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=120, what="the worker")
        created = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": epochs, "patience": 0,
                                             "seed": 5})
        created.raise_for_status()
        job_id = created.json()["id"]
        job = wait_for_job(client, job_id, {"succeeded", "failed"}, timeout=1800, interval=0.5)
        if job["status"] != "succeeded":
            raise RuntimeError(f"benchmark job failed: {job['error']}")
        if tracking:
            wait_until(lambda: (run := client.get(f"/jobs/{job_id}").json().get("mlflow")) and run["status"] == "FINISHED"
                       and not run["behind"], timeout=120, what="the run to be complete")
        return [m["images_per_second"] for m in job["metrics"][1:]]
    finally:
        procs.stop(worker)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    import httpx

    from app.embedded_redis import EmbeddedRedis

    load_before = load_average()
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
        sides: dict[str, list[float]] = {"on": [], "off": []}
        started = time.monotonic()
        try:
            wait_until(lambda: client.get("/healthz").status_code == 200, timeout=60, what="the API")
            for _ in range(args.rounds):
                sides["on"] += one_job(procs, client, args.epochs, server.url)
                sides["off"] += one_job(procs, client, args.epochs, None)
        finally:
            client.close()
            procs.stop_all()
            redis.stop()
            server.stop()
    on, off = statistics.median(sides["on"]), statistics.median(sides["off"])
    print(f"host: {machine()}; load average {load_before:.1f} before, {load_average():.1f} after; "
          f"{time.monotonic() - started:.0f} s")
    print(f"cifar_net on fake, {args.rounds} rounds of {args.epochs} epochs (first epoch of each job left out)")
    print(f"tracking on : median {on:.0f} images/s over {len(sides['on'])} epochs "
          f"(min {min(sides['on']):.0f}, max {max(sides['on']):.0f})")
    print(f"tracking off: median {off:.0f} images/s over {len(sides['off'])} epochs "
          f"(min {min(sides['off']):.0f}, max {max(sides['off']):.0f})")
    print(f"on / off: {on / off:.3f}")


if __name__ == "__main__":
    main()
