"""Devices end to end, on CPU: pinning seen from the worker processes themselves, routing to a named
device, one job per device at a time, the device lock, offline after a crash and back on restart.

Two CPU workers on one machine get distinct device ids through TORCHYARD_NODE_NAME (hosta, hostb),
as two hosts would."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import redis

from core import keys
from core.devices import instance_pid
from tests.support import REPO, Processes, free_port, job_events, wait_for_job, wait_until
from worker.device.pinning import PINNED_MARKER
from worker.runtime.main import EXIT_OUT_OF_SERVICE

pytestmark = pytest.mark.e2e

A, B = "hosta/cpu", "hostb/cpu"


def proc_environ(pid: int) -> dict[str, str]:
    """The environment a process was exec'd with, as the kernel shows it to anyone."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def pinned_environ(proc: subprocess.Popen) -> dict[str, str]:
    """The worker's environment once it has re-exec'd itself pinned (same pid)."""
    return wait_until(lambda: (env := proc_environ(proc.pid)).get(PINNED_MARKER) and env,
                      timeout=60, interval=0.02, what=f"pid {proc.pid} to exec pinned")


def devices(client: httpx.Client) -> dict[str, dict]:
    return {d["id"]: d for d in client.get("/devices").json()["devices"]}


def device_is(client: httpx.Client, device_id: str, status: str, pid: int | None = None) -> dict | None:
    device = devices(client).get(device_id)
    if device and device["status"] == status and (pid is None or device["pid"] == pid):
        return device
    return None


def submit(client: httpx.Client, device: str, epochs: int = 1) -> dict:
    response = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": epochs, "device": device})
    assert response.status_code == 202, response.text
    return response.json()


def succeeded(client: httpx.Client, job_id: str) -> dict:
    job = wait_for_job(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=180)
    assert job["status"] == "succeeded", job
    return job


def span(job: dict) -> tuple[datetime, datetime]:
    return datetime.fromisoformat(job["started_at"]), datetime.fromisoformat(job["finished_at"])


def test_gpu_pin_without_gpu_exits_with_a_clear_error(clean_redis_url: str, tmp_path: Path) -> None:
    """`--device 1` (and the N-th entry of an outer CUDA_VISIBLE_DEVICES) on a GPU-less machine: the
    process itself carries the pin, and it refuses to run rather than fall back to the CPU."""
    procs = Processes(clean_redis_url, tmp_path / "data", tmp_path / "logs")
    try:
        plain = procs.worker("1", name="worker-gpu1")
        nested = procs.worker("1", name="worker-nested", CUDA_VISIBLE_DEVICES="3,5")
        for proc, visible in ((plain, "1"), (nested, "5")):
            env = pinned_environ(proc)
            assert env["CUDA_VISIBLE_DEVICES"] == visible and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        for proc, visible in ((plain, "1"), (nested, "5")):
            assert proc.wait(120) != 0
            log = procs.log(proc)
            assert f"no CUDA device is visible with CUDA_VISIBLE_DEVICES='{visible}'" in log, log
            assert "refusing to fall back to the CPU" in log
    finally:
        procs.stop_all()


