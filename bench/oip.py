"""The Open Inference Protocol (/v2) against torchyard's own /predict: one run, one machine, one model.

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/oip.py [--seconds 4] [--write-docs]

The service as real processes (embedded Redis, `app.cli worker --device cpu`, `app.cli api`), one
cifar_net job trained for one epoch on `fake` (a real job: the protocol reads its record), then at
1, 8 and 32 concurrent clients, one image per request, the same JPEG everywhere:
  - /predict, the JPEG as a multipart file (the reference);
  - /v2 infer, the JPEG as a binary BYTES element (IMAGE), decoded by the same pipeline;
  - /v2 infer, the image preprocessed by the client as FP32 [1, 3, 32, 32], binary (INPUT__0);
  - /v2 infer, the same FP32 as JSON tensors, answered in JSON;
each by the project's load client (bench/harness.load: raw asyncio streams, one prebuilt request
over keep-alive connections; requests/s, p50/p99, CPU per request of each process) and, for the
protocol's cells, by Triton's perf_analyzer (.tools/perf_analyzer/run, scripts/install-perf-analyzer.sh;
skipped with a note when it is absent). The goal: binary FP32 and BYTES-JPEG ≥ 0.9× /predict's
requests/s at each concurrency, by both clients.
"""

from __future__ import annotations

import argparse
import base64
import csv
import io
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# after the sys.path entry above
from bench.docs import write_section  # noqa: E402
from bench.harness import load, load_average, machine, multipart_request  # noqa: E402
from harness import wait_http  # noqa: E402

CONCURRENCY = (1, 8, 32)
PERF_ANALYZER = Path(os.environ.get("PERF_ANALYZER", REPO / ".tools/perf_analyzer/run"))


def sample_jpeg() -> tuple[bytes, list[float]]:
    """A 96×96 photo-like JPEG, and its FP32 rows as a client preprocesses it (docs/deploying-models.md)."""
    import numpy as np
    from PIL import Image

    with Image.open(REPO / "examples/pattern_3.png") as image:
        out = io.BytesIO()
        image.convert("RGB").save(out, format="JPEG", quality=90)
    with Image.open(io.BytesIO(out.getvalue())) as image:
        rows = np.asarray(image.convert("RGB").resize((32, 32), Image.Resampling.BILINEAR), np.float32) / 255.0
    return out.getvalue(), rows.transpose(2, 0, 1).reshape(-1).tolist()


def oip_request(port: int, model: str, header: dict[str, Any], binary: bytes = b"") -> bytes:
    body = json.dumps(header).encode()
    extra = f"Inference-Header-Content-Length: {len(body)}\r\n" if binary else "Content-Type: application/json\r\n"
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: keep-alive\r\n"
            f"{extra}Content-Length: {len(body) + len(binary)}\r\n\r\n")
    return head.encode() + body + binary


