"""`torchyard up` with the embedded Redis: starts everything, and a SIGTERM leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.support import REPO, free_port, wait_until

pytestmark = pytest.mark.e2e


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_starts_stack_and_stops_everything(tmp_path, sig) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHYARD_REDIS_URL", "TORCHYARD_API_KEY")}
    env.update(TORCHYARD_DATA_DIR=str(tmp_path / "var"), TORCHYARD_PORT=str(port), TORCHYARD_DEVICES="auto",
               TORCHYARD_HEARTBEAT_INTERVAL_S="0.5", PYTHONUNBUFFERED="1")
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "app.cli", "up"], cwd=REPO, env=env, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    try:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=90, what="the stack to be ready")
        children = _descendants(up.pid)
        names = " ".join(" ".join(p.cmdline()) for p in children)
        assert "redis-server" in names and " api" in names and "worker --device cpu" in names
        assert (tmp_path / "var" / "redis" / "appendonlydir").exists() or (tmp_path / "var" / "redis").exists()
        devices = client.get("/devices").json()["devices"]
        assert [d["type"] for d in devices] == ["cpu"]

        # A worker that dies is restarted by the supervisor.
        worker = next(p for p in children if "worker" in " ".join(p.cmdline()))
        worker.kill()
        wait_until(lambda: any("worker" in " ".join(p.cmdline()) and p.pid != worker.pid
                               for p in _descendants(up.pid)), timeout=30, what="the worker to be restarted")

        children = _descendants(up.pid)
        up.send_signal(sig)
        assert up.wait(90) == 0
        time.sleep(0.5)
        alive = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], f"left running: {[p.cmdline() for p in alive]}"
        assert "restarting worker-cpu" in (tmp_path / "up.log").read_text()
    finally:
        client.close()
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