def test_two_workers_routing_lock_offline_and_back(clean_redis_url: str, tmp_path: Path) -> None:
    procs = Processes(clean_redis_url, tmp_path / "data", tmp_path / "logs")
    port = free_port()
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        # An outer CUDA_VISIBLE_DEVICES does not leak into a CPU worker: `--device cpu` hides every GPU.
        worker_a = procs.worker("cpu", name="worker-hosta", TORCHYARD_NODE_NAME="hosta", CUDA_VISIBLE_DEVICES="7")
        # An operator's own OpenMP spin is kept; without one the worker starts with a capped spin.
        worker_b = procs.worker("cpu", name="worker-hostb", TORCHYARD_NODE_NAME="hostb", GOMP_SPINCOUNT="5000")
        procs.api(port)
        wait_until(lambda: device_is(client, A, "idle") and device_is(client, B, "idle"), timeout=90,
                   what="both workers idle in /devices")

        # Each worker process saw its own pin, from the kernel's view and from its own heartbeat.
        listed = devices(client)
        for proc, device_id, node, spin in ((worker_a, A, "hosta", "30000"), (worker_b, B, "hostb", "5000")):
            env = proc_environ(proc.pid)
            assert env["CUDA_VISIBLE_DEVICES"] == "" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            assert env.get("GOMP_SPINCOUNT") == spin
            device = listed[device_id]
            assert device["pid"] == proc.pid and device["cuda_visible_devices"] == ""
            assert device["worker"] == f"cpu@{node}" and device["type"] == "cpu" and device["index"] is None
            assert device["name"] and device["memory_total_bytes"] > 0
            assert device["current_job"] is None and device["loaded_models"] == []

        # Unknown device id: refused up front. "cuda" with no GPU worker online: queued, and says so.
        unknown = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "device": "hostz/cuda:3"})
        assert unknown.status_code == 422 and "hostz/cuda:3" in unknown.json()["detail"]
        for_gpu = submit(client, "cuda")
        assert for_gpu["status"] == "queued" and "no GPU worker is online" in for_gpu["message"]
        assert client.post(f"/jobs/{for_gpu['id']}/cancel").status_code == 202

        # Two jobs for hosta, one for hostb: each runs where it was sent; hosta runs its two in turn.
        first, second, other = submit(client, A, epochs=3), submit(client, A), submit(client, B)
        assert first["message"] and "offline" not in first["message"]
        duplicate = procs.worker("cpu", name="worker-hosta-duplicate", TORCHYARD_NODE_NAME="hosta")
        busy = wait_until(lambda: device_is(client, A, "busy"), timeout=60, interval=0.1, what="hosta busy")
        assert busy["current_job"] in (first["id"], second["id"])
        first, second, other = (succeeded(client, j["id"]) for j in (first, second, other))
        assert first["device"] == second["device"] == A and other["device"] == B
        assert first["device_choices"]["device"] == "cpu" and first["attempts"] == second["attempts"] == 1
        (s1, f1), (s2, f2) = span(first), span(second)
        assert f1 <= s2 or f2 <= s1, f"jobs on {A} overlapped: {first} {second}"
        wait_until(lambda: device_is(client, A, "idle"), timeout=30, what="hosta idle again")

        # The device lock: a second worker for hosta/cpu (started while hosta trained) was refused.
        assert duplicate.wait(120) != 0
        assert f"device {A} is already held by cpu@hosta (pid {worker_a.pid})" in procs.log(duplicate)
        assert device_is(client, A, "idle", pid=worker_a.pid)

        # A crashed worker turns offline within the TTL; a job sent to it waits, and says why.
        procs.stop(worker_a, signal.SIGKILL)
        offline = wait_until(lambda: device_is(client, A, "offline"), timeout=30, what="hosta offline")
        assert offline["current_job"] is None
        waiting = submit(client, A)
        assert waiting["status"] == "queued" and f"device {A} is offline" in waiting["message"]
        assert device_is(client, B, "idle")  # hostb is free, yet it must not take hosta's job
        again = client.get(f"/jobs/{waiting['id']}").json()
        assert again["status"] == "queued" and f"device {A} is offline" in again["message"]
        listed_waiting = {j["id"]: j for j in client.get("/jobs", params={"status": "queued"}).json()["jobs"]}
        assert "offline" in listed_waiting[waiting["id"]]["message"]

        # Restarted, hosta is back (idle, new pid) and runs the job that waited for it.
        restarted = procs.worker("cpu", name="worker-hosta-restarted", TORCHYARD_NODE_NAME="hosta")
        done = succeeded(client, waiting["id"])
        assert done["device"] == A
        assert restarted.poll() is None
        wait_until(lambda: device_is(client, A, "idle", pid=restarted.pid), timeout=30, what="hosta back, idle")
        assert "already held" not in procs.log(restarted)
    finally:
        client.close()
        procs.stop_all()


