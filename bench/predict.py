"""/predict latency and throughput against honest floors and LitServe at its best, one run, one machine.

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/predict.py [--seconds 6] [--write-docs]

For each model (resnet18 and cifar_net, 3×32×32, untrained weights written with
worker.checkpoint.save_model: latency does not depend on what the weights learned):
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
import asyncio
import gc
import io
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS = ("resnet18", "cifar_net")
MAX_BATCH = 32
BOUNDARY = "torchyardbenchboundary"
from bench.docs import write_section  # noqa: E402 (after the sys.path entry above)

LOAD_START = os.getloadavg()


# ----------------------------------------------------------------------------- fixtures
def make_checkpoint(data_dir: Path, model_name: str) -> tuple[str, Path]:
    import torch

    from core.storage import CheckpointPaths
    from models.registry import build_model, get_model_spec
    from worker.checkpoint import ModelMeta, Preprocessing, save_model

    spec = get_model_spec(model_name).input
    job_id = f"bench-{model_name.replace('_', '-')}"
    torch.manual_seed(0)
    model = build_model(model_name, 10).eval()
    meta = ModelMeta(model_name, 10, [f"class{i}" for i in range(10)],
                     Preprocessing(spec.channels, spec.height, spec.width, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
                     job_id)
    path = CheckpointPaths(data_dir / "checkpoints").final(job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(path, model, meta)
    return job_id, path


def sample_png() -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def multipart_request(port: int, path: str, png: bytes, fields: dict[str, str]) -> bytes:
    parts = [f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="x.png"\r\n'
                 f"Content-Type: image/png\r\n\r\n".encode() + png + b"\r\n")
    body = b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: keep-alive\r\n"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


# ----------------------------------------------------------------------------- (a) the floor
def raw_forward(checkpoint: Path, batch: int, seconds: float, graph: str) -> dict[str, float]:
    """In this process, with whatever threads and OpenMP policy it was started with: normalize +
    forward + softmax eagerly (`graph="eager"`, the classic script), or the worker's traced serving
    graph of the same operators (`"traced"`, worker/forward_graph.py), whichever is asked."""
    import torch

    from worker.checkpoint import load_model
    from worker.forward_graph import build_forward
    from worker.preprocess import normalize, stats_tensors

    model, meta = load_model(checkpoint, "cpu")
    mean, std = stats_tensors(meta.preprocessing, "cpu")
    pre = meta.preprocessing
    x = torch.randint(0, 256, (batch, pre.channels, pre.height, pre.width), dtype=torch.uint8)
    if graph == "traced":
        traced = build_forward(model, pre, "cpu")
        assert traced.kind == "torchscript"
        run = traced.run
    else:
        def run(images: torch.Tensor) -> torch.Tensor:
            return torch.softmax(model(normalize(images, mean, std)), dim=1)
    times: list[float] = []
    with torch.inference_mode(), torch.jit.optimized_execution(False):
        for _ in range(20):
            run(x)
        cpu0 = time.process_time()
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            run(x)
            times.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
    return {"p50_ms": statistics.median(times) * 1e3, "images_s": batch / statistics.mean(times),
            "cpu_us_per_image": cpu * 1e6 / (batch * len(times))}


GRAPHS = ("eager", "traced")
# OpenMP's waiting between operators: libgomp's default, no spin at all, a short spin.
OMP_SETTINGS = {"default": {}, "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
                "GOMP_SPINCOUNT=30000": {"GOMP_SPINCOUNT": "30000"}}
FLOOR_SETTINGS = [(threads, policy) for threads in sorted({1, os.cpu_count() or 1}) for policy in OMP_SETTINGS]


def floor(checkpoint: Path, batch: int, seconds: float) -> dict:
    """The best of FLOOR_SETTINGS × GRAPHS, each setting in a fresh process (both graphs, one after
    the other, in it); every figure kept."""
    tried: list[dict[str, Any]] = []
    for threads, policy in FLOOR_SETTINGS:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
        out = subprocess.run([sys.executable, __file__, "--floor", str(checkpoint), str(batch), str(threads),
                              str(seconds)], env={**env, **OMP_SETTINGS[policy]}, cwd=REPO, check=True,
                             capture_output=True, text=True).stdout
        tried.extend({**measured, "threads": threads, "omp": policy}
                     for measured in json.loads(out.strip().splitlines()[-1]))
    key = (lambda r: r["p50_ms"]) if batch == 1 else (lambda r: -r["images_s"])
    return {**min(tried, key=key), "tried": tried}


def floor_main(checkpoint: str, batch: int, threads: int, seconds: float) -> None:
    import torch

    torch.set_num_threads(threads)
    print(json.dumps([{**raw_forward(Path(checkpoint), batch, seconds, graph), "graph": graph} for graph in GRAPHS]))


# ----------------------------------------------------------------------------- load client
async def _one_connection(port: int, request: bytes, stop_at: float, latencies: list[float],
                          errors: list[str]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            match = re.search(rb"(?i)content-length:\s*(\d+)", head)
            if match is None:
                raise RuntimeError(f"a response without Content-Length: {head[:200]!r}")
            length = int(match.group(1))
            body = await reader.readexactly(length)
            if not head.startswith(b"HTTP/1.1 200"):
                errors.append(head.split(b"\r\n")[0].decode() + " " + body[:200].decode(errors="replace"))
                await asyncio.sleep(0.05)
                continue
            latencies.append(time.perf_counter() - t0)
    finally:
        writer.close()


async def _load(port: int, request: bytes, concurrency: int, seconds: float) -> dict[str, float]:
    warm: list[float] = []
    errors: list[str] = []
    await asyncio.gather(*(_one_connection(port, request, time.perf_counter() + 1.0, warm, errors)
                           for _ in range(concurrency)))
    latencies: list[float] = []
    start = time.perf_counter()
    await asyncio.gather(*(_one_connection(port, request, start + seconds, latencies, errors)
                           for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests, first: {errors[0]}")
    latencies.sort()
    return {"p50_ms": latencies[len(latencies) // 2] * 1e3,
            "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
            "images_s": len(latencies) / elapsed, "requests": len(latencies), "all_requests": len(latencies) + len(warm)}


def load(port: int, request: bytes, concurrency: int, seconds: float,
         pids: dict[str, int] | None = None) -> dict[str, float]:
    """Closed-loop load; with `pids`, also the CPU each process (and its children: API processes)
    spent per request, which is robust to a busy host. Always the load client's own CPU per request
    (`client_cpu_ms`, this process): it shares the cores with what it measures."""
    import psutil

    def cpu(proc: psutil.Process) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])

    # This process has imported torch and built the checkpoints: a full collection over all that
    # stalled every client at once for ~100 ms (seen in an open-loop run as a 130 ms hole in the
    # requests the API received). Frozen, the collector leaves it alone, as the service's does.
    gc.freeze()
    procs = {name: psutil.Process(pid) for name, pid in (pids or {}).items()}
    before = {name: cpu(p) for name, p in procs.items()}
    client_before = time.process_time()
    result = asyncio.run(_load(port, request, concurrency, seconds))
    result["client_cpu_ms"] = (time.process_time() - client_before) * 1e3 / result["all_requests"]
    for name, p in procs.items():
        result[f"{name}_cpu_ms"] = (cpu(p) - before[name]) * 1e3 / result["all_requests"]
    return result


def wait_http(port: int, path: str, timeout: float = 90) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"nothing answered 200 on :{port}{path}")


def kill_group(proc: subprocess.Popen) -> None:
    """LitServe leaves its inference and API children behind on SIGINT: end the whole group."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


