"""The service's own CPU per /predict request (issue 40, item 4): what the API, Redis and the worker
spend on a request beyond its image's decode and its share of the forward, and, with `--against`,
the same figures of another commit's service measured in the same run, interleaved.

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/service_cost.py [--against REV
        [--against-without MODULE]] [--rounds 3]

One checkpoint (cifar_net, untrained weights: bench/floors.make_checkpoint), one embedded Redis, one
CPU worker and the API with its default processes, started afresh for every side of every round,
from that side's checkout (`--against REV` checks REV out in a temporary git worktree, so both
sides run their own code on the same data, one after the other; the order alternates per round,
so a host that drifts over minutes favours neither). Each cell is a closed loop of one request
kind at `--concurrency` clients (bench/harness.load: the CPU each process and its children spent,
per request): the 32×32 PNG of bench/predict.py and the 500×375 photo JPEG of bench/photos.py.

The service's own CPU per request is API + Redis + worker, less what this process measures the
image's decode to cost (worker/data/image_array.decode_image, the transform the worker runs, one
thread) and the forward's CPU per image at the cell's mean batch (bench/floors.raw_forward in a
fresh process on one thread, the service's setting for this light model). The load client's own
CPU is shown apart: it is not the service's. The subtraction is the same for both sides, so the
ratio of the two sides' figures does not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# after the sys.path entry above
from bench.floors import make_checkpoint  # noqa: E402
from bench.harness import fresh_json, hiding, load, load_average, machine, multipart_request  # noqa: E402
from bench.photo_data import sample_jpeg  # noqa: E402
from bench.predict import HEARTBEAT_S, batch_histogram, sample_png  # noqa: E402

MODEL = "cifar_net"
PROCESSES = ("api", "redis", "worker")


def images() -> dict[str, bytes]:
    return {"png 32×32": sample_png(), "jpeg 500×375": sample_jpeg()}


def decode_cpu_us(data: bytes, seconds: float = 1.0) -> float:
    """CPU per decode of `data` to cifar_net's input, this process, one thread."""
    from worker.data.image_array import InputSpec, decode_image

    spec = InputSpec(3, 32, 32)
    decode_image(data, spec, 10**8)
    count, cpu0, stop = 0, time.process_time(), time.perf_counter() + seconds
    while time.perf_counter() < stop:
        decode_image(data, spec, 10**8)
        count += 1
    return (time.process_time() - cpu0) * 1e6 / count


def forward_cpu_us(checkpoint: Path, batch: int) -> float:
    """CPU per image of the traced forward at `batch`, one thread, a fresh process."""
    out = fresh_json(["-m", "bench.floors", "forward", str(checkpoint), str(batch), "1", "1.0", "cpu", "fp32"],
                     {**os.environ, "OMP_NUM_THREADS": "1"})
    traced = [m for m in out if m["graph"] == "traced"] or out
    return min(m["cpu_us_per_image"] for m in traced)


def checkout(rev: str) -> Path:
    """`rev` in a temporary detached worktree of this repository (removed by `remove_checkout`)."""
    path = Path(tempfile.mkdtemp(prefix="torchyard-against-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(path), rev], check=True,
                   capture_output=True)
    return path


def remove_checkout(path: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], capture_output=True)


def measure_side(root: Path, work: Path, checkpoint_job: str, concurrency: int, seconds: float,
                 hide: tuple[str, ...] = ()) -> dict[str, Any]:
    """The service of checkout `root` on `work`'s data: every image kind at `concurrency` clients,
    without the modules in `hide`."""
    import httpx
    import redis

    from app.embedded_redis import EmbeddedRedis
    from core import keys
    from harness.processes import cli, free_port, spawn, stop, wait_until
    from harness.stack import with_db

    server = EmbeddedRedis(work / f"redis-{time.monotonic_ns()}")
    server.start()
    url = with_db(server.url, 0)
    redis.Redis.from_url(url).hset(keys.job(checkpoint_job), mapping={"id": checkpoint_job, "status": "succeeded"})
    env = {**os.environ, "TORCHYARD_REDIS_URL": url, "TORCHYARD_DATA_DIR": str(work / "data"), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([*([hiding(work, list(hide))] if hide else []), str(root)]),
           "TORCHYARD_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S), "TORCHYARD_HEARTBEAT_TTL_S": "5"}
    env.pop("TORCHYARD_API_KEY", None)
    env.pop("TORCHYARD_API_WORKERS", None)  # the API's default processes
    port = free_port()
    logs = work / "logs"
    procs = []
    try:
        procs.append(spawn(cli("worker", "--device", "cpu"), logs / f"worker-{root.name}.log", env, cwd=root))
        procs.append(spawn(cli("api"), logs / f"api-{root.name}.log", {**env, "TORCHYARD_PORT": str(port)}, cwd=root))
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200, timeout=120,
                   what="the API and a worker")
        assert server.process is not None
        pids = {"api": procs[1].pid, "worker": procs[0].pid, "redis": server.process.pid}
        cells: dict[str, Any] = {}
        for name, data in images().items():
            request = multipart_request(port, "/predict", data, {"job_id": checkpoint_job, "top_k": "5"},
                                        filename="x.jpg" if name.startswith("jpeg") else "x.png")
            before = batch_histogram(port)
            cell = dict(load(port, request, concurrency, seconds, pids))
            after = batch_histogram(port)
            sizes = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
            batches = sum(sizes.values())
            cell["mean_batch"] = sum(k * v for k, v in sizes.items()) / batches if batches else 1.0
            cells[name] = cell
        return cells
    finally:
        for proc in reversed(procs):
            stop(proc)
        server.stop()


