"""Chaos soak: jobs submitted through the HTTP API while the API, the workers and Redis are killed
and frozen at random; then every acknowledged job is checked.

    make chaos                                                  # the long pass (>= 200 jobs, >= 50 faults)
    .venv/bin/python scripts/chaos.py --jobs 6 --faults 7       # a short pass (make test runs one)

What runs, on loopback only, in a data dir of its own (a temporary one unless --data-dir):
`torchyard up` (its embedded Redis on a unix socket, the API on 127.0.0.1, a CPU worker on node
`chaos-a`), and a second worker "host" (`chaos-b`) on the same Redis and data dir, which this
script restarts when it dies (as compose's restart policy would). Jobs train cifar_net on a small
dataset this script uploads (a few seconds of CPU each); every --gang-every'th job is data-parallel
(`world_size` 2: one rank on each host, gloo over loopback; every other one of them `elastic`), so
faults land in gangs too.

The client submits jobs one after another, each with a fresh Idempotency-Key, and retries the
same key and body on any failure (connection refused or reset, timeout, 5xx) until it is
acknowledged (202, or 200 for a retry the server had already accepted), as a careful client
would; it keeps at most --in-flight of its jobs unfinished.

Faults, one at a time, drawn from a shuffled cycle of every kind (so a short pass sees each):
kill-api, freeze-api, kill-worker, freeze-worker, kill-redis, freeze-redis, device-fault
(SIGKILL; SIGSTOP for 1..--freeze-max s then SIGCONT; the worker's CPU twin of a sticky CUDA
error). The next fault waits until the stack is whole again (/readyz answers 200 and both
workers are serving); the time from the end of a fault to that is its recovery.
--long-redis-outage adds one 60 s freeze of Redis.

Then, for every acknowledged job: it succeeded; its metrics hold epochs 1..E once each and its
event stream has one `metrics` event per epoch and one terminal status (else it "ran twice");
the checkpoint downloaded through the API hashes to the recorded sha256; and every job the
server holds was acknowledged to the client (no job nobody was told of). Prints a table and
exits 1 on any loss, double run, mismatch or unannounced job (2 if the stack never came up).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from PIL import Image

from app.process import die_with_parent

REPO = Path(__file__).resolve().parent.parent
FAULT_KINDS = ("kill-api", "freeze-api", "kill-worker", "freeze-worker", "kill-redis", "freeze-redis",
               "device-fault")
TERMINAL = {"succeeded", "failed", "cancelled"}


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def dataset_zip(per_class: int, seed: int) -> bytes:
    """Two learnable classes of 32×32 images: warm noise and cool noise."""
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for label, tint in (("warm", (200, 90, 40)), ("cool", (40, 90, 200))):
            for k in range(per_class):
                noise = rng.normal(0, 40, (32, 32, 3))
                pixels = np.clip(np.array(tint) + noise, 0, 255).astype(np.uint8)
                out = io.BytesIO()
                Image.fromarray(pixels).save(out, format="PNG")
                archive.writestr(f"{label}/{k:03d}.png", out.getvalue())
    return buffer.getvalue()


@dataclass
class Submitted:
    key: str
    body: dict[str, Any]
    job_id: str | None = None
    acked_at: float = 0.0
    tries: int = 0


@dataclass
class Fault:
    kind: str
    target: str
    started: float
    ended: float = 0.0
    recovered: float | None = None
    gone: frozenset[int] = frozenset()  # worker processes that must have been replaced

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered is None else self.recovered - self.ended


@dataclass
class Report:
    acknowledged: int = 0
    succeeded: int = 0
    lost: list[str] = field(default_factory=list)
    ran_twice: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    unannounced: list[str] = field(default_factory=list)
    conflicting_keys: list[str] = field(default_factory=list)
    retried_requests: int = 0
    attempts_over_one: int = 0
    faults: Counter = field(default_factory=Counter)
    longest_recovery: dict[str, float] = field(default_factory=dict)
    unrecovered: int = 0
    recovery_stats: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    gangs_acknowledged: int = 0  # data-parallel jobs among the acknowledged
    gangs_succeeded: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.ran_twice or self.mismatched or self.unannounced or self.conflicting_keys
                    or self.unrecovered)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "acknowledged": self.acknowledged, "succeeded": self.succeeded, "lost": self.lost,
            "ran_twice": self.ran_twice, "checkpoint_mismatches": self.mismatched, "unannounced": self.unannounced,
            "conflicting_keys": self.conflicting_keys, "retried_requests": self.retried_requests,
            "attempts_over_one": self.attempts_over_one, "faults": dict(self.faults),
            "faults_total": sum(self.faults.values()), "longest_recovery_s": self.longest_recovery,
            "unrecovered_faults": self.unrecovered, "recovery": self.recovery_stats, "seconds": round(self.seconds, 1),
            "gangs_acknowledged": self.gangs_acknowledged, "gangs_succeeded": self.gangs_succeeded,
        }

    def table(self) -> str:
        recovery = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(self.longest_recovery.items())) or "-"
        rows = [
            ("jobs acknowledged", self.acknowledged), ("succeeded", self.succeeded), ("lost", len(self.lost)),
            ("of them data-parallel (2 ranks): acknowledged, succeeded", f"{self.gangs_acknowledged}, "
                                                                          f"{self.gangs_succeeded}"),
            ("run twice", len(self.ran_twice)), ("checkpoint mismatches", len(self.mismatched)),
            ("jobs nobody was told of", len(self.unannounced)),
            ("keys answered with two jobs", len(self.conflicting_keys)),
            ("client requests retried", self.retried_requests),
            ("jobs delivered more than once", self.attempts_over_one),
            ("re-sent deliveries (reconciler)", self.recovery_stats.get("resent_deliveries", 0)),
            ("expired leases redelivered", self.recovery_stats.get("expired_leases", 0)),
            ("files settled by a sweep", self.recovery_stats.get("files_settled_by_sweep", 0)),
            ("faults injected", f"{sum(self.faults.values())}: " +
             ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))),
            ("longest recovery (stack whole again)", recovery),
            ("faults not recovered from", self.unrecovered),
            ("wall time", f"{self.seconds:.0f} s"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"  {name:<{width}}  {value}" for name, value in rows]
        verdict = "PASSED: nothing lost, nothing ran twice" if self.ok else "FAILED"
        for name, ids in (("lost", self.lost), ("ran twice", self.ran_twice), ("mismatched", self.mismatched),
                          ("unannounced", self.unannounced), ("conflicting keys", self.conflicting_keys)):
            if ids:
                lines.append(f"  {name}: {', '.join(ids[:20])}")
        return "\n".join(["chaos soak", *lines, verdict])


class Stack:
    """`torchyard up` (Redis, API, worker chaos-a) and the second host's worker chaos-b."""

    def __init__(self, data_dir: Path, lease_ttl_s: float) -> None:
        from app.embedded_redis import EmbeddedRedis  # only to name the socket `up` will use

        self.data_dir = data_dir
        self.logs = data_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.redis_url = EmbeddedRedis(data_dir / "redis").url
        self.fault_files = {"chaos-a": data_dir / "fault-chaos-a", "chaos-b": data_dir / "fault-chaos-b"}
        base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
        self.env = {**base, "TORCHYARD_DATA_DIR": str(data_dir), "TORCHYARD_HOST": "127.0.0.1",
                    "TORCHYARD_PORT": str(self.port), "TORCHYARD_DEVICES": "cpu", "PYTHONUNBUFFERED": "1",
                    "TORCHYARD_HEARTBEAT_INTERVAL_S": "0.5", "TORCHYARD_HEARTBEAT_TTL_S": "3",
                    "TORCHYARD_LEASE_TTL_S": str(lease_ttl_s), "TORCHYARD_MAX_ATTEMPTS": "1000",
                    "TORCHYARD_ADVERTISE_ADDRESS": "127.0.0.1",  # a gang's rendezvous, on loopback too
                    "TORCHYARD_PREDICT_CPU_THREADS": "1"}
        self.up: subprocess.Popen | None = None
        self.worker_b: subprocess.Popen | None = None
        self.frozen: set[int] = set()
        # Every process of the stack is started by this one thread, which lives until `stop`: the
        # parent-death signal (app/process.die_with_parent) is armed for the *thread* that forks,
        # so a worker started by a thread that then ended (the fault loop, the soak's supervisor
        # once the faults stop) would get SIGTERM from the kernel while it starts.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="chaos-spawner")
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._restart = threading.Lock()  # the supervisor, the fault loop and the end of the run restart it

    def _spawn(self, argv: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen:
        def start() -> subprocess.Popen:
            return subprocess.Popen(argv, cwd=REPO, env=env, stdout=open(self.logs / log_name, "ab"),
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)

        return self._spawner.submit(start).result()

    def start(self) -> None:
        env = {**self.env, "TORCHYARD_NODE_NAME": "chaos-a", "TORCHYARD_DEVICE_FAULT_FILE": str(self.fault_files["chaos-a"])}
        self.up = self._spawn([sys.executable, "-m", "app.cli", "up"], env, "up.log")

    def start_worker_b(self) -> None:
        env = {**self.env, "TORCHYARD_NODE_NAME": "chaos-b", "TORCHYARD_REDIS_URL": self.redis_url,
               "TORCHYARD_DEVICE_FAULT_FILE": str(self.fault_files["chaos-b"])}
        self.worker_b = self._spawn([sys.executable, "-m", "app.cli", "worker", "--device", "cpu"], env,
                                    "worker-b.log")

    def supervise_worker_b(self) -> None:
        """The second host's supervisor, until the stack stops (not when the faults stop: the last
        fault's recovery may still need a restart)."""
        def watch() -> None:
            while not self._stopping.wait(1.0):
                self.keep_worker_b()

        self._supervisor = threading.Thread(target=watch, daemon=True, name="worker-b-supervisor")
        self._supervisor.start()

    def wait_for_redis(self, timeout: float) -> bool:
        import redis

        client = redis.Redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    if client.ping():
                        return True
                except (redis.RedisError, OSError):
                    time.sleep(0.2)
            return False
        finally:
            client.close()

    def keep_worker_b(self) -> None:
        """The second host's supervisor: start chaos-b again when it died."""
        with self._restart:
            if self.worker_b is not None and self.worker_b.poll() is not None:
                log(f"worker chaos-b exited with {self.worker_b.returncode}; restarting it")
                self.start_worker_b()

    def processes(self) -> dict[str, psutil.Process]:
        """The live targets: redis, api, worker-a (children of `up`), worker-b."""
        found: dict[str, psutil.Process] = {}
        if self.up is not None and self.up.poll() is None:
            for child in psutil.Process(self.up.pid).children():
                try:
                    line = " ".join(child.cmdline())
                except psutil.Error:
                    continue
                if "redis-server" in line:
                    found["redis"] = child
                elif " api" in line:
                    found["api"] = child
                elif " worker" in line:
                    found["worker-a"] = child
        if self.worker_b is not None and self.worker_b.poll() is None:
            found["worker-b"] = psutil.Process(self.worker_b.pid)
        return found

    def signal(self, proc: psutil.Process, sig: int) -> None:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            return
        if sig == signal.SIGSTOP:
            self.frozen.add(proc.pid)
        elif sig == signal.SIGCONT:
            self.frozen.discard(proc.pid)

    def thaw_all(self) -> None:
        for pid in list(self.frozen):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.frozen.clear()

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        self.thaw_all()
        for proc in (self.worker_b, self.up):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.worker_b, self.up):
            if proc is None:
                continue
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._spawner.shutdown()


