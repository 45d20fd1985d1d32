"""`torchyard up` with the embedded Redis: starts everything, and a SIGTERM leaves nothing behind."""

from __future__ import annotations

import signal
import subprocess
import time

import psutil
import pytest

from harness import UpStack, cli, without_settings
from tests.support import REPO, free_port, job_events, wait_until

pytestmark = pytest.mark.e2e


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_starts_stack_and_stops_everything(tmp_path, sig) -> None:
    """With SIGTERM the API runs as two processes: its children are `up`'s grandchildren, and
    must be gone too."""
    api_workers = 2 if sig == signal.SIGTERM else 1
    env = {"TORCHYARD_DEVICES": "auto", "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5", "TORCHYARD_API_WORKERS": str(api_workers)}
    with UpStack(tmp_path / "var", tmp_path / "up.log", env, start_timeout=90, client_timeout=10) as stack:
        up, client, port = stack.proc, stack.client, stack.port
        assert up is not None
        children = _descendants(up.pid)
        names = " ".join(" ".join(p.cmdline()) for p in children)
        assert "redis-server" in names and " api" in names and "worker --device cpu" in names
        api = next(p for p in children if p.cmdline()[-1:] == ["api"])
        spawned = [p for p in api.children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(spawned) == (api_workers if api_workers > 1 else 0), [p.cmdline() for p in api.children()]
        assert (tmp_path / "var" / "redis" / "appendonlydir").exists() or (tmp_path / "var" / "redis").exists()
        devices = client.get("/devices").json()["devices"]
        assert [d["type"] for d in devices] == ["cpu"]

        # A worker that dies is restarted by the supervisor.
        worker = next(p for p in children if "worker --device" in " ".join(p.cmdline()))
        worker.kill()
        wait_until(lambda: any("worker --device" in " ".join(p.cmdline()) and p.pid != worker.pid
                               for p in _descendants(up.pid)), timeout=30, what="the worker to be restarted")

        children = _descendants(up.pid)
        up.send_signal(sig)
        assert up.wait(90) == 0
        time.sleep(0.5)
        alive = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], f"left running: {[p.cmdline() for p in alive]}"
        text = (tmp_path / "up.log").read_text()
        assert "restarting worker-cpu" in text
        # The banner only once the API serves, with where the CLI is.
        assert text.count("torchyard is up") == 1
        assert text.index("Application startup complete") < text.index("torchyard is up")
        # ... and once a worker is ready (its first heartbeat follows this line), not before.
        assert text.index("INFO worker.runtime.main: worker ") < text.index("torchyard is up")
        assert "1 worker(s) ready" in text
        assert f"--url http://127.0.0.1:{port} devices" in text


def test_up_guards_its_data_dir_restarts_redis_and_a_broken_worker(tmp_path) -> None:
    """One `up`: a second `up` on its data dir refuses and disturbs nothing; a worker whose device
    breaks mid-step (the CPU twin of a sticky CUDA error) requeues its job, shows `broken`, exits 3
    and is restarted; redis-server SIGKILLed while that job trains is restarted on the same data;
    the job ends `succeeded`, delivered twice, its epochs recorded once."""
    from tests.datagen import shapes_zip

    fault = tmp_path / "device-fault"
    log_path = tmp_path / "up.log"
    settings = {"TORCHYARD_DEVICES": "cpu", "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5", "TORCHYARD_HEARTBEAT_TTL_S": "3",
                "TORCHYARD_LEASE_TTL_S": "3", "TORCHYARD_DEVICE_FAULT_FILE": str(fault)}
    with UpStack(tmp_path / "var", log_path, settings, start_timeout=120, client_timeout=30) as stack:
        up, client, port, env = stack.proc, stack.client, stack.port, stack.env
        assert up is not None

        second = subprocess.run(cli("up"), cwd=REPO, capture_output=True, text=True,
                                env={**env, "TORCHYARD_PORT": str(free_port())}, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"in use by another `torchyard up` (pid {up.pid})" in second.stdout + second.stderr
        assert client.get("/readyz").status_code == 200 and client.get("/jobs").status_code == 200
        # A second `up` with its own data dir on the port in use: it names the API process holding
        # the port and exits 2 before starting anything (no Redis, no worker, no API).
        api_pid = next(p.pid for p in _descendants(up.pid) if p.cmdline()[-1:] == ["api"])
        elsewhere = tmp_path / "elsewhere"
        third = subprocess.run(cli("up"), cwd=REPO, capture_output=True, text=True,
                               env={**env, "TORCHYARD_DATA_DIR": str(elsewhere)}, timeout=120)
        said = third.stdout + third.stderr
        assert third.returncode == 2, said
        assert f"port {port} on 127.0.0.1 is already in use by pid {api_pid} (" in said and "app.cli api" in said
        assert "started" not in said and "torchyard is up" not in said
        assert not (elsewhere / "redis").exists()

        uploaded = client.post("/datasets", data={"name": "shapes"},
                               files={"file": ("s.zip", shapes_zip(per_class=24, corrupt=None), "application/zip")})
        assert uploaded.status_code == 201, uploaded.text
        # On the built-in `fake` set (2,560 images): an epoch is long enough for the fault to land
        # inside it even on the fastest host seen, where the upload's 72 images trained an epoch in
        # less time than the fault took to land (docs/benchmarks.md has the epochs).
        epochs = 8
        job_id = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": epochs,
                                            "batch_size": 8, "patience": 0}).json()["id"]
        wait_until(lambda: (j := client.get(f"/jobs/{job_id}").json())["status"] == "running"
                   and j["progress"]["step"] > 0, timeout=120, what="the job to train")
        fault.write_text("CUDA error: device-side assert triggered")
        broken = wait_until(lambda: [d for d in client.get("/devices").json()["devices"] if d["status"] == "broken"],
                            timeout=60, interval=0.1, what="/devices to show the broken device")
        assert "device-side assert triggered" in broken[0]["fault"]
        wait_until(lambda: "worker-cpu exited with code 3" in log_path.read_text(), timeout=60,
                   what="the broken worker to exit with status 3")
        first_progress = client.get(f"/jobs/{job_id}").json()["progress"]  # the broken delivery's last

        # Training again, on the fresh worker: its own progress, not the first delivery's.
        second_run = wait_until(lambda: (j := client.get(f"/jobs/{job_id}").json())["status"] == "running"
                                and j["attempts"] == 2 and j["progress"] != first_progress and j, timeout=180,
                                what="a fresh worker to resume the job")
        assert second_run["resumed_from_epoch"] is None or second_run["resumed_from_epoch"] >= 1
        redis_server = next(p for p in _descendants(up.pid) if "redis-server" in " ".join(p.cmdline()))
        redis_server.kill()
        killed = time.monotonic()
        wait_until(lambda: "embedded Redis restarted" in log_path.read_text(), timeout=60, what="Redis restarted")
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=60, what="the stack after Redis died")
        assert time.monotonic() - killed < 60

        done = wait_until(lambda: (j := client.get(f"/jobs/{job_id}").json())["status"] in ("succeeded", "failed")
                          and j, timeout=420, what="the job to end")
        assert done["status"] == "succeeded" and done["attempts"] == 2, done
        assert [m["epoch"] for m in done["metrics"]] == list(range(1, epochs + 1))
        with client.stream("GET", f"/jobs/{job_id}/events") as response:
            text = response.read().decode()
        assert "went out of service (CUDA error: device-side assert triggered)" in text
        assert text.count("event: metrics") == epochs
        wait_until(lambda: [(d["status"], d["fault"]) for d in client.get("/devices").json()["devices"]]
                   == [("idle", None)], timeout=10, what="the fresh worker idle, with no fault")

        up.send_signal(signal.SIGTERM)
        assert up.wait(90) == 0