# ----------------------------------------------------------------------------- (c) LitServe
def _litserve_api():
    """The same checkpoint, preprocessing and forward behind LitServe (module level: LitServe
    pickles the API into its spawned inference process)."""
    import litserve as ls
    import numpy as np
    import torch
    from PIL import Image

    from worker.checkpoint import load_model
    from worker.preprocess import image_to_array, normalize, stats_tensors

    class ClassifierAPI(ls.LitAPI):
        def setup(self, device):
            self.model, self.meta = load_model(Path(os.environ["BENCH_CHECKPOINT"]), "cpu")
            self.mean, self.std = stats_tensors(self.meta.preprocessing, "cpu")

        def decode_request(self, request):
            pre = self.meta.preprocessing
            upload = request["file"]
            data = upload.file.read() if hasattr(upload, "file") else upload
            with Image.open(io.BytesIO(data)) as image:
                return image_to_array(image, pre.channels, pre.height, pre.width)

        def batch(self, inputs):
            return torch.from_numpy(np.stack(inputs))

        def predict(self, x):
            with torch.inference_mode():
                if isinstance(x, np.ndarray):  # batching off: one decoded image, `batch` not called
                    return torch.softmax(self.model(normalize(torch.from_numpy(x)[None], self.mean, self.std)),
                                         dim=1)[0]
                return torch.softmax(self.model(normalize(x, self.mean, self.std)), dim=1)

        def unbatch(self, output):
            return list(output)

        def encode_response(self, probs):
            values, indices = probs.topk(5)
            return {"predictions": [{"label": self.meta.classes[i], "index": i, "probability": p}
                                    for p, i in zip(values.tolist(), indices.tolist(), strict=True)]}

    ClassifierAPI.__qualname__ = "ClassifierAPI"  # picklable as <main module>.ClassifierAPI
    return ClassifierAPI


