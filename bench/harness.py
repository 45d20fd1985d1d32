"""What the benchmarks share: the load client, JSON from a fresh process, the machine's description.

The load client is raw asyncio streams writing one prebuilt multipart HTTP/1.1 request over
keep-alive connections, closed loop: an httpx client costs ~3 ms of CPU per request and would
distort the figures on 2 cores. The processes a bench starts are the harness's (harness/: each in
a session of its own, ended with its whole group, so nothing outlives the bench, even when it fails).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import REPO

BOUNDARY = "torchyardbenchboundary"
LOCK_HINT = "flock /tmp/torchyard-bench.lock"  # the command prefix that keeps two benches apart


# ----------------------------------------------------------------------------- requests
def multipart_request(port: int, path: str, payload: bytes, fields: dict[str, str], filename: str = "x.png",
                      content_type: str = "image/png") -> bytes:
    """One complete POST with the image as the `file` part, ready to be written again and again."""
    parts = [f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
                 f"Content-Type: {content_type}\r\n\r\n".encode() + payload + b"\r\n")
    body = b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: keep-alive\r\n"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


# ----------------------------------------------------------------------------- the load client
class _Window:
    """The measured window of a closed loop: it opens after the warm-up and closes at the first
    moment, `seconds` later or after, when at least MIN_ANSWERS answers (or one per client, if
    fewer clients) came in inside it, or at the latest `LONGEST` times `seconds` in. Only answers
    that arrive inside it count, over its own length: a request still in flight when it closes
    is waited for (nothing is abandoned mid-request) but not counted, so a server whose answers
    take seconds is not charged the wait for its stragglers as idle time."""

    MIN_ANSWERS = 10
    LONGEST = 4

    def __init__(self, warmup: float, seconds: float, concurrency: int) -> None:
        self.opens = time.perf_counter() + warmup
        self.due = self.opens + seconds
        self.latest = self.opens + self.LONGEST * seconds
        self.enough = min(concurrency, self.MIN_ANSWERS)
        self.closed_at: float | None = None
        self.latencies: list[float] = []
        self.outside = 0  # answers in the warm-up, and stragglers

    def answered(self, sent: float, now: float) -> None:
        if self.closed_at is None and now >= self.opens:
            self.latencies.append(now - sent)
        else:
            self.outside += 1

    def open(self, now: float) -> bool:
        if self.closed_at is None and now >= self.due and (len(self.latencies) >= self.enough or now >= self.latest):
            self.closed_at = now
        return self.closed_at is None


async def _one_connection(port: int, request: bytes, window: _Window, errors: list[str]) -> None:
    """One client: the same request again as soon as the answer is in, while the window is open.
    The connection is opened once, for the warm-up and the window alike (a server that caps
    connections per client never sees two sets at once)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while window.open(sent := time.perf_counter()):
            writer.write(request)
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                errors.append(f"the server closed the connection ({type(exc).__name__}: {exc})")
                return
            match = re.search(rb"(?im)^content-length:\s*(\d+)", head)  # not Inference-Header-Content-Length
            if match is None:
                raise RuntimeError(f"a response without Content-Length: {head[:200]!r}")
            body = await reader.readexactly(int(match.group(1)))
            if not head.startswith(b"HTTP/1.1 200"):
                errors.append(head.split(b"\r\n")[0].decode() + " " + body[:200].decode(errors="replace"))
                await asyncio.sleep(0.05)
                continue
            window.answered(sent, time.perf_counter())
    finally:
        writer.close()


async def _load(port: int, request: bytes, concurrency: int, seconds: float, warmup: float) -> dict[str, float]:
    errors: list[str] = []
    window = _Window(warmup, seconds, concurrency)
    await asyncio.gather(*(_one_connection(port, request, window, errors) for _ in range(concurrency)))
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests, first: {errors[0]}")
    latencies = sorted(window.latencies)
    if not latencies or window.closed_at is None:
        raise RuntimeError(f"no request completed in the {seconds:g} s window")
    return {"p50_ms": latencies[len(latencies) // 2] * 1e3,
            "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
            "images_s": len(latencies) / (window.closed_at - window.opens), "requests": len(latencies),
            "all_requests": len(latencies) + window.outside, "window_s": window.closed_at - window.opens}


def load(port: int, request: bytes, concurrency: int, seconds: float, pids: dict[str, int] | None = None,
         warmup: float = 1.0) -> dict[str, float]:
    """Closed-loop load, `warmup` seconds then `seconds` measured (_Window); with `pids`, also the CPU each
    process (and its children: API processes) spent per request, which is robust to a busy host.
    Always the load client's own CPU per request (`client_cpu_ms`, this process): it shares the
    cores with what it measures."""
    import psutil

    def cpu(proc: psutil.Process) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])

    # This process may have imported torch and built checkpoints: a full collection over all that
    # stalled every client at once for ~100 ms (seen in an open-loop run as a 130 ms hole in the
    # requests the API received). Frozen, the collector leaves it alone, as the service's does.
    gc.freeze()
    procs = {name: psutil.Process(pid) for name, pid in (pids or {}).items()}
    before = {name: cpu(p) for name, p in procs.items()}
    client_before = time.process_time()
    result = asyncio.run(_load(port, request, concurrency, seconds, warmup))
    result["client_cpu_ms"] = (time.process_time() - client_before) * 1e3 / result["all_requests"]
    for name, p in procs.items():
        result[f"{name}_cpu_ms"] = (cpu(p) - before[name]) * 1e3 / result["all_requests"]
    return result


# ----------------------------------------------------------------------------- fresh processes
def fresh_json(argv: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> Any:
    """Run `python argv...` in a fresh process with exactly `env` (default: ours); the JSON on the
    last line of its output."""
    out = subprocess.run([sys.executable, *argv], env=env if env is not None else dict(os.environ), cwd=REPO,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])}... exited with {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the host
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_has_bf16() -> bool:
    """AVX512-BF16 (or AMX) on this CPU: bf16 matrix products run natively, not emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def machine(torch_threads: bool = False, gpu: bool = False) -> str:
    """CPU model, cores, OS, Python and torch; with `gpu`, the GPU torch sees first."""
    import torch

    threads = f" (torch's default: {torch.get_num_threads()} threads)" if torch_threads else ""
    card = ""
    if gpu and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        card = f", {torch.cuda.get_device_name(0)} (capability {major}.{minor}, CUDA {torch.version.cuda})"
    return (f"{cpu_model()}, {os.cpu_count()} cores{threads}{card}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def load_average() -> float:
    return os.getloadavg()[0]


def hiding(work: Path, modules: list[str]) -> str:
    """A directory that, first on a side's PYTHONPATH, makes `import M` fail for each of `modules`:
    the side runs as it did before it depended on them (redis-py, for one, uses hiredis when it can
    import it), though this checkout's environment has them."""
    path = work / f"hidden-{'-'.join(modules)}"
    for module in modules:
        (path / module).mkdir(parents=True, exist_ok=True)
        (path / module / "__init__.py").write_text(f"raise ImportError({module + ' hidden by the bench'!r})\n")
    return str(path)
