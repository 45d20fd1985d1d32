"""Hostile clients against the real API process: bodies refused before they are read, slow clients
timed out while others are served, the Host and Origin guards, safe defaults at start, and workers
as the OOM killer's first choice. Everything over real sockets; nothing is mocked."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from harness import spawn, stop
from tests.support import REPO, Processes, flush, free_port, read_until_closed, wait_until, with_db

pytestmark = pytest.mark.e2e

KEY = "security-test-key"
MiB = 1024**2


@pytest.fixture(scope="module")
def guarded_api(redis_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """An API with a key and short slow-client limits: head within 2 s, at most 8 connections per
    client address, a body deadline of 2 s plus 1 s per 100 KB."""
    data_dir: Path = tmp_path_factory.mktemp("security")
    url = with_db(redis_base_url, 15)
    flush(url)
    procs = Processes(url, data_dir, data_dir / "logs", TORCHYARD_API_KEY=KEY, TORCHYARD_HEADER_TIMEOUT_S="2",
                      TORCHYARD_MAX_CONNECTIONS_PER_CLIENT="8", TORCHYARD_BODY_TIMEOUT_S="2",
                      TORCHYARD_MIN_BODY_RATE="100000", TORCHYARD_MAX_UPLOAD_BYTES=str(8 * MiB))
    port = free_port()
    api = procs.api(port, TORCHYARD_API_KEY=KEY)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{base}/healthz").status_code == 200, timeout=60, what="the API")
    try:
        yield {"base": base, "port": port, "pid": api.pid, "procs": procs, "api": api}
    finally:
        procs.stop_all()
        flush(url)


def _read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """Status, headers and body of one response, read to its Content-Length: whether the server
    then closes the connection is for the caller to check (the `connection` header), never a
    response cut or waited out."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data and (chunk := sock.recv(65536)):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
        length = int(headers.get("content-length", -1))
        while (length < 0 or len(body) < length) and (chunk := sock.recv(65536)):
            body += chunk
    except (ConnectionResetError, TimeoutError):
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
    assert lines[0].startswith("HTTP/"), f"no response came back, only {data[:200]!r}"
    return int(lines[0].split(" ")[1]), headers, body


PART = b'--x\r\nContent-Disposition: form-data; name="file"; filename="big.zip"\r\n\r\n'


