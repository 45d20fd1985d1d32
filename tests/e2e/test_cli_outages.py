"""`torchyard train` outlives what its job outlives: a real CLI process follows a real job
while the test SIGKILLs the Redis server, then the API; the CLI says once per outage that it
waits, reconnects, and exits 0 when the job succeeds. The worker's log tells a Redis outage in
one line when it starts and one when it ends, without a traceback.

The job waits in its queue while the outages happen (its worker is SIGSTOPped), so the test does
not depend on how fast this host trains: the follower is what is under test (a job paused by a
Redis outage mid-step is test_faults_cluster.py's)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from app.embedded_redis import EmbeddedRedis
from tests.e2e.test_cli import CLI, cli_env
from tests.support import REPO, Processes, free_port, wait_until

pytestmark = pytest.mark.e2e


def _outage(server: EmbeddedRedis, seconds: float = 2.0) -> None:
    """redis-server SIGKILLed, then started again on the same files."""
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    time.sleep(seconds)
    server.start()


def test_train_follows_its_job_through_a_redis_outage_and_an_api_restart(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    procs = Processes(url, tmp_path / "data", tmp_path / "logs")
    port = free_port()
    worker = procs.worker("cpu")
    api = procs.api(port)
    base = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=base, timeout=30)
    follower = None
    try:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=120, what="API and worker")
        # An idle worker through a Redis outage: its log says so once, and once when it is over.
        _outage(server)
        wait_until(lambda: "Redis answers again" in procs.log(worker), timeout=120, what="the worker to reconnect")
        worker_log = procs.log(worker).splitlines()

        worker.send_signal(signal.SIGSTOP)  # the job waits in its queue until the end of the test
        said: list[str] = []
        follower = subprocess.Popen([*CLI, "train", "--model", "cifar_net", "--dataset", "fake", "--epochs", "1"],
                                    cwd=REPO, env=cli_env(TORCHYARD_URL=base), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reader = threading.Thread(target=lambda: said.extend(follower.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        wait_until(lambda: any(line.strip() == "queued" for line in said), timeout=60, what="the CLI to follow")
        job_id = said[0].split()[1]

        _outage(server)
        wait_until(lambda: any("answers again" in line for line in said), timeout=60, what="the CLI to reconnect")
        assert sum("waiting for the server" in line for line in said) == 1, said
        assert any("resumes where it left off when the server is back" in line for line in said), said

        procs.stop(api, signal.SIGKILL)
        wait_until(lambda: sum("waiting for the server" in line for line in said) == 2, timeout=30,
                   what="the CLI to say it waits again")
        api = procs.api(port)
        wait_until(lambda: sum("answers again" in line for line in said) == 2, timeout=60,
                   what="the CLI to reconnect to the new API")
        assert follower.poll() is None

        worker.send_signal(signal.SIGCONT)
        assert follower.wait(300) == 0, "".join(said)
        reader.join(10)
        stdout = follower.stdout.read()  # type: ignore[union-attr]
        assert "succeeded" in stdout and "train_loss" in stdout
        assert client.get(f"/jobs/{job_id}").json()["status"] == "succeeded"
        # One line when each outage started and one when it ended; the epoch's line once.
        assert sum("waiting for the server" in line for line in said) == 2, said
        assert sum("answers again" in line for line in said) == 2, said
        assert [line.split(":")[0] for line in said if line.startswith("epoch ")] == ["epoch 1/1"], said

        assert not [line for line in worker_log if "Traceback" in line or "DeprecationWarning" in line], worker_log

        def lines(*words: str) -> list[str]:
            return [line for line in worker_log if all(word in line for word in words)]

        assert len(lines("worker cpu@", "Redis is unavailable")) == 1, worker_log  # its heartbeat
        assert len(lines("worker cpu@", "Redis answers again")) == 1, worker_log
        assert len(lines("Redis unavailable")) + len(lines("Redis is unavailable")) <= 3, worker_log
        assert "Traceback" not in procs.log(api) and "Traceback" not in procs.log(worker)
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
        if worker.poll() is None:
            worker.send_signal(signal.SIGCONT)
        client.close()
        procs.stop_all()
        server.stop()
