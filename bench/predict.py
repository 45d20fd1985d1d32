"""/predict latency and throughput against honest floors and LitServe at its best, one run, one machine.

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/predict.py [--seconds 6] [--write-docs]

For each model (resnet18 and cifar_net, 3×32×32, untrained weights written with
worker.checkpoints.format.save_model: latency does not depend on what the weights learned):
  (a) the floor: normalize + forward + softmax under inference_mode at batch 1 and 32, each setting
      in a fresh process started before anything else of ours runs, best of torch threads {1, all
      cores} × OpenMP waiting {default, PASSIVE, GOMP_SPINCOUNT=30000}: the best this machine can do;
  (b) the torchyard service as real processes (embedded Redis, `app.cli worker --device cpu`,
      `app.cli api` with its default processes), POST /predict with one PNG, closed loop at
      concurrency 1 and 32;
  (c) the same checkpoint behind LitServe, best of its documented knobs: `fast_queue` on and off,
      1 and 2 workers per device, batching on (max_batch_size=32, batch_timeout=2 ms) and off;
  (d) what an empty FastAPI handler does with the same multipart request: once parsed the idiomatic
      way (`UploadFile` + `Form`) and once read as raw bytes, on as many processes as (b)'s API.
Only the processes of the cell being measured are alive while it runs. The load client is raw
asyncio streams writing one prebuilt multipart HTTP/1.1 request over keep-alive connections: an
httpx client costs ~3 ms of CPU per request here and would distort the figures on 2 cores.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# after the sys.path entry above
from bench.docs import write_section  # noqa: E402
from bench.floors import OMP_SETTINGS, forward_floor, make_checkpoint, thread_counts  # noqa: E402
from bench.harness import load, machine, multipart_request  # noqa: E402
from bench.peers import LITSERVE_CONFIGS, empty_handlers, litserve_sweep  # noqa: E402
from harness import wait_http  # noqa: E402

MODELS = ("resnet18", "cifar_net")
MAX_BATCH = 32
FLOOR_SETTINGS = [(threads, policy) for threads in thread_counts() for policy in OMP_SETTINGS]
LOAD_START = os.getloadavg()


# ----------------------------------------------------------------------------- fixtures
def sample_png() -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


# ----------------------------------------------------------------------------- the run
HEARTBEAT_S = 1.0  # the service's heartbeat interval in this bench (TORCHYARD_HEARTBEAT_INTERVAL_S)


def batch_histogram(port: int) -> dict[int, int]:
    """The worker's batch sizes so far (GET /devices → inference): size → batches. They come with
    the heartbeat, so this waits one out first: read at once, the previous cell's last second of
    batches (hundreds of batches of 1 after a one-client cell) was counted in the next cell."""
    import httpx

    time.sleep(HEARTBEAT_S + 0.3)
    device = httpx.get(f"http://127.0.0.1:{port}/devices").json()["devices"][0]
    return {int(k): v for k, v in (device.get("inference") or {}).get("batch_size_histogram", {}).items()}


def run(args: argparse.Namespace) -> str:
    from app.embedded_redis import EmbeddedRedis
    from core import keys
    from core.config import Settings
    from harness import Processes, free_port, with_db

    work = Path(tempfile.mkdtemp(prefix="torchyard-bench-"))
    (work / "logs").mkdir()
    data_dir = work / "data"
    checkpoints = {m: make_checkpoint(data_dir, m) for m in args.models}
    png = sample_png()
    api_workers = Settings().api_workers

    # (a) first, with nothing else of ours alive
    raw = {model: {c: forward_floor(path, [c], args.seconds, FLOOR_SETTINGS)[c] for c in (1, MAX_BATCH)}
           for model, (_, path) in checkpoints.items()}
    print(f"floors: {json.dumps(raw)}", file=sys.stderr)

    # (b) the service
    import redis

    service: dict[str, dict[int, dict]] = {}
    redis_server = EmbeddedRedis(work / "redis")
    redis_server.start()
    url = with_db(redis_server.url, 0)
    client = redis.Redis.from_url(url)
    for job_id, _ in checkpoints.values():
        client.hset(keys.job(job_id), mapping={"id": job_id, "status": "succeeded"})
    procs = Processes(url, data_dir, work / "logs", TORCHYARD_HEARTBEAT_INTERVAL_S=str(HEARTBEAT_S),
                      TORCHYARD_HEARTBEAT_TTL_S="5", TORCHYARD_API_WORKERS=str(api_workers))
    port = free_port()
    try:
        worker = procs.worker("cpu")
        api = procs.api(port)
        wait_http(port, "/readyz", proc=api)
        assert redis_server.process is not None
        pids = {"api": api.pid, "worker": worker.pid, "redis": redis_server.process.pid}
        for model, (job_id, _) in checkpoints.items():
            request = multipart_request(port, "/predict", png, {"job_id": job_id, "top_k": "5"})
            for c in (1, MAX_BATCH):
                before = batch_histogram(port)
                measured: dict[str, Any] = dict(load(port, request, c, args.seconds, pids))
                measured["batches"] = {k: v - before.get(k, 0) for k, v in batch_histogram(port).items()
                                       if v - before.get(k, 0)}
                service.setdefault(model, {})[c] = measured
                print(f"{model} c={c}: torchyard {measured}", file=sys.stderr)
    finally:
        procs.stop_all()
        redis_server.stop()

    # (d) empty FastAPI handlers, right after (b): the host's speed drifts over minutes, and (b)/(d)
    # is a ratio of two cells (once 8 minutes of LitServe apart, with API CPU per request 20 % apart)
    empty = empty_handlers(work, png, api_workers, MAX_BATCH, args.seconds)

    # (c) LitServe, one configuration alive at a time
    lit: dict[str, dict[int, dict]] = {}
    for model, (_, path) in ([] if args.skip_litserve else checkpoints.items()):
        lit[model] = litserve_sweep(path, png, [1, MAX_BATCH], args.seconds, work / "logs", label=f"-{model}")

    return report(args, raw, service, lit, empty, api_workers)


def service_threads(floors: dict[int, dict]) -> int:
    """The torch threads the service's forward of this model uses with TORCHYARD_PREDICT_CPU_THREADS
    unset (worker/device/cpu_threads.ForwardThreads): every core when its one-image forward on one thread
    takes HEAVY_FORWARD_S or more, else one."""
    from worker.device.cpu_threads import HEAVY_FORWARD_S, usable_cores

    one_image_s = next(t["p50_ms"] for t in floors[1]["tried"]
                       if t["threads"] == 1 and t["omp"] == "default" and t["graph"] == "traced") / 1e3
    return usable_cores() if one_image_s >= HEAVY_FORWARD_S else 1


def cpu_ceiling(service_cell: dict, form_cell: dict) -> str:
    """What the CPU alone allows: the requests/s at which every core of this machine would be busy
    with the CPU one request costs all the processes of the cell (the load client's included), had
    the closed loop's chain of stages never left a core idle."""
    cores = os.cpu_count() or 1
    service_ms = sum(service_cell[f"{name}_cpu_ms"] for name in ("api", "worker", "redis", "client"))
    form_ms = form_cell["api_cpu_ms"] + form_cell["client_cpu_ms"]
    ceiling = cores * 1e3 / service_ms
    return (f"CPU bound: torchyard cifar_net at 32 clients costs {service_ms:.3f} ms of CPU per request in all (API "
            f"{service_cell['api_cpu_ms']:.3f}, worker {service_cell['worker_cpu_ms']:.3f}, Redis "
            f"{service_cell['redis_cpu_ms']:.3f}, load client {service_cell['client_cpu_ms']:.3f}), the empty form "
            f"handler {form_ms:.3f}. With its {cores} cores never idle, this machine could serve at most "
            f"{ceiling:,.0f} such requests/s, {ceiling / form_cell['images_s']:.2f}× what the empty handler reached; "
            f"the cells used {service_cell['images_s'] * service_ms / (cores * 1e3):.0%} (torchyard) and "
            f"{form_cell['images_s'] * form_ms / (cores * 1e3):.0%} (empty handler) of the cores")


def report(args, raw, service, lit, empty, api_workers) -> str:
    lines = ["| model | measure | floor (a) | torchyard /predict (b) | LitServe at its best (c) | (b)/(a) | (b)/(c) |",
             "|---|---|---|---|---|---|---|"]

    def fmt(v: float | None, unit: str) -> str:
        return "–" if v is None else f"{v:,.1f} {unit}"

    def ratio(b: float, other: float | None) -> str:
        return "–" if not other else f"{b / other:.2f}"

    for model in service:
        a1, a32 = raw[model][1], raw[model][MAX_BATCH]
        b1, b32 = service[model][1], service[model][MAX_BATCH]
        c1, c32 = lit.get(model, {}).get(1), lit.get(model, {}).get(MAX_BATCH)
        rows = [
            ("c=1 p50 latency (floor: batch 1)", a1["p50_ms"], b1["p50_ms"], c1 and c1["p50_ms"], "ms"),
            ("c=1 p99 latency", None, b1["p99_ms"], c1 and c1["p99_ms"], "ms"),
            (f"c=32 p50 latency (floor: batch {MAX_BATCH})", a32["p50_ms"], b32["p50_ms"], c32 and c32["p50_ms"], "ms"),
            ("c=32 p99 latency", None, b32["p99_ms"], c32 and c32["p99_ms"], "ms"),
            (f"c=32 throughput (floor: batch {MAX_BATCH})", a32["images_s"], b32["images_s"],
             c32 and c32["images_s"], "img/s"),
        ]
        for name, a, b, c, unit in rows:
            lines.append(f"| {model} | {name} | {fmt(a, unit)} | {fmt(b, unit)} | {fmt(c, unit)} | "
                         f"{ratio(b, a)} | {ratio(b, c)} |")
    floors = ["| model | batch | best setting | every setting (threads, OpenMP waiting, graph: p50 ms / img/s) |",
              "|---|---|---|---|"]
    for model in raw:
        for c in (1, MAX_BATCH):
            f = raw[model][c]
            every = "; ".join(f"{t['threads']}, {t['omp']}, {t['graph']}: {t['p50_ms']:.2f} / {t['images_s']:,.0f}"
                              for t in f["tried"])
            floors.append(f"| {model} | {c} | {f['threads']} threads, {f['omp']}, {f['graph']} | {every} |")
    peers = ["| model | concurrency | LitServe's best configuration |", "|---|---|---|"]
    for model in lit:
        for c in sorted(lit[model]):
            peers.append(f"| {model} | {c} | {json.dumps(lit[model][c]['config'])} |")
    cpu = ["| model | concurrency | API CPU per request | worker CPU per request | Redis CPU per request | "
           "worker CPU per image outside the forward |", "|---|---|---|---|---|---|"]
    for model in service:
        for c in (1, MAX_BATCH):
            cell = service[model][c]
            threads = service_threads(raw[model])
            forward = next(t["cpu_us_per_image"] for t in raw[model][c]["tried"]
                           if t["threads"] == threads and t["omp"] == "default" and t["graph"] == "traced") / 1e3
            cpu.append(f"| {model} | {c} | {cell['api_cpu_ms']:.3f} ms | {cell['worker_cpu_ms']:.3f} ms | "
                       f"{cell['redis_cpu_ms']:.3f} ms | {max(0.0, cell['worker_cpu_ms'] - forward) * 1e3:.0f} µs |")
    batch_lines = []
    for model in service:
        hist = service[model][MAX_BATCH].get("batches", {})
        count = sum(hist.values())
        mean = sum(k * v for k, v in hist.items()) / count if count else 0.0
        batch_lines.append(f"- {model}: mean {mean:.1f} images per batch; size: batches {json.dumps(dict(sorted(hist.items())))}")
    cifar = service.get("cifar_net", {}).get(MAX_BATCH)
    empty_lines = "\n".join(
        f"- empty FastAPI handler, {'multipart parsed by FastAPI (`UploadFile` + `Form`)' if kind == 'form' else 'body read as raw bytes'}: "
        f"{cell['images_s']:,.0f} requests/s, {cell['api_cpu_ms']:.3f} ms of API CPU and {cell['client_cpu_ms']:.3f} ms of "
        f"the load client's per request"
        + (f"; torchyard cifar_net c=32 is {cifar['images_s'] / cell['images_s']:.2f}× this" if cifar else "")
        for kind, cell in empty.items())
    if cifar and "form" in empty:
        empty_lines += "\n- " + cpu_ceiling(cifar, empty["form"])
    return (f"Command: `flock /tmp/torchyard-bench.lock .venv/bin/python bench/predict.py --seconds {args.seconds:g}`  \n"
            f"Machine: {machine()}  \n"
            f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.seconds:g} s per cell (after 1 s "
            f"of warm-up); one 32×32 PNG per request, `top_k=5`; service defaults "
            f"(`TORCHYARD_API_WORKERS={api_workers}` on this machine, `predict_max_batch=32`); only the "
            f"processes of the cell being measured (and the load client) are alive while it runs.\n\n"
            + "\n".join(lines) + "\n\n"
            f"(a) is normalize + forward + softmax at batch 1 and at batch {MAX_BATCH} in a fresh process, "
            f"best of these settings:\n\n" + "\n".join(floors) + "\n\n"
            f"(c) is the best of {len(LITSERVE_CONFIGS)} LitServe configurations per cell:\n\n" + "\n".join(peers)
            + "\n\n(d) The HTTP front end alone, same request, 32 clients:\n\n" + empty_lines + "\n\n"
            "CPU time per request of the torchyard processes (robust to a busy host, unlike wall-clock "
            "figures; the forward's own CPU per image is the floor's at the service's setting, the traced graph with OpenMP's default waiting on one thread for a light model and every core for a heavy one (worker/device/cpu_threads.ForwardThreads), taken off the worker's; at c=1 the processes' background work, heartbeats and Celery's consumer, is spread over few requests):\n\n" + "\n".join(cpu) + "\n\n"
            "Batches formed by the torchyard worker during the c=32 cells:\n\n" + "\n".join(batch_lines) + "\n\n"
            f"Load average (1 min) at the start and end of the run: {LOAD_START[0]:.1f}, {os.getloadavg()[0]:.1f}.\n\n"
            + FINDINGS)


FINDINGS = """What profiling (py-spy, CPU time per request) found and fixed on this host, before → after:
OpenMP threads spinning between ops of the inference thread: worker CPU per cifar_net request
42 → 1 ms (the `OMP_WAIT_POLICY=PASSIVE` once used instead cost training a third of its speed);
two OpenMP teams in the worker (the intake thread's, made by loading a model, beside the forward's),
over which libgomp throttled both to futex sleeps at every op: a one-thread forward was the faster
(resnet18, one client, 9.7-9.9 against 12.2-13.4 ms on two threads); with one team at a time
(worker/device/cpu_threads.py: the intake and decode threads pinned to one thread, jobs in threads of
their own) a two-thread forward is no longer throttled, but its spinning doubled the worker's CPU
per request and slowed every cell on 2 shared cores; the eager forward waited for the GIL at every
operator while the intake and decode threads decoded PNGs in Python (beside one decoding thread a
batch-32 cifar_net forward ran at 1/3 to 1/6 of its speed alone, a batch-1 one at 1/15:
bench/forward_gil.py), so the forward is now a traced graph that releases the GIL for the whole
batch (worker/checkpoints/forward_graph.py), and with that, two threads pay for resnet18's long forward but
not for cifar_net's short one: a heavy model's forward runs on every core, a light one's on one
(worker/device/cpu_threads.ForwardThreads); in the API, one redis-py command per request cost more than
the rest of its Redis work: the queueing scripts of the requests of one event-loop turn now go in
one pipeline, and /predict skips FastAPI's middleware (instructions per request at 32 clients
1.58 → 1.06 million, bench/api_instructions.py); per image, the worker's decode pool tasks
(one per image, now one chunk per thread, a lone image on the intake thread), the pydantic reply
models (now encoded from lists: 27 → 15 µs) and a second Redis round trip per batch (BLPOP and
LPOP now pipelined): worker CPU per cifar_net image at c=32 0.29-0.31 → 0.22-0.25 ms, same run
pairs; gen-2 garbage collections over the whole
imported world (`gc.freeze()` once started) stalled every request in flight ~200 ms: c=32 p99
214 → 19 ms; FastAPI's multipart parsing (~250 µs a request; a lean reader in
app/api/serving/multipart.py); uvicorn's access log (~15% of the API's CPU; `TORCHYARD_ACCESS_LOG`, off by
default); the API's parse and re-serialisation of the worker's JSON (passed through); FastAPI's
routing, dependency and exception layers for /predict (the front gate serves it directly: API CPU
per cifar_net request 0.40 → 0.32 ms); a BLPOP of its own per request (one reply inbox per API
process: 0.32 → 0.29 ms); batches cut short by a fixed 2 ms window while most clients waited for
the batch being computed (worker/batching.BatchWindow).

Where a cycle goes at 32 clients (cifar_net, timestamps in the worker and the API, 2026-11-24):
the closed loop makes every batch the same 32 requests, so a cycle is a chain. The API parses
the 32 (2.0-2.5 ms) and their scripts reach Redis together at the end of its event-loop turn;
the worker had the last of them 1.2-2.2 ms after it was queued (polling every 1 ms; now every
0.2 ms while requests keep arriving: 0.4-0.6 ms), decodes them (1.0-1.3 ms on two threads, which
contend for the GIL over small PNGs; now on the intake thread alone, worker/inference.DecodeSplit),
runs the forward (1.0-1.4 ms, one thread), replies (0.6-0.8 ms), and the API answers the 32 and
reads the next ones (1.3-1.8 ms): ~9 ms, the API busy half of it and the two cores idle ~45% of
the time (psutil) at 3,300-3,700 requests/s. Tried and not kept: cutting the API's turn so the
first requests reach Redis while the rest are parsed, the worker decoding them as they arrive
(API CPU per request 139 → 171 µs, 3,640 → 3,160 requests/s: the overlap's work shares the same
two cores); two torch threads for cifar_net (worker CPU per image 115-139 → 150-205 µs, no more
throughput). resnet18: after its two-thread forward libgomp's default spin held a core while the
replies waited (2.0-2.9 ms, their RPUSH alone 1.1-1.7): the worker now starts with
`GOMP_SPINCOUNT=30000` (worker/device/pinning.openmp_environment), 1,245-1,406 → 1,518-1,573 images/s and
976-1,063 → 731-763 µs of worker CPU per image, two runs of each setting, alternating.

2026-11-25: that lockstep was the batching window's doing. Waiting for all 32 kept the 32 clients
in one cohort, so the API and the worker took turns; a batch now never waits longer than the
device takes to compute a full one (worker/batching.BatchWindow, timed by the device thread).
resnet18's ~10 ms forward still fills its batches (31.8-31.9 images). cifar_net's 1.3 ms one no
longer waits, and its clients split into batches of ~10 that the API and the worker serve at
the same time: 3,651-3,674 → 4,534-4,651 requests/s and p50 8.4 → 6.6 ms (two runs each,
alternating). The worker's CPU per image rises with the smaller batches (0.115 → 0.145-0.152 ms),
the price of using the idle core. Under open-loop (Poisson) traffic, p50 went 9.2 → 2.9 ms at
1,500 requests/s and 14.8 → 6.4 at 3,500. The replies' JSON is now orjson's
(core/wire.strict_json): 8.1 → 1.6 µs an image, tight loop.
"""


def write_docs(text: str) -> None:
    write_section("predict", "Prediction", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per cell")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--skip-litserve", action="store_true")
    parser.add_argument("--write-docs", action="store_true", help="replace the predict section of docs/benchmarks.md")
    args = parser.parse_args()
    text = run(args)
    print(text)
    if args.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
