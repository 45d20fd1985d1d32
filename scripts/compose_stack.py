"""The compose stack under test, as `scripts/compose_walk.py`'s drills reach it: its published API
port (with the key, as a user calls it), the docker and compose commands an operator would type,
the waits on what the stack does next, and the checks of a job's record and files that every drill
ends with. Kept apart from the drills so that each drill reads as its fault and its expectations.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx

TERMINAL = {"succeeded", "failed", "cancelled"}


class JobEndedEarly(Exception):
    """The job a fault was meant to land in finished first: waiting on is pointless."""


class StepFailed(Exception):
    pass


def check(condition: Any, message: str) -> None:
    if not condition:
        raise StepFailed(message)


class Stack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.compose_argv = [args.compose_bin, "-f", args.compose_file, "-p", args.project, "--profile", "cpu"]
        self.key = args.api_key
        self.node = args.node_name
        self.http = httpx.Client(base_url=args.url, headers={"Authorization": f"Bearer {args.api_key}"},
                                 timeout=60)

    # ---- docker
    def run(self, argv: list[str], timeout: float = 180) -> str:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise StepFailed(f"`{' '.join(argv)}` exited {proc.returncode}: {(proc.stdout + proc.stderr).strip()}")
        return proc.stdout.strip()

    def compose(self, *args: str, timeout: float = 180) -> str:
        return self.run([*self.compose_argv, *args], timeout=timeout)

    def container(self, service: str) -> str:
        cid = self.compose("ps", "-a", "-q", service)
        check(cid and len(cid.split()) == 1, f"expected one {service} container, got {cid!r}")
        return cid

    def inspect(self, cid: str, template: str) -> str:
        return self.run(["docker", "inspect", "-f", template, cid])

    # ---- HTTP
    def call(self, method: str, path: str, expect: int = 200, **kwargs: Any) -> httpx.Response:
        response = self.http.request(method, path, **kwargs)
        check(response.status_code == expect,
              f"{method} {path}: expected {expect}, got {response.status_code}: {response.text[:500]}")
        return response

    def job(self, job_id: str) -> dict:
        return self.call("GET", f"/jobs/{job_id}").json()

    def submit(self, **spec: Any) -> str:
        return self.call("POST", "/jobs", expect=202, json=spec).json()["id"]

    def events(self, job_id: str, until: Callable[[str, dict], bool] | None = None) -> list[tuple[str, str, dict]]:
        """A job's event stream as (stream id, event, data): to its end (a finished job's stream
        ends after the terminal status), or up to the first event for which `until` is true."""
        events, event_id, kind = [], "", "message"
        with self.http.stream("GET", f"/jobs/{job_id}/events", timeout=60) as response:
            check(response.status_code == 200, f"GET /jobs/{job_id}/events: {response.status_code}")
            for line in response.iter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    events.append((event_id, kind, json.loads(line[6:])))
                    if until and until(kind, events[-1][2]):
                        break
        return events

    def device(self) -> dict | None:
        devices = self.call("GET", "/devices").json()["devices"]
        return next((d for d in devices if d["id"] == f"{self.node}/cpu"), None)


def wait_for(what: str, probe: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (httpx.HTTPError, StepFailed) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise StepFailed(f"timed out after {timeout:.0f}s waiting for {what} (last seen: {last!r})")


def wait_terminal(stack: Stack, job_id: str, timeout: float = 420) -> dict:
    return wait_for(f"job {job_id} to finish", lambda: (j := stack.job(job_id))["status"] in TERMINAL and j,
                    timeout, interval=1)


def wait_mid_epoch(stack: Stack, job_id: str, min_epoch: int = 2) -> dict:
    """Running, at least `min_epoch`, and well inside the epoch: a fault here lands between two
    epoch checkpoints, never on one."""

    def probe() -> dict | bool:
        job = stack.job(job_id)
        if job["status"] not in ("queued", "running"):
            raise JobEndedEarly(f"job {job_id} ended before a fault could land inside epoch {min_epoch}: "
                                f"{job['status']} {job['error']}")
        p = job["progress"]
        inside = p["steps"] and p["steps"] * 0.1 <= p["step"] <= p["steps"] * 0.6
        return job if job["status"] == "running" and p["epoch"] >= min_epoch and inside else False

    return wait_for(f"job {job_id} to be inside epoch {min_epoch}", probe, timeout=240, interval=0.2)


def check_epochs(stack: Stack, job: dict, *, attempts: int) -> list[tuple[str, str, dict]]:
    """Succeeded after `attempts` deliveries, every epoch in `metrics` and in the event stream
    exactly once, one `running` event per delivery."""
    job_id, epochs = job["id"], job["params"]["epochs"]
    check(job["status"] == "succeeded", f"job {job_id}: {job['status']} ({job['error']})")
    check(job["attempts"] == attempts, f"job {job_id}: attempts {job['attempts']}, expected {attempts}")
    recorded = [m["epoch"] for m in job["metrics"]]
    check(recorded == list(range(1, epochs + 1)), f"job {job_id}: metrics for epochs {recorded}")
    events = stack.events(job_id)
    metric_epochs = [data["epoch"] for _, kind, data in events if kind == "metrics"]
    check(sorted(metric_epochs) == list(range(1, epochs + 1)),
          f"job {job_id}: epoch metrics events {metric_epochs}: an epoch was lost or recorded twice")
    running = [data for _, kind, data in events if kind == "status" and data.get("status") == "running"]
    check(len(running) == attempts, f"job {job_id}: {len(running)} `running` events for {attempts} deliveries")
    check(events[-1][1] == "status" and events[-1][2]["status"] == "succeeded", f"job {job_id}: last event {events[-1]}")
    return events


def check_checkpoint(stack: Stack, job: dict) -> str:
    response = stack.call("GET", f"/jobs/{job['id']}/checkpoint")
    digest = hashlib.sha256(response.content).hexdigest()
    check(digest == job["checkpoint"]["sha256"] == response.headers.get("x-checkpoint-sha256"),
          f"job {job['id']}: downloaded checkpoint sha256 {digest}, job says {job['checkpoint']['sha256']}")
    check(len(response.content) == job["checkpoint"]["bytes"], f"job {job['id']}: checkpoint size differs")
    return digest


def worker_back(stack: Stack, since: datetime | None = None) -> dict:
    """The cpu device idle in /devices, with a heartbeat later than `since` if given (a dead
    worker's last state stays listed as alive for up to TORCHYARD_HEARTBEAT_TTL_S)."""

    def probe() -> dict | bool:
        device = stack.device()
        if not device or device["status"] != "idle":
            return False
        return (since is None or datetime.fromisoformat(device["last_heartbeat"]) > since) and device

    return wait_for("the cpu worker to be idle in /devices", probe, timeout=120)


def started_at(stack: Stack, cid: str) -> datetime:
    """The container's last start (Docker prints nanoseconds; Python parses microseconds)."""
    raw = stack.inspect(cid, "{{.State.StartedAt}}")
    whole, _, fraction = raw.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{whole}.{(fraction + '000000')[:6]}+00:00")