if os.environ.get("BENCH_CHECKPOINT"):  # the LitServe server and its spawned children
    ClassifierAPI = _litserve_api()

# LitServe's documented knobs for throughput: fast_queue (ZeroMQ between its API and inference
# processes), workers per device, and batching; every combination is measured, the best kept.
LITSERVE_CONFIGS = [{"fast_queue": fq, "workers_per_device": w, "batching": b}
                    for fq in (True, False) for w in (1, 2) for b in (True, False)]


def litserve_main(port: int, config: dict) -> None:
    import litserve as ls

    api = (ClassifierAPI(max_batch_size=MAX_BATCH, batch_timeout=0.002) if config["batching"]
           else ClassifierAPI())
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=config["workers_per_device"],
                          fast_queue=config["fast_queue"])
    server.run(port=port, generate_client_file=False, log_level="warning")


# ----------------------------------------------------------------------------- (d) empty FastAPI handlers
EMPTY_APP = """
import sys
import uvicorn
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import Response

app = FastAPI()
ANSWER = Response(b'{"ok":true}', media_type="application/json")

@app.post("/form")
async def form(file: UploadFile = File(), job_id: str = Form(), top_k: int = Form(5)):
    await file.read()
    return Response(b'{"ok":true}', media_type="application/json")

@app.post("/raw")
async def raw(request: Request):
    await request.body()
    return Response(b'{"ok":true}', media_type="application/json")
"""


def empty_main(port: int, workers: int, app_dir: str) -> None:
    import uvicorn

    uvicorn.run("predict_empty_app:app", host="127.0.0.1", port=port, workers=workers, http="httptools",
                access_log=False, log_level="warning", app_dir=app_dir)


# ----------------------------------------------------------------------------- the run
def machine() -> str:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}")


HEARTBEAT_S = 1.0  # the service's heartbeat interval in this bench (TORCHYARD_HEARTBEAT_INTERVAL_S)