def requests_for(port: int, job: str, jpeg: bytes, rows: list[float]) -> dict[str, bytes]:
    element = struct.pack("<I", len(jpeg)) + jpeg
    floats = struct.pack(f"<{len(rows)}f", *rows)
    binary_out = {"parameters": {"binary_data_output": True}}
    return {
        "/predict (JPEG, multipart)": multipart_request(port, "/predict", jpeg, {"job_id": job, "top_k": "5"},
                                                        filename="x.jpg", content_type="image/jpeg"),
        "/v2 BYTES-JPEG binary": oip_request(port, job, {**binary_out, "inputs": [
            {"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES", "parameters": {"binary_data_size": len(element)}}]},
            element),
        "/v2 FP32 binary": oip_request(port, job, {**binary_out, "inputs": [
            {"name": "INPUT__0", "shape": [1, 3, 32, 32], "datatype": "FP32",
             "parameters": {"binary_data_size": len(floats)}}]}, floats),
        "/v2 FP32 JSON": oip_request(port, job, {"inputs": [
            {"name": "INPUT__0", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": rows}]}),
    }


def perf_analyzer(port: int, job: str, cell: str, jpeg: bytes, rows: list[float], concurrency: int,
                  work: Path) -> dict[str, float] | str:
    if not PERF_ANALYZER.exists():
        return "perf_analyzer absent"
    if "BYTES" in cell:
        data = {"IMAGE": {"b64": base64.b64encode(struct.pack("<I", len(jpeg)) + jpeg).decode(), "shape": [1]}}
    else:
        data = {"INPUT__0": {"content": rows, "shape": [3, 32, 32]}}
    data_file, report = work / "pa-data.json", work / f"pa-{concurrency}.csv"
    data_file.write_text(json.dumps({"data": [data]}))
    command = [str(PERF_ANALYZER), "-m", job, "-u", f"127.0.0.1:{port}", "-i", "http", "--input-data", str(data_file),
               "--concurrency-range", str(concurrency), "-p", "2000", "-s", "30", "-r", "8", "-f", str(report)]
    if "JSON" in cell:
        command += ["--input-tensor-format", "json", "--output-tensor-format", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return f"perf_analyzer failed: {(done.stdout + done.stderr).strip().splitlines()[-1][:200]}"
    with report.open() as f:
        row = next(csv.DictReader(f))
    return {"images_s": float(row["Inferences/Second"]), "p50_ms": float(row["p50 latency"]) / 1e3,
            "p99_ms": float(row["p99 latency"]) / 1e3}


def run(args: argparse.Namespace) -> str:
    import httpx

    from app.embedded_redis import EmbeddedRedis
    from harness import Processes, free_port, with_db

    work = Path(tempfile.mkdtemp(prefix="torchyard-bench-oip-"))
    jpeg, rows = sample_jpeg()
    redis_server = EmbeddedRedis(work / "redis")
    redis_server.start()
    procs = Processes(with_db(redis_server.url, 0), work / "data", work / "logs")
    port = free_port()
    results: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        worker = procs.worker("cpu")
        api = procs.api(port)
        wait_http(port, "/readyz", proc=api)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        job = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()["id"]
        while client.get(f"/jobs/{job}").json()["status"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(1)
        assert redis_server.process is not None
        pids = {"api": api.pid, "worker": worker.pid, "redis": redis_server.process.pid}
        cells = requests_for(port, job, jpeg, rows)
        for concurrency in CONCURRENCY:
            # Rounds of every cell in turn, the best of each kept: on a shared host the speed drifts
            # over seconds, and a ratio of two cells measured minutes apart would measure the drift.
            for _ in range(args.rounds):
                for cell, request in cells.items():
                    measured: dict[str, Any] = dict(load(port, request, concurrency, args.seconds, pids))
                    print(f"c={concurrency} {cell}: {json.dumps(measured)}", file=sys.stderr)
                    best = results.setdefault(cell, {}).get(concurrency)
                    if best is None or measured["images_s"] > best["images_s"]:
                        results[cell][concurrency] = measured
            for cell in cells:
                if cell.startswith("/v2"):
                    results[cell][concurrency]["perf_analyzer"] = perf_analyzer(port, job, cell, jpeg, rows,
                                                                                concurrency, work)
                    print(f"c={concurrency} {cell}: perf_analyzer {results[cell][concurrency]['perf_analyzer']}",
                          file=sys.stderr)
    finally:
        procs.stop_all()
        redis_server.stop()
    return report(args, results)


def report(args: argparse.Namespace, results: dict[str, dict[int, dict[str, Any]]]) -> str:
    reference = results["/predict (JPEG, multipart)"]
    lines = ["| requests | clients | load client: req/s | p50 / p99 ms | vs /predict | API / worker CPU ms per req "
             "| perf_analyzer: infer/s | p50 / p99 ms | vs /predict |", "|---|---|---|---|---|---|---|---|---|"]
    for cell, by_c in results.items():
        for c, m in by_c.items():
            ratio = m["images_s"] / reference[c]["images_s"]
            pa = m.get("perf_analyzer")
            if isinstance(pa, dict):
                pa_text = (f"{pa['images_s']:,.0f} | {pa['p50_ms']:.1f} / {pa['p99_ms']:.1f} | "
                           f"{pa['images_s'] / reference[c]['images_s']:.2f}")
            else:
                pa_text = f"{pa or '–'} | – | –"
            lines.append(f"| {cell} | {c} | {m['images_s']:,.0f} | {m['p50_ms']:.1f} / {m['p99_ms']:.1f} | "
                         f"{ratio:.2f} | {m['api_cpu_ms']:.2f} / {m['worker_cpu_ms']:.2f} | {pa_text} |")
    return (f"`make bench-oip` (bench/oip.py, `--seconds {args.seconds:g} --rounds {args.rounds}`: the load "
            f"client's cells measured in turn, the best of each kept), one run on {machine()}; load average "
            f"{LOAD_START[0]:.1f} at the start, {load_average():.1f} at the end (the host is shared: other runs "
            f"share its cores). cifar_net trained one epoch on `fake`; one image per request, the same JPEG "
            f"(96×96) in every cell; \"vs /predict\" divides by /predict's requests/s at the same concurrency "
            f"(by the load client: perf_analyzer cannot send a multipart form).\n\n" + "\n".join(lines) + "\n\n")


LOAD_START = os.getloadavg()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2, help="each cell measured this many times in turn; the best kept")
    parser.add_argument("--write-docs", action="store_true", help="replace the oip section of docs/benchmarks.md")
    args = parser.parse_args()
    text = run(args)
    print(text)
    if args.write_docs:
        write_section("oip", "The Open Inference Protocol against /predict", text)


if __name__ == "__main__":
    main()
