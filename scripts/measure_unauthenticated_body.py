"""How much of a 300 MiB unauthenticated POST body an API process takes before it answers, and its RSS.

    .venv/bin/python scripts/measure_unauthenticated_body.py [REPO_DIR] [PORT]

Starts `python -m app.cli api` from REPO_DIR (default: this checkout; point it at an export of an
older commit, `git archive <commit> | tar -x -C /tmp/old`, to compare) with a key, sends three
bodies (POST /jobs with Content-Length, POST /datasets with Content-Length and chunked) as fast as
the server takes them, and prints what the client got rid of before the answer and the API's RSS.
No Redis is needed: nothing gets that far.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

MiB = 1024**2


def push(port: int, path: bytes, content_type: bytes, chunked: bool) -> tuple[str, int, float]:
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % (300 * MiB)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: %s\r\n%s\r\n" % (path, content_type, framing))
    block, sent, started = b"x" * MiB, 0, time.monotonic()
    try:
        while sent < 300 * MiB:
            readable, writable, _ = select.select([sock], [sock], [], 30)
            if readable or not writable:
                break
            sent += sock.send((b"%x\r\n" % len(block) + block + b"\r\n") if chunked else block)
    except OSError:
        pass
    sock.settimeout(30)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    sock.close()
    return (data.split(b" ", 2)[1].decode() if data else "none"), sent, time.monotonic() - started


def main() -> None:
    repo = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parent.parent)
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 18611
    env = {**os.environ, "TORCHYARD_API_KEY": "k", "TORCHYARD_PORT": str(port), "PYTHONUNBUFFERED": "1",
           "TORCHYARD_DATA_DIR": "/tmp/torchyard-measure", "TORCHYARD_REDIS_URL": "redis://127.0.0.1:1/0"}
    api = subprocess.Popen([sys.executable, "-m", "app.cli", "api"], cwd=repo, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        process = psutil.Process(api.pid)
        for path, content_type, chunked in ((b"/jobs", b"text/plain", False),
                                            (b"/datasets", b"multipart/form-data; boundary=x", False),
                                            (b"/datasets", b"multipart/form-data; boundary=x", True)):
            before = process.memory_info().rss
            status, sent, seconds = push(port, path, content_type, chunked)
            print(f"{path.decode()} {'chunked' if chunked else 'Content-Length'}: {status}, the client sent "
                  f"{sent / MiB:.1f} MiB in {seconds:.2f} s; API RSS {process.memory_info().rss / MiB:.0f} MiB "
                  f"(before: {before / MiB:.0f})", flush=True)
    finally:
        api.terminate()
        api.wait()


if __name__ == "__main__":
    main()
