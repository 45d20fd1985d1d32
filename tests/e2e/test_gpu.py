"""A real device-side assert on a GPU worker under `torchyard up` (`pytest -m gpu`; skipped where
torch sees no CUDA): the worker's CUDA context breaks for good, so the worker must requeue its job,
go out of service, exit 3, and come back as a fresh process that runs the job again. (The CPU twin
of the same path, with the error's text raised instead, is tests/e2e/test_supervisor.py's.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import UpStack
from tests.support import wait_for_job, wait_until
from worker.device.health import PROVOKE_DEVICE_ASSERT

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]


def test_a_device_side_assert_takes_the_worker_out_of_service_and_a_fresh_one_resumes_the_job(tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    settings = {"TORCHYARD_DEVICES": "0", "TORCHYARD_DEVICE_FAULT_FILE": str(fault),
                "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5", "TORCHYARD_HEARTBEAT_TTL_S": "3"}
    log = tmp_path / "up.log"
    with UpStack(tmp_path / "data", log, settings, start_timeout=180, client_timeout=30) as stack:  # /readyz: the GPU worker
        client = stack.client

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