def batch_histogram(port: int) -> dict[int, int]:
    """The worker's batch sizes so far (GET /devices → inference): size → batches. They come with
    the heartbeat, so this waits one out first: read at once, the previous cell's last second of
    batches (hundreds of batches of 1 after a one-client cell) was counted in the next cell."""
    import httpx

    time.sleep(HEARTBEAT_S + 0.3)
    device = httpx.get(f"http://127.0.0.1:{port}/devices").json()["devices"][0]
    return {int(k): v for k, v in (device.get("inference") or {}).get("batch_size_histogram", {}).items()}


def serve(work: Path, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(work / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - the server's stdout for its life
    return subprocess.Popen([sys.executable, __file__, *argv], cwd=REPO, env={**os.environ, **(env or {})},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run(args: argparse.Namespace) -> str:
    from app.embedded_redis import EmbeddedRedis
    from core import keys
    from core.config import Settings
    from tests.support import Processes, free_port, with_db

    work = Path(tempfile.mkdtemp(prefix="torchyard-bench-"))
    (work / "logs").mkdir()
    data_dir = work / "data"
    checkpoints = {m: make_checkpoint(data_dir, m) for m in args.models}
    png = sample_png()
    api_workers = Settings().api_workers

    # (a) first, with nothing else of ours alive
    raw = {model: {c: floor(path, c, args.seconds) for c in (1, MAX_BATCH)} for model, (_, path) in checkpoints.items()}
    print(f"floors: {json.dumps(raw)}", file=sys.stderr)

    # (b) the service
    import httpx
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
        wait_http(port, "/readyz")
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
    empty: dict[str, dict[str, float]] = {}
    (work / "predict_empty_app.py").write_text(EMPTY_APP)  # an import string for uvicorn's workers
    empty_port = free_port()
    proc = serve(work, "empty-fastapi", ["--empty-server", str(empty_port), str(api_workers), str(work)])
    try:
        for _ in range(300):
            try:
                httpx.post(f"http://127.0.0.1:{empty_port}/raw", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        for kind in ("form", "raw"):
            request = multipart_request(empty_port, f"/{kind}", png, {"job_id": "x", "top_k": "5"})
            empty[kind] = load(empty_port, request, MAX_BATCH, args.seconds, {"api": proc.pid})
            print(f"empty {kind}: {empty[kind]}", file=sys.stderr)
    finally:
        kill_group(proc)

    # (c) LitServe, one configuration alive at a time
    lit: dict[str, dict[int, dict]] = {}
    for model, (_, path) in ([] if args.skip_litserve else checkpoints.items()):
        for config in LITSERVE_CONFIGS:
            lit_port = free_port()
            proc = serve(work, f"litserve-{model}", ["--litserve-server", str(lit_port), json.dumps(config)],
                         {"BENCH_CHECKPOINT": str(path)})
            try:
                wait_http(lit_port, "/health")
                request = multipart_request(lit_port, "/predict", png, {})
                for c in (1, MAX_BATCH):
                    try:
                        cell: dict[str, Any] = {**load(lit_port, request, c, args.seconds), "config": config}
                    except RuntimeError as exc:  # a configuration that fails is reported, not fatal
                        print(f"{model} c={c} litserve {config}: failed: {exc}", file=sys.stderr)
                        continue
                    print(f"{model} c={c} litserve {config}: {cell}", file=sys.stderr)
                    best = lit.setdefault(model, {}).get(c)
                    if best is None or ((cell["p50_ms"] < best["p50_ms"]) if c == 1
                                        else (cell["images_s"] > best["images_s"])):
                        lit[model][c] = cell
            finally:
                kill_group(proc)

    return report(args, raw, service, lit, empty, api_workers)


def service_threads(floors: dict[int, dict]) -> int:
    """The torch threads the service's forward of this model uses with TORCHYARD_PREDICT_CPU_THREADS
    unset (worker/cpu_threads.ForwardThreads): every core when its one-image forward on one thread
    takes HEAVY_FORWARD_S or more, else one."""
    from worker.cpu_threads import HEAVY_FORWARD_S, usable_cores

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
        for c in (1, MAX_BATCH):
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
            "figures; the forward's own CPU per image is the floor's at the service's setting, the traced graph with OpenMP's default waiting on one thread for a light model and every core for a heavy one (worker/cpu_threads.ForwardThreads), taken off the worker's; at c=1 the processes' background work, heartbeats and Celery's consumer, is spread over few requests):\n\n" + "\n".join(cpu) + "\n\n"
            "Batches formed by the torchyard worker during the c=32 cells:\n\n" + "\n".join(batch_lines) + "\n\n"
            f"Load average (1 min) at the start and end of the run: {LOAD_START[0]:.1f}, {os.getloadavg()[0]:.1f}.\n\n"
            + FINDINGS)


FINDINGS = """What profiling (py-spy, CPU time per request) found and fixed on this host, before → after:
OpenMP threads spinning between ops of the inference thread: worker CPU per cifar_net request
42 → 1 ms (the `OMP_WAIT_POLICY=PASSIVE` once used instead cost training a third of its speed);
two OpenMP teams in the worker (the intake thread's, made by loading a model, beside the forward's),
over which libgomp throttled both to futex sleeps at every op: a one-thread forward was the faster
(resnet18, one client, 9.7-9.9 against 12.2-13.4 ms on two threads); with one team at a time
(worker/cpu_threads.py: the intake and decode threads pinned to one thread, jobs in threads of
their own) a two-thread forward is no longer throttled, but its spinning doubled the worker's CPU
per request and slowed every cell on 2 shared cores; the eager forward waited for the GIL at every
operator while the intake and decode threads decoded PNGs in Python (beside one decoding thread a
batch-32 cifar_net forward ran at 1/3 to 1/6 of its speed alone, a batch-1 one at 1/15:
bench/forward_gil.py), so the forward is now a traced graph that releases the GIL for the whole
batch (worker/forward_graph.py), and with that, two threads pay for resnet18's long forward but
not for cifar_net's short one: a heavy model's forward runs on every core, a light one's on one
(worker/cpu_threads.ForwardThreads); in the API, one redis-py command per request cost more than
the rest of its Redis work: the queueing scripts of the requests of one event-loop turn now go in
one pipeline, and /predict skips FastAPI's middleware (instructions per request at 32 clients
1.58 → 1.06 million, bench/api_instructions.py); per image, the worker's decode pool tasks
(one per image, now one chunk per thread, a lone image on the intake thread), the pydantic reply
models (now encoded from lists: 27 → 15 µs) and a second Redis round trip per batch (BLPOP and
LPOP now pipelined): worker CPU per cifar_net image at c=32 0.29-0.31 → 0.22-0.25 ms, same run
pairs; gen-2 garbage collections over the whole
imported world (`gc.freeze()` once started) stalled every request in flight ~200 ms: c=32 p99
214 → 19 ms; FastAPI's multipart parsing (~250 µs a request; a lean reader in
app/api/multipart.py); uvicorn's access log (~15% of the API's CPU; `TORCHYARD_ACCESS_LOG`, off by
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
`GOMP_SPINCOUNT=30000` (worker/device.openmp_environment), 1,245-1,406 → 1,518-1,573 images/s and
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
    parser.add_argument("--litserve-server", nargs=2, metavar=("PORT", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--empty-server", nargs=3, metavar=("PORT", "WORKERS", "APP_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--floor", nargs=4, metavar=("CHECKPOINT", "BATCH", "THREADS", "SECONDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.litserve_server:
        litserve_main(int(args.litserve_server[0]), json.loads(args.litserve_server[1]))
        return
    if args.empty_server:
        empty_main(int(args.empty_server[0]), int(args.empty_server[1]), args.empty_server[2])
        return
    if args.floor:
        floor_main(args.floor[0], int(args.floor[1]), int(args.floor[2]), float(args.floor[3]))
        return
    text = run(args)
    print(text)
    if args.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