class Chaos:
    def __init__(self, args: argparse.Namespace, stack: Stack) -> None:
        self.args = args
        self.stack = stack
        self.rng = random.Random(args.seed)
        self.client = httpx.Client(base_url=stack.base_url, timeout=args.request_timeout)
        self.submitted: list[Submitted] = []
        self.faults: list[Fault] = []
        self.stop_event = threading.Event()
        self.retried = 0
        self.dataset = ""
        self.finished: set[str] = set()

    # ------------------------------------------------------------------ client side
    def ready(self, both_workers: bool = True, gone: frozenset[int] = frozenset()) -> bool:
        """The whole stack is back: the API answers /readyz and both workers are serving, from
        processes other than those in `gone` (a killed or broken worker's last heartbeat lingers)."""
        try:
            if self.client.get("/readyz", timeout=3).status_code != 200:
                return False
            if not both_workers:
                return True
            devices = self.client.get("/devices", timeout=3).json()["devices"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        serving = {d["id"] for d in devices if d["status"] in ("idle", "busy") and d.get("pid") not in gone}
        return {"chaos-a/cpu", "chaos-b/cpu"} <= serving

    def wait_ready(self, timeout: float, both_workers: bool = True, gone: frozenset[int] = frozenset()) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready(both_workers, gone):
                return time.monotonic()
            time.sleep(0.2)
        return None

    def upload_dataset(self) -> None:
        body = dataset_zip(self.args.images_per_class, self.args.seed)
        while True:
            try:
                answer = self.client.post("/datasets", data={"name": "chaos"},
                                          files={"file": ("chaos.zip", body, "application/zip")})
                if answer.status_code == 201:
                    self.dataset = answer.json()["id"]
                    return
                log(f"dataset upload answered {answer.status_code}: {answer.text[:200]}")
            except httpx.HTTPError as exc:
                log(f"dataset upload failed ({exc!r}); retrying")
            time.sleep(1)

    def submit(self, index: int) -> Submitted:
        """POST /jobs with one Idempotency-Key until acknowledged; every failure is retried as is."""
        item = Submitted(key=f"chaos-{uuid.uuid4()}", body={
            "model": "cifar_net", "dataset": self.dataset, "epochs": self.args.epochs, "batch_size": 16,
            "patience": 0,  # every epoch runs, so "each epoch recorded once" is checked on all of them
            "seed": index, "val_fraction": 0.2})
        every = self.args.gang_every
        if every and index % every == every - 1:
            item.body.update(world_size=2, elastic=(index // every) % 2 == 1)
        self.submitted.append(item)
        pause = 0.2
        while not self.stop_event.is_set():
            item.tries += 1
            try:
                answer = self.client.post("/jobs", json=item.body, headers={"Idempotency-Key": item.key})
            except httpx.HTTPError:
                answer = None
            if answer is not None and answer.status_code in (200, 202):
                job_id = answer.json()["id"]
                if item.job_id is not None and item.job_id != job_id:
                    raise AssertionError(f"key {item.key} answered with jobs {item.job_id} and {job_id}")
                item.job_id, item.acked_at = job_id, time.monotonic()
                return item
            if answer is not None and answer.status_code < 500:
                raise AssertionError(f"POST /jobs answered {answer.status_code}: {answer.text[:300]}")
            self.retried += 1
            time.sleep(pause)
            pause = min(pause * 2, 2.0)
        return item

    def unfinished(self) -> int:
        count = 0
        for item in self.submitted:
            if item.job_id is None or item.job_id in self.finished:
                continue
            try:
                if self.client.get(f"/jobs/{item.job_id}", timeout=5).json()["status"] in TERMINAL:
                    self.finished.add(item.job_id)
                    continue
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            count += 1
        return count

    def submitter(self) -> None:
        index = 0
        while not self.stop_event.is_set():
            if self.unfinished() >= self.args.in_flight:
                time.sleep(0.5)
                continue
            self.submit(index)
            index += 1

    # ------------------------------------------------------------------ faults
    def inject(self, kind: str) -> Fault | None:
        procs = self.stack.processes()
        if kind in ("kill-worker", "freeze-worker", "device-fault"):
            names = ["worker-a", "worker-b"]
        elif kind == "long-redis-outage":
            names = ["redis"]
        else:
            names = [kind.split("-", 1)[1]]  # api or redis
        targets = [name for name in names if name in procs]
        if not targets:
            return None
        target = self.rng.choice(targets)
        fault = Fault(kind, target, time.monotonic())
        if kind in ("kill-worker", "device-fault"):
            fault.gone = frozenset({procs[target].pid})
        if kind == "device-fault":
            node = "chaos-a" if target == "worker-a" else "chaos-b"
            armed = self.stack.fault_files[node]
            armed.write_text("CUDA error: an illegal memory access was encountered")
            # It fires at that worker's next training step; the fault is over when it has fired.
            deadline = time.monotonic() + self.args.recovery_timeout
            while armed.exists() and time.monotonic() < deadline and not self.stop_event.is_set():
                time.sleep(0.1)
            if armed.exists():
                armed.unlink(missing_ok=True)
                fault.gone = frozenset()
                log("  the device fault never fired (no job reached that worker); disarmed")
        elif kind.startswith("kill"):
            self.stack.signal(procs[target], signal.SIGKILL)
        else:
            seconds = 60.0 if kind == "long-redis-outage" else self.rng.uniform(1.0, self.args.freeze_max)
            self.stack.signal(procs[target], signal.SIGSTOP)
            log(f"  {target} frozen for {seconds:.1f} s")
            self.stop_event.wait(seconds)
            self.stack.signal(procs[target], signal.SIGCONT)
        fault.ended = time.monotonic()
        return fault

    def fault_loop(self) -> None:
        cycle: list[str] = []
        pending_long = self.args.long_redis_outage
        while not self.stop_event.is_set():
            if self.stop_event.wait(self.rng.uniform(self.args.gap_min, self.args.gap_max)):
                return
            if not cycle:
                cycle = list(self.args.kinds)
                self.rng.shuffle(cycle)
            kind = cycle.pop()
            if pending_long and len(self.faults) >= 3:
                kind, pending_long = "long-redis-outage", False
            log(f"fault #{len(self.faults) + 1}: {kind}")
            fault = self.inject(kind)
            if fault is None:  # its target is restarting: try this kind again after the others
                cycle.insert(0, kind)
                continue
            if kind == "kill-worker" and fault.target == "worker-b":
                time.sleep(1.0)
                self.stack.keep_worker_b()
            self.faults.append(fault)
            fault.recovered = self.wait_ready(self.args.recovery_timeout, gone=fault.gone)
            if fault.recovered is None:
                log(f"  not ready {self.args.recovery_timeout:.0f} s after {kind} on {fault.target}")
            else:
                log(f"  recovered in {fault.recovery_s:.1f} s")

    # ------------------------------------------------------------------ the run
    def run(self) -> Report:
        started = time.monotonic()
        self.upload_dataset()
        threads = [threading.Thread(target=self.submitter, daemon=True, name="submitter"),
                   threading.Thread(target=self.fault_loop, daemon=True, name="faults")]
        for thread in threads:
            thread.start()
        while time.monotonic() - started < self.args.max_seconds:
            acked = sum(1 for s in self.submitted if s.job_id)
            if acked >= self.args.jobs and len(self.faults) >= self.args.faults:
                break
            time.sleep(1)
        log(f"stopping: {sum(1 for s in self.submitted if s.job_id)} jobs acknowledged, {len(self.faults)} faults")
        self.stop_event.set()
        for thread in threads:
            thread.join(timeout=120)
        self.stack.thaw_all()
        self.stack.keep_worker_b()
        self.wait_ready(self.args.recovery_timeout)
        report = self.check(drain_deadline=time.monotonic() + self.args.drain_seconds)
        report.seconds = time.monotonic() - started
        return report

    def check(self, drain_deadline: float) -> Report:
        report = Report(retried_requests=self.retried)
        acked = [s for s in self.submitted if s.job_id]
        report.acknowledged = len(acked)
        report.gangs_acknowledged = sum(s.body.get("world_size", 1) > 1 for s in acked)
        jobs: dict[str, dict] = {}
        for item in acked:
            assert item.job_id is not None
            job = self._final(item.job_id, drain_deadline)
            jobs[item.job_id] = job or {}
        by_id: dict[str, list[str]] = {}
        for item in acked:
            assert item.job_id is not None
            by_id.setdefault(item.job_id, []).append(item.key)
        report.conflicting_keys = [job_id for job_id, k in by_id.items() if len(k) > 1]
        for job_id, job in jobs.items():
            if job.get("status") != "succeeded":
                report.lost.append(job_id)
                log(f"  lost {job_id}: {job.get('status')} {job.get('error') or job.get('message')}")
                continue
            report.succeeded += 1
            report.gangs_succeeded += job.get("world_size", 1) > 1
            report.attempts_over_one += job["attempts"] > 1
            if not self._ran_once(job_id, job):
                report.ran_twice.append(job_id)
            if not self._checkpoint_matches(job_id, job):
                report.mismatched.append(job_id)
        report.unannounced = [job_id for job_id in self._all_job_ids() if job_id not in jobs]
        report.faults = Counter(f.kind for f in self.faults)
        for fault in self.faults:
            if fault.recovery_s is None:
                report.unrecovered += 1
            else:
                report.longest_recovery[fault.kind] = max(report.longest_recovery.get(fault.kind, 0.0),
                                                          fault.recovery_s)
        report.recovery_stats = self._recovery_stats()
        return report

    def _get(self, path: str, **kw: Any) -> httpx.Response:
        for _ in range(60):
            try:
                answer = self.client.get(path, **kw)
                if answer.status_code < 500:
                    return answer
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"GET {path} kept failing")

    def _final(self, job_id: str, deadline: float) -> dict | None:
        while True:
            job = self._get(f"/jobs/{job_id}").json()
            if job.get("status") in TERMINAL or time.monotonic() > deadline:
                return job
            time.sleep(0.5)

    def _ran_once(self, job_id: str, job: dict) -> bool:
        epochs = [m["epoch"] for m in job["metrics"]]
        expected = list(range(1, self.args.epochs + 1))
        events: list[tuple[str, dict]] = []
        with self.client.stream("GET", f"/jobs/{job_id}/events", timeout=60) as response:
            current: dict[str, str] = {}
            for line in response.iter_lines():
                if not line:
                    if "event" in current and "data" in current:
                        events.append((current["event"], json.loads(current["data"])))
                    current = {}
                    continue
                key, _, value = line.partition(": ")
                current[key] = value
        per_epoch = Counter(data["epoch"] for kind, data in events if kind == "metrics")
        terminal = [data for kind, data in events if kind == "status" and data.get("status") in TERMINAL]
        once = epochs == expected and sorted(per_epoch) == expected and set(per_epoch.values()) == {1} \
            and len(terminal) == 1
        if not once:
            log(f"  {job_id} ran twice? metrics {epochs}, metrics events {dict(per_epoch)}, terminal {terminal}")
        return once

    def _checkpoint_matches(self, job_id: str, job: dict) -> bool:
        answer = self._get(f"/jobs/{job_id}/checkpoint")
        digest = hashlib.sha256(answer.content).hexdigest()
        recorded = (job.get("checkpoint") or {}).get("sha256")
        ok = answer.status_code == 200 and digest == recorded == answer.headers.get("X-Checkpoint-SHA256")
        if not ok:
            log(f"  {job_id}: checkpoint {answer.status_code} sha256 {digest} != recorded {recorded}")
        return ok

    def _all_job_ids(self) -> list[str]:
        ids: list[str] = []
        cursor = None
        while True:
            page = self._get("/jobs", params={"limit": 500, **({"cursor": cursor} if cursor else {})}).json()
            ids += [j["id"] for j in page["jobs"]]
            cursor = page.get("next_cursor")
            if not cursor:
                return ids

    def _recovery_stats(self) -> dict[str, int]:
        import redis

        client = redis.Redis.from_url(self.stack.redis_url, decode_responses=True)
        try:
            return {k: int(v) for k, v in client.hgetall("ty:recovery").items()}
        finally:
            client.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200, help="acknowledged jobs to reach (default 200)")
    parser.add_argument("--faults", type=int, default=50, help="faults to inject (default 50)")
    parser.add_argument("--max-seconds", type=float, default=3600, help="stop submitting and injecting after this")
    parser.add_argument("--drain-seconds", type=float, default=600, help="then wait this long for jobs to end")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--images-per-class", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=4, help="unfinished jobs the client keeps at most")
    parser.add_argument("--gang-every", type=int, default=3,
                        help="every Nth job trains on both workers at once (world_size 2); 0: none")
    parser.add_argument("--gap-min", type=float, default=1.0, help="seconds between a recovery and the next fault")
    parser.add_argument("--gap-max", type=float, default=5.0)
    parser.add_argument("--freeze-max", type=float, default=8.0, help="longest SIGSTOP, seconds")
    parser.add_argument("--kinds", default=",".join(FAULT_KINDS),
                        help=f"comma-separated fault kinds to draw from (default: all of {', '.join(FAULT_KINDS)})")
    parser.add_argument("--long-redis-outage", action="store_true", help="also freeze Redis once for 60 s")
    parser.add_argument("--lease-ttl", type=float, default=3.0)
    parser.add_argument("--recovery-timeout", type=float, default=120.0)
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--data-dir", type=Path, default=None, help="default: a temporary directory, removed after")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    args.kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = set(args.kinds) - set(FAULT_KINDS)
    if unknown or not args.kinds:
        parser.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(FAULT_KINDS)}")
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    return args


def _stop_on_sigterm(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # stop the stack we started, then exit
    own_dir = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="torchyard-chaos-")) if own_dir else args.data_dir
    log(f"seed {args.seed}; data dir {data_dir}; targets: {args.jobs} jobs, {args.faults} faults, "
        f"at most {args.max_seconds:.0f} s")
    stack = Stack(data_dir, args.lease_ttl)
    chaos = Chaos(args, stack)
    try:
        stack.start()
        if stack.wait_for_redis(60):  # the second host starts as soon as there is a Redis to join
            stack.start_worker_b()
            stack.supervise_worker_b()
        if chaos.wait_ready(240) is None:
            log("the stack did not become ready; see the logs in " + str(stack.logs))
            return 2
        report = chaos.run()
    finally:
        stack.stop()
        chaos.client.close()
    print(report.table(), flush=True)
    if args.json:
        args.json.write_text(json.dumps({**report.as_dict(), "seed": args.seed}, indent=2))
    if own_dir and report.ok:
        shutil.rmtree(data_dir, ignore_errors=True)
    elif not report.ok:
        log(f"logs kept in {stack.logs}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