def _push_body(port: int, head: bytes, total: int, chunked: bool, preamble: bytes = b"") -> tuple[int, int, dict]:
    """Send `head`, then up to `total` body bytes as fast as the server takes them; stop when it
    answers or closes. Returns (bytes the server's socket accepted, at most: everything sent),
    the status and the JSON body."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 * 1024)
    sock.sendall(head + ((b"%x\r\n" % len(preamble) + preamble + b"\r\n") if chunked and preamble else preamble))
    block = b"x" * MiB
    sent = 0
    try:
        while sent < total:
            readable, writable, _ = select.select([sock], [sock], [], 10)
            if readable:
                break  # the answer is there
            if not writable:
                break  # the server stopped reading and has not answered in 10 s: the assertion below says so
            piece = (b"%x\r\n" % len(block) + block + b"\r\n") if chunked else block
            sent += sock.send(piece)
    except (BrokenPipeError, ConnectionResetError):
        pass
    status, headers, body = _read_response(sock)
    sock.close()
    # A refusal sent before the body was read must close the connection: uvicorn would otherwise
    # read (and discard) the rest of the body, all 300 MiB of it, to reach the next request.
    assert headers.get("connection") == "close", (
        f"the {status} refusal of an unread body left the connection open (no `Connection: close`; headers "
        f"{headers}): the server goes on reading the rest of the body")
    return sent, status, json.loads(body)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_300_mib_unauthenticated_body_is_refused_after_a_few_mib(guarded_api: dict, chunked: bool) -> None:
    port, api = guarded_api["port"], psutil.Process(guarded_api["pid"])
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % (300 * MiB)
    rss_before = api.memory_info().rss
    for path, kind in ((b"/datasets", b"multipart/form-data; boundary=x"), (b"/jobs", b"text/plain"),
                       (b"/predict", b"multipart/form-data; boundary=x")):
        head = b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: %s\r\n%s\r\n" % (path, kind, framing)
        sent, status, answer = _push_body(port, head, 300 * MiB, chunked)
        assert status == 401 and "API key" in answer["detail"], (path, status, answer)
        # What left this client at all: the server's socket buffers, ours, and what was in flight
        # when the answer came. Of 300 MiB, a few.
        assert sent <= 16 * MiB, f"{path!r}: {sent / MiB:.0f} MiB were taken before the 401"
    assert api.memory_info().rss - rss_before < 20 * MiB  # the API's memory stayed flat


def test_authenticated_bodies_over_the_cap_are_refused_on_the_header_or_as_they_stream(guarded_api: dict) -> None:
    port = guarded_api["port"]
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
    # Declared: 413 before a byte of the body (upload cap: 8 MiB + 1 MiB of framing).
    head = (b"POST /datasets HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth +
            b"Content-Type: multipart/form-data; boundary=x\r\nContent-Length: %d\r\n\r\n" % (300 * MiB))
    sent, status, answer = _push_body(port, head, 300 * MiB, chunked=False)
    assert status == 413 and "limit" in answer["detail"] and sent <= 16 * MiB
    # Chunked (nothing declared): counted as it streams, 413 at the cap.
    head = (b"POST /datasets HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth +
            b"Content-Type: multipart/form-data; boundary=x\r\nTransfer-Encoding: chunked\r\n\r\n")
    sent, status, answer = _push_body(port, head, 300 * MiB, chunked=True, preamble=PART)
    assert status == 413 and "limit" in answer["detail"] and sent <= 32 * MiB
    # JSON is capped small, whatever the route: 2 MiB of JSON to /jobs.
    head = (b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth +
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    sent, status, answer = _push_body(port, head, 300 * MiB, chunked=True)
    assert status == 413 and sent <= 16 * MiB


def _slow_connection(port: int, source: str, results: list, stop: threading.Event) -> None:
    """A slowloris connection: a request line and then one header byte every 0.2 s, never done."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
        sock.sendall(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        started = time.monotonic()
        while not stop.is_set():
            readable, _, _ = select.select([sock], [], [], 0.2)
            if readable:
                break
            try:
                sock.send(b"a")
            except OSError:
                break
        status, _, body = _read_response(sock, timeout=5)
        results.append((status, json.loads(body)["detail"], time.monotonic() - started))
        sock.close()
    except Exception as exc:  # recorded, so the test shows it
        results.append((0, repr(exc), 0.0))


def test_slowloris_connections_are_cut_while_another_client_is_served(guarded_api: dict) -> None:
    port = guarded_api["port"]
    results: list = []
    stop = threading.Event()
    # 24 slow connections from one address (127.0.0.2: all of 127/8 is this host): 8 are let in
    # (TORCHYARD_MAX_CONNECTIONS_PER_CLIENT), and cut after the 2 s head deadline however they
    # trickle; the 16 others are refused at once.
    slow = [threading.Thread(target=_slow_connection, args=(port, "127.0.0.2", results, stop)) for _ in range(24)]
    for thread in slow:
        thread.start()
    # Meanwhile another client keeps getting its answers.
    served = 0
    with httpx.Client(base_url=guarded_api["base"], headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as client:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            assert client.get("/jobs").status_code == 200
            served += 1
    stop.set()
    for thread in slow:
        thread.join(30)
    assert served > 0
    statuses = [status for status, _, _ in results]
    # 8 at a time are let in; a thread the loaded host started late may take a slot a cut one freed.
    assert len(statuses) == 24 and set(statuses) <= {408, 503}, results
    assert statuses.count(408) >= 8 and statuses.count(503) >= 8, results
    assert all("TORCHYARD_HEADER_TIMEOUT_S" in d for s, d, _ in results if s == 408)
    assert all("TORCHYARD_MAX_CONNECTIONS_PER_CLIENT" in d for s, d, _ in results if s == 503)
    # The slow ones held on until the deadline, not a moment less: the cut was the timeout's.
    assert min(t for s, _, t in results if s == 408) >= 1.5


def test_a_slow_body_and_an_oversized_head_are_refused(guarded_api: dict) -> None:
    port = guarded_api["port"]
    # A body of 10 000 bytes at 100 bytes a second: the deadline (2 s + 1 s per 100 KB) cuts it.
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: 10000\r\n\r\n{")
    started = time.monotonic()
    while not select.select([sock], [], [], 0.5)[0] and time.monotonic() - started < 20:
        sock.send(b" " * 50)
    status, headers, body = _read_response(sock)
    assert status == 408 and "too slowly" in json.loads(body)["detail"] and headers.get("connection") == "close"
    # A head over TORCHYARD_MAX_HEADER_BYTES (64 KiB): 431, never handed to the app.
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Big: " + b"a" * (100 * 1024) + b"\r\n\r\n")
    status, _, body = _read_response(sock)
    assert status == 431 and "TORCHYARD_MAX_HEADER_BYTES" in json.loads(body)["detail"]
    # One that never ends: refused once it passes the cap, not buffered for ever.
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    try:
        for _ in range(64):
            sock.sendall(b"X-More: " + b"a" * 65536 + b"\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    status, _, _ = _read_response(sock)
    assert status == 431


def test_host_and_origin_guards(guarded_api: dict) -> None:
    base, auth = guarded_api["base"], {"Authorization": f"Bearer {KEY}"}
    port = guarded_api["port"]
    # DNS rebinding: the page's own name in Host. Refused on a loopback bind; localhost names pass.
    rebound = httpx.get(f"{base}/jobs", headers={**auth, "Host": f"attacker.example:{port}"})
    assert rebound.status_code == 400 and "TORCHYARD_ALLOWED_HOSTS" in rebound.json()["detail"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]", "app.localhost"):
        assert httpx.get(f"{base}/jobs", headers={**auth, "Host": host}).status_code == 200, host
    # A state-changing request from a page of another origin: refused, with or without the key.
    spec = {"model": "nosuch", "dataset": "fake"}
    for origin in ("http://attacker.example", "null", f"http://127.0.0.1:{port + 1}", "http://[::1"):
        refused = httpx.post(f"{base}/jobs", json=spec, headers={**auth, "Origin": origin})
        assert refused.status_code == 403 and "TORCHYARD_ALLOWED_ORIGINS" in refused.json()["detail"], origin
    # The same origin (the dashboard) goes through to validation; a read from anywhere is not refused here.
    same = httpx.post(f"{base}/jobs", json=spec, headers={**auth, "Origin": f"http://127.0.0.1:{port}"})
    assert same.status_code == 422
    assert httpx.get(f"{base}/jobs", headers={**auth, "Origin": "http://attacker.example"}).status_code == 200


def test_an_app_served_beyond_loopback_another_way_still_checks_host(redis_base_url: str, tmp_path: Path) -> None:
    """`torchyard api` refuses a non-loopback bind without TORCHYARD_ALLOWED_HOSTS; an app served
    another way (uvicorn's own command, as a deployment might) skipped that check, and the gate then
    served any Host: a DNS-rebinding page reached it. Now such a bind serves localhost names only."""
    import os

    port = free_port()
    env = {**os.environ, "TORCHYARD_REDIS_URL": with_db(redis_base_url, 15), "TORCHYARD_DATA_DIR": str(tmp_path),
           "TORCHYARD_HOST": "0.0.0.0", "TORCHYARD_PORT": str(port), "TORCHYARD_API_KEY": KEY,
           "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHYARD_ALLOWED_HOSTS", None)
    proc = spawn([sys.executable, "-m", "uvicorn", "app.main:create_app", "--factory", "--host", "0.0.0.0",
                  "--port", str(port)], tmp_path / "uvicorn.log", env)
    base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {KEY}"}
    try:
        wait_until(lambda: httpx.get(f"{base}/healthz").status_code == 200, timeout=60, what="the API")
        rebound = httpx.get(f"{base}/jobs", headers={**auth, "Host": f"attacker.example:{port}"})
        assert rebound.status_code == 400 and "TORCHYARD_ALLOWED_HOSTS" in rebound.json()["detail"], rebound.text
        assert httpx.get(f"{base}/jobs", headers={**auth, "Host": f"localhost:{port}"}).status_code == 200
    finally:
        stop(proc)


def _start_api(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "app.cli", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_no_key_beyond_loopback_refuses_to_start(redis_base_url: str, tmp_path: Path) -> None:
    import os

    env = {**os.environ, "TORCHYARD_REDIS_URL": with_db(redis_base_url, 15), "TORCHYARD_DATA_DIR": str(tmp_path),
           "TORCHYARD_HOST": "0.0.0.0", "TORCHYARD_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHYARD_API_KEY", None)
    for command in (["api"], ["up"]):
        proc = _start_api(env, *command)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 2, out
        assert "refusing to serve on 0.0.0.0" in out and "TORCHYARD_API_KEY" in out, out
    assert not (tmp_path / "redis").exists()  # `up` stopped before starting anything
    # (Told explicitly with TORCHYARD_ALLOW_UNAUTHENTICATED=true it serves and warns: tests/app/test_server.py.)


def test_workers_are_the_oom_killers_first_choice(stack: dict) -> None:
    worker, api = stack["worker"], stack["api"]
    assert Path(f"/proc/{worker.pid}/oom_score_adj").read_text().strip() == "800"
    assert Path(f"/proc/{api.pid}/oom_score_adj").read_text().strip() == "0"
    redis_pids = [p.pid for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("redis-server")
                  and p.ppid() == psutil.Process().pid]
    for pid in redis_pids:  # the embedded Redis this test session started
        assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "0"


def test_an_unfinished_chunked_body_gets_one_408_with_one_connection_header(guarded_api: dict) -> None:
    """The body guard's 408 says `connection: close` itself; the gate must not add a second one."""
    sock = socket.create_connection(("127.0.0.1", guarded_api["port"]))
    sock.sendall(b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n")
    raw = read_until_closed(sock, 20)
    sock.close()
    head = raw.partition(b"\r\n\r\n")[0].decode("latin-1").lower().split("\r\n")
    assert head[0].split(" ")[1] == "408", raw
    assert [line for line in head[1:] if line.startswith("connection:")] == ["connection: close"], head
