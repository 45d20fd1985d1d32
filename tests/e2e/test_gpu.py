"""A real device-side assert on a GPU worker under `torchyard up` (`pytest -m gpu`; skipped where
torch sees no CUDA): the worker's CUDA context breaks for good, so the worker must requeue its job,
go out of service, exit 3, and come back as a fresh process that runs the job again. (The CPU twin
of the same path, with the error's text raised instead, is tests/e2e/test_supervisor.py's.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import REPO, free_port, wait_for_job, wait_until
from worker.device.health import PROVOKE_DEVICE_ASSERT

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]


def test_a_device_side_assert_takes_the_worker_out_of_service_and_a_fresh_one_resumes_the_job(tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update(TORCHYARD_DATA_DIR=str(tmp_path / "data"), TORCHYARD_HOST="127.0.0.1", TORCHYARD_PORT=str(port),
               TORCHYARD_DEVICES="0", TORCHYARD_DEVICE_FAULT_FILE=str(fault), TORCHYARD_HEARTBEAT_INTERVAL_S="0.5",
               TORCHYARD_HEARTBEAT_TTL_S="3", PYTHONUNBUFFERED="1")
    log = tmp_path / "up.log"
    with open(log, "ab") as out:
        up = subprocess.Popen([sys.executable, "-m", "app.cli", "up"], cwd=REPO, env=env, stdout=out,
                              stderr=subprocess.STDOUT, start_new_session=True)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        def gpu_worker() -> dict | None:
            devices = client.get("/devices").json()["devices"]
            return next((d for d in devices if d["type"] == "cuda" and d["status"] in ("idle", "busy")), None)

        first = wait_until(gpu_worker, timeout=180, interval=0.5, what="the GPU worker")
        job = client.post("/jobs", json={"model": "resnet18", "dataset": "fake", "epochs": 40, "patience": 0,
                                         "device": "cuda"}).json()
        wait_until(lambda: client.get(f"/jobs/{job['id']}").json()["status"] == "running", timeout=180,
                   what="the job running on the GPU")
        fault.write_text(PROVOKE_DEVICE_ASSERT)  # at its next step the worker indexes past a tensor's end

        fresh = wait_until(lambda: (d := gpu_worker()) and d["pid"] != first["pid"] and d, timeout=240,
                           interval=0.5, what="a fresh GPU worker process")
        assert not fault.exists(), "the fault was never provoked"
        text = log.read_text(errors="replace")
        assert "device-side assert triggered" in text and "out of service" in text, text[-4000:]
        assert "exited with code 3" in text, text[-4000:]  # its status, not an abort in a CUDA destructor
        again = wait_until(lambda: (j := client.get(f"/jobs/{job['id']}").json())["attempts"] >= 2
                           and j["status"] in ("running", "succeeded") and j, timeout=240, what="the job running again")
        assert again["device"] == fresh["id"]
        client.post(f"/jobs/{job['id']}/cancel")
        wait_for_job(client, job["id"], {"cancelled", "succeeded"}, timeout=120)
    finally:
        client.close()
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
