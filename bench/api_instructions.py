"""Instructions the API process spends per /predict request, counted by callgrind.

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/api_instructions.py [--requests 1024]
        [--compare REF [--compare-without MODULE]] [--write-docs]

Why instructions: the CPU-time tables of bench/predict.py move by a third from one run to the next
on this shared 2-core host (the same API measured 0.39 and 0.59 ms per request in two runs ten
minutes apart); a count of executed instructions does not depend on what else the machine does,
so a change to the API's hot path is read in one run, to within a few per cent (the rest is which
requests happen to arrive together). It leaves out what the kernel does for the process (socket
calls): what it counts is the part torchyard's own code decides.

How: the API runs under `valgrind --tool=callgrind`, the worker and Redis as usual (a cifar_net
checkpoint, one 32×32 PNG per request, `top_k=5`). After a warm-up, the counters are zeroed, a
fixed number of requests is sent by the closed-loop client of bench/predict.py at 1 and at 32
concurrent clients, and the counters dumped: instructions / requests. The empty FastAPI handlers
of bench/predict.py (the form parsed by FastAPI's `UploadFile` + `Form`, and the body read as raw
bytes) are measured the same way as references. `--compare REF` measures the API of git revision
REF too (from a temporary worktree), so a change's effect is read in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import glob
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.docs import write_section  # noqa: E402 (after the sys.path entry above)
from bench.floors import make_checkpoint  # noqa: E402
from bench.harness import hiding, multipart_request  # noqa: E402
from bench.peers import EMPTY_APP  # noqa: E402
from bench.predict import sample_png  # noqa: E402
from harness import end_group, spawn, wait_http  # noqa: E402

CONCURRENCY = (1, 32)
MODEL = "cifar_net"


def closed_loop(port: int, request: bytes, total: int, concurrency: int) -> int:
    """`total` requests (rounded down to a multiple of `concurrency`) over `concurrency` keep-alive
    connections, each waiting for its answer before it sends again; every answer must be a 200."""

    async def connection(count: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(count):
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                match = re.search(rb"(?i)content-length:\s*(\d+)", head)
                if not head.startswith(b"HTTP/1.1 200") or match is None:
                    raise RuntimeError(f"unexpected answer: {head[:200]!r}")
                await reader.readexactly(int(match.group(1)))
        finally:
            writer.close()

    per_connection = total // concurrency

    async def run() -> None:
        await asyncio.gather(*(connection(per_connection) for _ in range(concurrency)))

    asyncio.run(run())
    return per_connection * concurrency


def callgrind(argv: list[str], out: Path, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    return spawn(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no", *argv], log, env,
                 cwd=cwd)


def count(proc: subprocess.Popen, out: Path, send: Callable[[], int]) -> tuple[int, int]:
    """(instructions, requests) of what `send()` made the process under callgrind do."""
    subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
    requests = send()
    subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        dumps = [Path(p) for p in glob.glob(f"{out}.*") if not p.endswith(".0")] + [out]
        for dump in sorted((d for d in dumps if d.exists()), key=lambda d: d.stat().st_mtime, reverse=True):
            found = re.search(r"^totals:\s*(\d+)", dump.read_text(errors="replace"), re.M)
            if found:
                dump.unlink()
                return int(found.group(1)), requests
        time.sleep(0.5)
    raise TimeoutError(f"callgrind wrote no dump under {out}")


def measure_torchyard(tree: Path, work: Path, requests: int, hide: tuple[str, ...] = ()) -> dict[int, float]:
    """The API of checkout `tree` (without the modules in `hide`: bench/harness.hiding) under callgrind."""
    import redis

    from app.embedded_redis import EmbeddedRedis
    from core import keys
    from harness import Processes, free_port, with_db

    data_dir = work / "data"
    job_id, _ = make_checkpoint(data_dir, MODEL)
    server = EmbeddedRedis(work / "redis")
    server.start()
    url = with_db(server.url, 0)
    redis.Redis.from_url(url).hset(keys.job(job_id), mapping={"id": job_id, "status": "succeeded"})
    procs = Processes(url, data_dir, work / "logs", TORCHYARD_HEARTBEAT_INTERVAL_S="0.5",
                      TORCHYARD_HEARTBEAT_TTL_S="5", TORCHYARD_PREDICT_TIMEOUT_S="120")
    port = free_port()
    api = None
    try:
        procs.worker("cpu")
        hidden = {"PYTHONPATH": hiding(work, list(hide))} if hide else {}
        api = callgrind([sys.executable, "-m", "app.cli", "api"], work / "api.cg", tree,
                        {**procs.env, "TORCHYARD_PORT": str(port), **hidden}, work / "logs" / "api-callgrind.log")
        wait_http(port, "/readyz", timeout=600)
        request = multipart_request(port, "/predict", sample_png(), {"job_id": job_id, "top_k": "5"})
        found = {}
        for concurrency in CONCURRENCY:
            closed_loop(port, request, 4 * max(concurrency, 16), concurrency)  # warm: caches, pools, the model
            instructions, sent = count(api, work / "api.cg", functools.partial(closed_loop, port, request, requests,
                                                                                   concurrency))
            found[concurrency] = instructions / sent
        return found
    finally:
        if api is not None:
            end_group(api)
        procs.stop_all()
        server.stop()


def measure_empty(work: Path, requests: int) -> dict[str, float]:
    from harness import free_port

    (work / "predict_empty_app.py").write_text(EMPTY_APP)
    port = free_port()
    proc = callgrind([sys.executable, "-c", f"import uvicorn; uvicorn.run('predict_empty_app:app', host='127.0.0.1', "
                                            f"port={port}, http='httptools', access_log=False, log_level='warning')"],
                     work / "empty.cg", work, dict(os.environ), work / "empty.log")
    try:
        import httpx

        deadline = time.monotonic() + 600
        while True:
            try:
                httpx.post(f"http://127.0.0.1:{port}/raw", timeout=5)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        found = {}
        for kind in ("form", "raw"):
            request = multipart_request(port, f"/{kind}", sample_png(), {"job_id": "x", "top_k": "5"})
            closed_loop(port, request, 64, 32)
            instructions, sent = count(proc, work / "empty.cg", functools.partial(closed_loop, port, request, requests, 32))
            found[kind] = instructions / sent
        return found
    finally:
        end_group(proc)


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="torchyard-ref-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=REPO, check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, check=False, capture_output=True)


def report(rows: list[tuple[str, dict[int, float]]], empty: dict[str, float], requests: int) -> str:
    lines = [f"Instructions executed by the API process per /predict request ({MODEL}, one 32×32 PNG, `top_k=5`; "
             f"{requests} requests per cell after a warm-up; user space only), and by the empty FastAPI handlers "
             f"of bench/predict.py at 32 clients:", "",
             "| API | 1 client | 32 clients |", "|---|---:|---:|"]
    for name, found in rows:
        lines.append(f"| {name} | {found[1]:,.0f} | {found[32]:,.0f} |")
    lines.append(f"| empty FastAPI handler, form parsed by FastAPI | – | {empty['form']:,.0f} |")
    lines.append(f"| empty FastAPI handler, body read as raw bytes | – | {empty['raw']:,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1024, help="measured requests per cell")
    parser.add_argument("--compare", metavar="REF", help="also measure the API of this git revision")
    parser.add_argument("--compare-without", action="append", default=[], metavar="MODULE",
                        help="a module the --compare API cannot import (a dependency added since it: hiredis)")
    parser.add_argument("--write-docs", action="store_true", help="replace the api-instructions section of "
                                                                  "docs/benchmarks.md")
    args = parser.parse_args()
    rows = []
    if args.compare:
        with worktree(args.compare) as tree:
            label = subprocess.run(["git", "rev-parse", "--short", args.compare], cwd=REPO, check=True,
                                   capture_output=True, text=True).stdout.strip()
            name = f"`{label}`" if label.startswith(args.compare) else f"`{label}` ({args.compare})"
            rows.append((name, measure_torchyard(tree, Path(tempfile.mkdtemp()), args.requests,
                                                    tuple(args.compare_without))))
    rows.append(("this tree", measure_torchyard(REPO, Path(tempfile.mkdtemp()), args.requests)))
    empty = measure_empty(Path(tempfile.mkdtemp()), args.requests)
    text = report(rows, empty, args.requests)
    command = "flock /tmp/torchyard-bench.lock .venv/bin/python bench/api_instructions.py" + (
        f" --compare {args.compare}" if args.compare else "") + "".join(f" --compare-without {m}"
                                                                        for m in args.compare_without)
    print(text)
    if args.write_docs:
        write_section("api-instructions", "API instructions per prediction", f"Command: `{command}`\n\n{text}")


if __name__ == "__main__":
    main()