def test_a_worker_frozen_past_its_ttl_whose_device_was_taken_over_stops_taking_jobs(clean_redis_url: str,
                                                                                    tmp_path: Path) -> None:
    """A worker frozen (SIGSTOP) mid-job past its heartbeat's TTL (not its job's lease) loses its
    alive key; a second process started for the same device takes it. Woken (SIGCONT), the first
    notices at its next beat that the device is another's: it gives its job back, stops consuming
    and exits with the out-of-service status for its supervisor, instead of going on as a ghost
    beside its successor, whose record it leaves alone. The successor resumes that job, and runs
    the next one."""
    procs = Processes(clean_redis_url, tmp_path / "data", tmp_path / "logs", TORCHYARD_LEASE_TTL_S="60")
    port = free_port()
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    redis_client = redis.Redis.from_url(clean_redis_url, decode_responses=True)

    def claimed_by(job_id: str) -> int | None:
        return instance_pid(redis_client.hget(keys.job(job_id), "claimed_by") or "")

    try:
        first = procs.worker("cpu", name="worker-first", TORCHYARD_NODE_NAME="hosta")
        procs.api(port)
        wait_until(lambda: device_is(client, A, "idle", pid=first.pid), timeout=90, what="the first worker idle")
        long = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 500, "patience": 0,
                                          "device": A}).json()
        wait_until(lambda: client.get(f"/jobs/{long['id']}").json()["progress"]["step"] > 0, timeout=90,
                   what="the job training on the first worker")
        first.send_signal(signal.SIGSTOP)
        wait_until(lambda: device_is(client, A, "offline"), timeout=30, what="the frozen worker's key to lapse")
        second = procs.worker("cpu", name="worker-second", TORCHYARD_NODE_NAME="hosta")
        wait_until(lambda: device_is(client, A, "idle", pid=second.pid), timeout=90, what="the second worker idle")
        assert client.get(f"/jobs/{long['id']}").json()["status"] == "running"  # still the frozen one's lease
        first.send_signal(signal.SIGCONT)

        assert first.wait(60) == EXIT_OUT_OF_SERVICE
        log = procs.log(first)
        taken = f"device {A} was taken over by another worker instance (cpu@hosta, pid {second.pid})"
        assert taken in log, log
        assert "already held" not in procs.log(second) and second.poll() is None

        resumed = wait_until(lambda: (j := client.get(f"/jobs/{long['id']}").json())["status"] == "running"
                             and claimed_by(long["id"]) == second.pid and j, timeout=60,
                             what="the job given back and running on the second worker")
        assert resumed["attempts"] == 2
        assert client.post(f"/jobs/{long['id']}/cancel").status_code == 202
        assert wait_for_job(client, long["id"], {"cancelled", "failed"}, timeout=60)["status"] == "cancelled"
        given_back = [data["reason"] for kind, data in job_events(client, long["id"])
                      if kind == "status" and data.get("status") == "queued" and data.get("reason")]
        assert given_back == [f"device {A} went out of service ({taken} while this one (pid {first.pid}) did not "
                              f"renew its heartbeat for longer than its TTL)"], given_back

        job = succeeded(client, submit(client, A)["id"])
        assert job["attempts"] == 1 and claimed_by(job["id"]) == second.pid
        # The first's exit left its successor's record alone (a release only by the holding instance).
        wait_until(lambda: device_is(client, A, "idle", pid=second.pid), timeout=30, what="the second worker idle")
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
        redis_client.close()
        client.close()
        procs.stop_all()


def test_gpu_smoke_script_in_cpu_mode(tmp_path: Path) -> None:
    """scripts/gpu-smoke.sh itself, on the CPU (`--allow-cpu`): up, train, predict, CPU-only load, stop."""
    script = REPO / "scripts" / "gpu-smoke.sh"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}, "PYTHON": sys.executable}
    if shutil.which("nvidia-smi") is None:
        refused = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "--allow-cpu" in refused.stderr
    summary = tmp_path / "summary.json"
    result = subprocess.run([str(script), "--allow-cpu", "--models", "cifar_net", "--epochs", "1",
                             "--data-dir", str(tmp_path / "data"), "--json", str(summary)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SMOKE PASSED" in result.stdout and "nothing left running" in result.stdout
    [job] = json.loads(summary.read_text())["jobs"]
    assert job["model"] == "cifar_net" and job["images_per_second"][0] > 0
    assert "/cuda:" in job["device"] if shutil.which("nvidia-smi") else job["device"].endswith("/cpu")