def test_a_child_with_a_configuration_error_stops_up_instead_of_restarting(tmp_path) -> None:
    """A GPU asked for that this host does not have (97, hidden on any host): its worker exits 2 with why, once; `up` is not
    restarting it in a loop but stops everything and exits 2."""
    env = {**without_settings(), "TORCHYARD_DATA_DIR": str(tmp_path / "var"), "TORCHYARD_PORT": str(free_port()),
           "TORCHYARD_DEVICES": "97", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    up = subprocess.run(cli("up"), cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    said = up.stdout + up.stderr
    assert up.returncode == 2, said
    assert "no CUDA device is visible" in said
    assert "worker-gpu97 exited with code 2: it cannot run as configured" in said
    assert said.count("started worker-gpu97") == 1 and "restarting" not in said


def test_a_worker_sigkilled_mid_epoch_under_up_takes_its_job_back_and_finishes_it(tmp_path) -> None:
    """The fast takeover under `up` itself: the worker SIGKILLed inside an epoch is restarted by the
    supervisor, and the fresh process, seeing its predecessor's pid gone, requeues the job at once
    (its reason says the worker process died; a 120 s lease rules out the lease's sweep); the job
    resumes after its last recorded epoch and succeeds, each epoch recorded once. How fast is
    measured by bench/takeover.py (docs/benchmarks.md), not asserted here."""

    log_path = tmp_path / "up.log"
    settings = {"TORCHYARD_DEVICES": "cpu", "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5", "TORCHYARD_LEASE_TTL_S": "120"}
    epochs = 3
    with UpStack(tmp_path / "var", log_path, settings, start_timeout=120, client_timeout=30) as stack:
        up, client = stack.proc, stack.client
        assert up is not None
        job_id = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": epochs,
                                            "batch_size": 8, "patience": 0}).json()["id"]

        def inside_a_later_epoch() -> dict | None:
            job = client.get(f"/jobs/{job_id}").json()
            p = job["progress"]
            assert len(job["metrics"]) < epochs, "the job ended before the kill: a longer job"
            return job if job["status"] == "running" and job["metrics"] and 0 < p["step"] < p["steps"] else None

        before = wait_until(inside_a_later_epoch, timeout=300, interval=0.05, what="the job inside epoch 2 or later")
        worker = next(p for p in _descendants(up.pid) if "worker --device cpu" in " ".join(p.cmdline()))
        worker.kill()

        wait_until(lambda: any("worker --device cpu" in " ".join(p.cmdline()) and p.pid != worker.pid
                               for p in _descendants(up.pid)), timeout=60, what="the worker to be restarted")
        done = wait_until(lambda: (j := client.get(f"/jobs/{job_id}").json())["status"] in ("succeeded", "failed")
                          and j, timeout=420, what="the job to end")
        assert done["status"] == "succeeded" and done["attempts"] == 2, done
        assert done["resumed_from_epoch"] is not None and done["resumed_from_epoch"] >= len(before["metrics"]), done
        assert [m["epoch"] for m in done["metrics"]] == list(range(1, epochs + 1))
        events = job_events(client, job_id)
        reasons = [d.get("reason", "") for kind, d in events if kind == "status" and d.get("status") == "queued"]
        assert len(reasons) == 2 and reasons[1].startswith("its worker process (cpu@") \
            and reasons[1].endswith(") died"), reasons
        assert [kind for kind, _ in events].count("metrics") == epochs
        assert "restarting worker-cpu" in log_path.read_text()

        up.send_signal(signal.SIGTERM)
        assert up.wait(90) == 0
