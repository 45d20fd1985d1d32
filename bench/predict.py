"""/predict latency and throughput against the floor (raw forward) and LitServe, one run, one machine.

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/predict.py [--seconds 8] [--write-docs]

For each model (resnet18 and cifar_net, 3×32×32, untrained weights written with
worker.checkpoint.save_model: latency does not depend on what the weights learned):
  (a) raw in-process forward (normalize + model + softmax under inference_mode) at batch 1 and 32;
  (b) the torchyard service as real processes (embedded Redis, `app.cli worker --device cpu`,
      `app.cli api`), POST /predict with one PNG, closed loop at concurrency 1 and 32;
  (c) the same checkpoint behind LitServe (batching on: max_batch_size=32, batch_timeout=0.002).
The load client is raw asyncio streams writing one prebuilt multipart HTTP/1.1 request over
keep-alive connections: an httpx client costs ~3 ms of CPU per request here and would distort
the figures on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
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


# ----------------------------------------------------------------------------- (a) raw forward
def raw_forward(checkpoint: Path, batch: int, seconds: float) -> dict[str, float]:
    import torch

    from worker.checkpoint import load_model
    from worker.preprocess import normalize, stats_tensors

    model, meta = load_model(checkpoint, "cpu")
    mean, std = stats_tensors(meta.preprocessing, "cpu")
    pre = meta.preprocessing
    x = torch.randint(0, 256, (batch, pre.channels, pre.height, pre.width), dtype=torch.uint8)
    times: list[float] = []
    with torch.inference_mode():
        for _ in range(20):
            torch.softmax(model(normalize(x, mean, std)), dim=1)
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            torch.softmax(model(normalize(x, mean, std)), dim=1)
            times.append(time.perf_counter() - t0)
    return {"p50_ms": statistics.median(times) * 1e3, "images_s": batch / statistics.mean(times)}


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
    """Closed-loop load; with `pids`, also the CPU each process spent per request (robust to a busy host)."""
    import psutil

    procs = {name: psutil.Process(pid) for name, pid in (pids or {}).items()}
    before = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    result = asyncio.run(_load(port, request, concurrency, seconds))
    for name, p in procs.items():
        result[f"{name}_cpu_ms"] = (sum(p.cpu_times()[:2]) - before[name]) * 1e3 / result["all_requests"]
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
    """The same checkpoint, preprocessing and forward behind LitServe with batching on (module level:
    LitServe pickles the API into its spawned inference process)."""
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


def litserve_main(port: int) -> None:
    import litserve as ls

    api = ClassifierAPI(max_batch_size=MAX_BATCH, batch_timeout=0.002)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    server.run(port=port, generate_client_file=False, log_level="warning")


# ----------------------------------------------------------------------------- the run
def machine() -> str:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} threads)")


def run(args: argparse.Namespace) -> str:
    from app.embedded_redis import EmbeddedRedis
    from core import keys
    from tests.support import Processes, free_port, with_db

    work = Path(tempfile.mkdtemp(prefix="torchyard-bench-"))
    data_dir = work / "data"
    checkpoints = {m: make_checkpoint(data_dir, m) for m in args.models}
    png = sample_png()

    redis_server = EmbeddedRedis(work / "redis")
    redis_server.start()
    url = with_db(redis_server.url, 0)
    import httpx
    import redis

    client = redis.Redis.from_url(url)
    for job_id, _ in checkpoints.values():
        client.hset(keys.job(job_id), mapping={"id": job_id, "status": "succeeded"})
    procs = Processes(url, data_dir, work / "logs", TORCHYARD_HEARTBEAT_INTERVAL_S="1",
                      TORCHYARD_HEARTBEAT_TTL_S="5")
    port = free_port()
    raw: dict[str, dict[int, dict[str, float]]] = {}
    service: dict[str, dict[int, dict[str, float]]] = {}
    lit: dict[str, dict[int, dict[str, float]]] = {}
    lit_servers: dict[str, tuple[int, subprocess.Popen]] = {}
    inference_stats: dict = {}
    try:
        worker = procs.worker("cpu")
        api = procs.api(port)
        pids = {"api": api.pid, "worker": worker.pid}
        if not args.skip_litserve:  # one LitServe per model, started up front and idle while others run
            for model, (_, path) in checkpoints.items():
                lit_port = free_port()
                log = open(work / "logs" / f"litserve-{model}.log", "ab")  # noqa: SIM115 - the server's stdout for its life
                lit_servers[model] = (lit_port, subprocess.Popen(
                    [sys.executable, __file__, "--litserve-server", str(lit_port)], cwd=REPO,
                    env={**os.environ, "BENCH_CHECKPOINT": str(path)}, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))
        wait_http(port, "/readyz")
        for lit_port, _ in lit_servers.values():
            wait_http(lit_port, "/health")
        # Cells back to back per (model, concurrency) — raw, torchyard, LitServe — so a shared host's
        # changing load hits the three sides of each ratio alike.
        for model, (job_id, path) in checkpoints.items():
            request = multipart_request(port, "/predict", png, {"job_id": job_id, "top_k": "5"})
            for c in (1, MAX_BATCH):
                raw.setdefault(model, {})[c] = raw_forward(path, c, args.seconds)
                service.setdefault(model, {})[c] = load(port, request, c, args.seconds, pids)
                if model in lit_servers:
                    lit_port = lit_servers[model][0]
                    lit.setdefault(model, {})[c] = load(lit_port, multipart_request(lit_port, "/predict", png, {}),
                                                        c, args.seconds)
                print(f"{model} c={c}: raw {raw[model][c]}\n  torchyard {service[model][c]}\n"
                      f"  litserve {lit.get(model, {}).get(c)}", file=sys.stderr)
        inference_stats = httpx.get(f"http://127.0.0.1:{port}/devices").json()["devices"][0].get("inference") or {}
    finally:
        for _, proc in lit_servers.values():
            kill_group(proc)
        procs.stop_all()
        redis_server.stop()

    return report(args, raw, service, lit, inference_stats)


def report(args, raw, service, lit, inference_stats) -> str:
    lines = ["| model | measure | raw forward (a) | torchyard /predict (b) | LitServe (c) | (b)/(a) | (b)/(c) |",
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
            ("c=1 p50 latency", a1["p50_ms"], b1["p50_ms"], c1 and c1["p50_ms"], "ms"),
            ("c=1 p99 latency", None, b1["p99_ms"], c1 and c1["p99_ms"], "ms"),
            ("c=1 throughput", a1["images_s"], b1["images_s"], c1 and c1["images_s"], "img/s"),
            (f"c=32 p50 latency (raw: batch {MAX_BATCH})", a32["p50_ms"], b32["p50_ms"], c32 and c32["p50_ms"], "ms"),
            ("c=32 p99 latency", None, b32["p99_ms"], c32 and c32["p99_ms"], "ms"),
            (f"c=32 throughput (raw: batch {MAX_BATCH})", a32["images_s"], b32["images_s"],
             c32 and c32["images_s"], "img/s"),
        ]
        for name, a, b, c, unit in rows:
            lines.append(f"| {model} | {name} | {fmt(a, unit)} | {fmt(b, unit)} | {fmt(c, unit)} | "
                         f"{ratio(b, a)} | {ratio(b, c)} |")
    cpu = ["| model | concurrency | API CPU per request | worker CPU per request (decode + forward + Redis) |",
           "|---|---|---|---|"]
    for model in service:
        for c in (1, MAX_BATCH):
            cell = service[model][c]
            cpu.append(f"| {model} | {c} | {cell['api_cpu_ms']:.2f} ms | {cell['worker_cpu_ms']:.2f} ms |")
    hist = inference_stats.get("batch_size_histogram", {})
    table = "\n".join(lines)
    return (f"Command: `flock /tmp/torchyard-bench.lock .venv/bin/python bench/predict.py --seconds {args.seconds:g}`  \n"
            f"Machine: {machine()}  \n"
            f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.seconds:g} s per cell (after 1 s "
            f"of warm-up for (b) and (c)), the three cells of each row back to back; one 32×32 PNG per request, `top_k=5`; service defaults (`predict_max_batch=32`, "
            f"`predict_max_wait_ms=2`); API, worker, Redis and the load client share the machine.\n\n"
            f"{table}\n\n"
            f"(a) is normalize + forward + softmax in this process at batch 1 and at batch {MAX_BATCH}, so at "
            f"c=32 it is the ceiling a batching server can approach; (b) and (c) include PNG decoding, HTTP "
            f"and, for (b), two Redis round trips. CPU time per request of the torchyard processes "
            f"(robust to a busy host, unlike wall-clock figures):\n\n"
            + "\n".join(cpu) + "\n\n"
            f"Batches formed by the torchyard worker over the run (size: count): "
            f"{json.dumps(hist)}\n\n"
            f"Load average (1 min) at the start and end of the run: {LOAD_START[0]:.1f}, {os.getloadavg()[0]:.1f}. "
            f"The host is shared with other work, so figures move from run to run; ratios within one "
            f"run are the comparison to read.\n\n" + FINDINGS)


FINDINGS = """What profiling (py-spy, CPU time per request) found and fixed on this host, before → after:
OpenMP threads spinning between ops in the worker (`OMP_WAIT_POLICY=PASSIVE`, set by the worker
command): worker CPU per cifar_net request 42 → 1 ms; gen-2 garbage collections over the whole
imported world (`gc.freeze()` once started) stalled every request in flight ~200 ms: c=32 p99
214 → 19 ms; FastAPI's multipart parsing (~250 µs a request; a lean reader in
app/api/multipart.py) and its thread-pool hop for plain `def` dependencies; uvicorn's access log
(~15% of the API's CPU; now `TORCHYARD_ACCESS_LOG`, off by default); the API's parse and
re-serialisation of the worker's JSON (passed through); a lone request waiting out the batching
window on a quiet device (skipped). The CPU inference thread runs on half the cores
(`TORCHYARD_PREDICT_CPU_THREADS`), leaving the rest to the API and Redis.
"""


def write_docs(text: str) -> None:
    write_section("predict", "Prediction", text)


def main() -> None:
    # The same OpenMP policy the worker runs with (app/cli.py), for the raw floor and LitServe alike:
    # spinning OpenMP threads on a small shared host make every contender several times slower.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per cell")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--skip-litserve", action="store_true")
    parser.add_argument("--write-docs", action="store_true", help="replace the predict section of docs/benchmarks.md")
    parser.add_argument("--litserve-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.litserve_server:
        litserve_main(args.litserve_server)
        return
    text = run(args)
    print(text)
    if args.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
