"""The peers a /predict bench reads torchyard against: LitServe serving the same checkpoint at its
best documented configuration (bench/litserve_app.py), and an empty FastAPI handler taking the
same multipart request (the HTTP front end alone).

    python -m bench.peers empty PORT WORKERS APP_DIR      # the empty handlers' server
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/peers.py`: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import load, multipart_request
from harness import end_group, spawn, wait_http

# LitServe's documented knobs for throughput: fast_queue (ZeroMQ between its API and inference
# processes), workers per device, and batching; every combination is measured, the best kept.
LITSERVE_CONFIGS = [{"fast_queue": fq, "workers_per_device": w, "batching": b}
                    for fq in (True, False) for w in (1, 2) for b in (True, False)]


def litserve_missing() -> str | None:
    """Why LitServe cannot run here (None when it can): its package or pyzmq absent."""
    for name in ("litserve", "zmq"):
        if importlib.util.find_spec(name) is None:
            return (f"LitServe not measured: `{name}` is not importable here (pip install -c constraints.txt "
                    f"-e '.[bench]'; on a GPU host, prepare-wheels.sh with EXTRA=\"litserve==0.2.19 pyzmq==27.3.0\")")
    return None


def better(cell: dict[str, Any], best: dict[str, Any] | None, concurrency: int) -> bool:
    """One client: the lower p50; several: the more images/s."""
    if best is None:
        return True
    return cell["p50_ms"] < best["p50_ms"] if concurrency == 1 else cell["images_s"] > best["images_s"]


def litserve_sweep(checkpoint: Path, payload: bytes, concurrencies: list[int], seconds: float, logs: Path,
                   configs: list[dict[str, Any]] | None = None, filename: str = "x.png",
                   content_type: str = "image/png", device: str = "cpu", precision: str = "fp32",
                   warmup: float = 1.0, label: str = "") -> dict[int, dict[str, Any]]:
    """Each configuration as its own server, one alive at a time, measured at every concurrency;
    per concurrency the best cell with its configuration ("config"). A configuration that fails to
    serve is reported on stderr and left out."""
    from harness import free_port

    best: dict[int, dict[str, Any]] = {}
    for config in configs or LITSERVE_CONFIGS:
        port = free_port()
        proc = spawn([sys.executable, "-m", "bench.litserve_app", str(port), json.dumps(config)],
                     logs / f"litserve{label}.log", {**os.environ, "BENCH_CHECKPOINT": str(checkpoint),
                                                     "BENCH_DEVICE": device, "BENCH_PRECISION": precision})
        try:
            try:
                wait_http(port, "/health", timeout=180, proc=proc)
            except (RuntimeError, TimeoutError) as exc:
                print(f"litserve{label} {config}: did not start: {exc}", file=sys.stderr)
                continue
            request = multipart_request(port, "/predict", payload, {}, filename, content_type)
            for c in concurrencies:
                try:
                    cell: dict[str, Any] = {**load(port, request, c, seconds, warmup=warmup), "config": config}
                except (RuntimeError, OSError) as exc:  # a configuration that fails is reported, not fatal
                    print(f"litserve{label} c={c} {config}: failed: {exc}", file=sys.stderr)
                    continue
                print(f"litserve{label} c={c} {config}: {cell}", file=sys.stderr)
                if better(cell, best.get(c), c):
                    best[c] = cell
        finally:
            end_group(proc)
    return best


# ----------------------------------------------------------------------------- empty FastAPI handlers
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


def empty_handlers(work: Path, payload: bytes, api_workers: int, concurrency: int,
                   seconds: float) -> dict[str, dict[str, float]]:
    """The same multipart request to an empty handler, parsed by FastAPI (`form`) and read as raw
    bytes (`raw`), on `api_workers` uvicorn processes."""
    import time

    import httpx

    from harness import free_port

    (work / "predict_empty_app.py").write_text(EMPTY_APP)  # an import string for uvicorn's workers
    port = free_port()
    proc = spawn([sys.executable, "-m", "bench.peers", "empty", str(port), str(api_workers), str(work)],
                 work / "logs" / "empty-fastapi.log")
    empty: dict[str, dict[str, float]] = {}
    try:
        for _ in range(300):
            try:
                httpx.post(f"http://127.0.0.1:{port}/raw", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        for kind in ("form", "raw"):
            request = multipart_request(port, f"/{kind}", payload, {"job_id": "x", "top_k": "5"})
            empty[kind] = load(port, request, concurrency, seconds, {"api": proc.pid})
            print(f"empty {kind}: {empty[kind]}", file=sys.stderr)
    finally:
        end_group(proc)
    return empty


if __name__ == "__main__":
    if sys.argv[1] == "empty":
        empty_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown server {sys.argv[1]!r}")