def own_cpu(cell: dict[str, Any], decode_us: float, forward_us: float) -> float:
    """ms of CPU per request the service spends beyond the decode and the forward."""
    return sum(cell[f"{p}_cpu_ms"] for p in PROCESSES) - (decode_us + forward_us) / 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="torchyard-cost-"))
    job_id, checkpoint = make_checkpoint(work / "data", MODEL)
    decode_us = {name: decode_cpu_us(data) for name, data in images().items()}
    sides: dict[str, Path] = {"this": REPO}
    if args.against:
        sides["against"] = checkout(args.against)
    rounds: list[dict[str, Any]] = []
    try:
        for number in range(args.rounds):
            order = list(sides) if number % 2 == 0 else list(reversed(sides))
            measured = {side: measure_side(sides[side], work, job_id, args.concurrency, args.seconds,
                                           tuple(args.against_without) if side == "against" else ())
                        for side in order}
            rounds.append(measured)
            print(f"round {number + 1}: {json.dumps(measured)}", file=sys.stderr)
    finally:
        if args.against:
            remove_checkout(sides["against"])
    batches = {round(c["mean_batch"]) for r in rounds for cells in r.values() for c in cells.values()}
    forward_us = {b: forward_cpu_us(checkpoint, max(b, 1)) for b in batches}
    summary: dict[str, Any] = {}
    for side in sides:
        for name in images():
            cells = [r[side][name] for r in rounds]
            own = [own_cpu(c, decode_us[name], forward_us[round(c["mean_batch"])]) for c in cells]
            summary.setdefault(side, {})[name] = {
                "own_cpu_ms": statistics.median(own), "own_cpu_ms_each": own,
                **{f"{p}_cpu_ms": statistics.median(c[f"{p}_cpu_ms"] for c in cells) for p in (*PROCESSES, "client")},
                "images_s": statistics.median(c["images_s"] for c in cells),
                "mean_batch": statistics.median(c["mean_batch"] for c in cells)}
    return {"summary": summary, "decode_us": decode_us, "forward_us": forward_us, "rounds": rounds}


def report(args: argparse.Namespace, result: dict[str, Any], load_before: float) -> str:
    lines = [f"Command: `bench/service_cost.py --rounds {args.rounds} --seconds {args.seconds:g} "
             f"--concurrency {args.concurrency}" + (f" --against {args.against}" if args.against else "")
             + "".join(f" --against-without {m}" for m in args.against_without) + "`",
             f"Host: {machine()}; load average (1 min) {load_before:.1f} before, {load_average():.1f} after.", "",
             "| side | image | own CPU per request (median; each round) | API | Redis | worker | client | img/s | "
             "mean batch |", "|---|---|---|---|---|---|---|---|---|"]
    for side, cells in result["summary"].items():
        for name, c in cells.items():
            each = ", ".join(f"{v:.3f}" for v in c["own_cpu_ms_each"])
            lines.append(f"| {side} | {name} | **{c['own_cpu_ms']:.3f} ms** ({each}) | {c['api_cpu_ms']:.3f} | "
                         f"{c['redis_cpu_ms']:.3f} | {c['worker_cpu_ms']:.3f} | {c['client_cpu_ms']:.3f} | "
                         f"{c['images_s']:,.0f} | {c['mean_batch']:.1f} |")
    decode = ", ".join(f"{k} {v:.0f} µs" for k, v in result["decode_us"].items())
    forward = ", ".join(f"batch {k} {v:.0f} µs" for k, v in sorted(result["forward_us"].items()))
    lines += ["", f"Subtracted: the decode's CPU per image ({decode}); the forward's per image ({forward})."]
    if "against" in result["summary"]:
        for name in images():
            this, other = (result["summary"][s][name]["own_cpu_ms"] for s in ("this", "against"))
            lines.append(f"- {name}: own CPU per request {other:.3f} → {this:.3f} ms ({this / other:.2f}×)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="a commit whose service is measured beside this checkout's")
    parser.add_argument("--against-without", action="append", default=[], metavar="MODULE",
                        help="a module the --against side cannot import (a dependency added since it: hiredis)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per cell")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    args = parser.parse_args()
    load_before = load_average()
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(report(args, result, load_before))


if __name__ == "__main__":
    main()
