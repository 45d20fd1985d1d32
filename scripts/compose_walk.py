"""The HTTP walk and fault drills of `make compose-test`, against a running compose stack.

scripts/compose-test.sh starts `redis`, `api` and `worker-cpu` from the real docker-compose.yml
(its own project name, a free host port, an API key) and then runs this. Everything goes
through the published API port with `Authorization: Bearer <key>`, the way a user talks to the
service; the faults are made with the same docker/compose commands an operator would type:

  walk          upload a generated ImageFolder zip of PNGs, train cifar_net on it, download the
                checkpoint (sha256 checked), predict, read /devices
  redis         `docker compose restart redis` while a job trains: the job still succeeds, every
                epoch recorded once; the dataset and the finished job are still there
  kill          `docker kill` the worker container mid-epoch; Docker's restart policy or
                `docker compose start` brings it back; the job resumes from its last finished
                epoch (attempts 2, no epoch lost or repeated, checkpoint sha256 matches)
  crash         the worker process dies inside its container (SIGKILL from inside): the
                container ends and `restart: unless-stopped` starts it again by itself
  stop          `docker stop` the worker mid-job: it checkpoints and requeues the job well inside
                the grace period (stop_grace_period), exits 0, and the job finishes after
                `docker compose start`

Each drill raises StepFailed with what was expected and what was seen; the caller prints the
stack's logs. A JSON summary (timings, attempts, requeue latency) goes to --summary.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
from PIL import Image, ImageDraw

CLASSES = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 230)}
TERMINAL = {"succeeded", "failed", "cancelled"}
# cifar_net on the built-in `fake` dataset at batch size 1: long enough to land a fault in the middle
# of an epoch, short enough for the whole run. Sized by the per-step cost, which dominates at tiny
# batches: at batch size 4 an epoch took ~3 s on this 2-core host one afternoon and 0.76 s on a
# faster one later the same day, under the trainer's 0.5 s progress interval plus the probe's poll,
# so no mid-epoch progress was ever seen; batch size 1 makes it about three times longer.
FAULT_JOB = {"model": "cifar_net", "dataset": "fake", "epochs": 3, "batch_size": 1, "seed": 7}


class JobEndedEarly(Exception):
    """The job a fault was meant to land in finished first: waiting on is pointless."""


class StepFailed(Exception):
    pass


def check(condition: Any, message: str) -> None:
    if not condition:
        raise StepFailed(message)


# --------------------------------------------------------------------------------------------
# data


def png(colour: tuple[int, int, int], rng: random.Random, size: int = 32) -> bytes:
    """A noisy background with a disc of the class colour at a random place."""
    image = Image.new("RGB", (size, size))
    image.putdata([tuple(rng.randrange(0, 60) for _ in range(3)) for _ in range(size * size)])
    draw = ImageDraw.Draw(image)
    r = rng.randrange(size // 4, size // 2 - 1)
    cx, cy = rng.randrange(r, size - r), rng.randrange(r, size - r)
    shade = tuple(max(0, min(255, c + rng.randrange(-20, 21))) for c in colour)
    draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=shade)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def imagefolder_zip(per_class: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for label, colour in CLASSES.items():
            for k in range(per_class):
                archive.writestr(f"colours/{label}/{k:03d}.png", png(colour, rng))
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------
# the stack: HTTP and docker


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


# --------------------------------------------------------------------------------------------
# the drills


def walk(stack: Stack, out: dict) -> None:
    check(httpx.get(f"{stack.http.base_url}/devices", timeout=30).status_code == 401,
          "GET /devices without the key was not refused: TORCHYARD_API_KEY did not reach the api")
    check(httpx.get(f"{stack.http.base_url}/healthz", timeout=30).status_code == 200, "/healthz without the key")
    wait_for("/readyz", lambda: stack.http.get("/readyz").status_code == 200, timeout=120)
    device = worker_back(stack)
    check(device["type"] == "cpu" and device["worker"] == f"cpu@{stack.node}",
          f"unexpected cpu device in /devices: {device}")

    per_class = 24
    upload = stack.call("POST", "/datasets", expect=201, data={"name": "compose-test"},
                        files={"file": ("colours.zip", imagefolder_zip(per_class), "application/zip")}).json()
    check(upload["classes"] == sorted(CLASSES) and upload["num_images"] == per_class * len(CLASSES)
          and not upload["skipped"], f"dataset upload: {upload}")

    job_id = stack.submit(model="cifar_net", dataset=upload["id"], epochs=4, batch_size=8, seed=1)
    job = wait_terminal(stack, job_id)
    check_epochs(stack, job, attempts=1)
    check_checkpoint(stack, job)

    rng = random.Random(99)
    files = [("file", (f"{label}.png", png(colour, rng), "image/png")) for label, colour in CLASSES.items()]
    answer = stack.call("POST", "/predict", data={"job_id": job_id, "top_k": "3"}, files=files).json()
    predicted = {r["filename"]: r["predictions"][0]["label"] for r in answer["results"]}
    check(len(answer["results"]) == len(CLASSES), f"/predict: {answer}")
    for result in answer["results"]:
        probabilities = [p["probability"] for p in result["predictions"]]
        check(probabilities == sorted(probabilities, reverse=True) and {p["label"] for p in result["predictions"]}
              <= set(CLASSES), f"/predict: {result}")
    correct = sum(predicted.get(f"{label}.png") == label for label in CLASSES)
    check(correct >= 2, f"/predict on one clear image per class got {predicted}: the model learned nothing")
    # The worker's next heartbeat (every second) lists the model it now keeps resident.
    device = wait_for(f"/devices to list {job_id} as loaded on the cpu worker",
                      lambda: (d := stack.device()) and job_id in d["loaded_models"] and d, timeout=15)
    out["walk"] = {"dataset": upload["id"], "job": job_id, "predicted": predicted}
    print(f"  dataset {upload['id']} ({upload['num_images']} PNGs), job {job_id} succeeded, "
          f"checkpoint sha256 ok, predicted {predicted}, /devices: {device['id']} {device['status']}")


def redis_restart(stack: Stack, out: dict) -> None:
    job_id = stack.submit(**FAULT_JOB)
    wait_mid_epoch(stack, job_id)
    t0 = time.monotonic()
    stack.compose("restart", "redis")
    restart_s = time.monotonic() - t0
    job = wait_terminal(stack, job_id)
    # A Redis restart mid-job either passes unnoticed by the training loop or (the worker's Redis
    # calls exhaust their retries) ends that delivery; its lease then lapses and the job is
    # redelivered and resumes. Both keep every epoch; anything more than one redelivery is a bug.
    check(job["attempts"] in (1, 2), f"job {job_id}: {job['attempts']} deliveries for one Redis restart")
    check_epochs(stack, job, attempts=job["attempts"])
    walk_job = stack.job(out["walk"]["job"])
    check(walk_job["status"] == "succeeded" and walk_job["checkpoint"], f"after the restart: {walk_job}")
    stack.call("GET", f"/datasets/{out['walk']['dataset']}")
    worker_back(stack)
    out["redis"] = {"job": job_id, "restart_s": round(restart_s, 1), "attempts": job["attempts"]}
    how = ("rode through it" if job["attempts"] == 1 else
           f"was redelivered once its lease lapsed and resumed after epoch {job['resumed_from_epoch']}")
    print(f"  redis restarted in {restart_s:.1f}s mid-job; job {job_id} {how}; succeeded, attempts "
          f"{job['attempts']}, each epoch recorded once; earlier dataset and job still there")


def worker_kill(stack: Stack, out: dict) -> None:
    job_id = stack.submit(**FAULT_JOB)
    at = wait_mid_epoch(stack, job_id)["progress"]
    cid = stack.container("worker-cpu")
    restarts = int(stack.inspect(cid, "{{.RestartCount}}"))
    stack.run(["docker", "kill", cid])
    t0 = time.monotonic()
    # Docker counts `docker kill` as a manual stop, and a manually stopped container is not
    # restarted by its policy (Docker's documented rule); an operator then starts it again.
    restarted = False
    try:
        restarted = bool(wait_for("Docker's restart policy", lambda: int(stack.inspect(cid, "{{.RestartCount}}"))
                                  > restarts, timeout=8))
    except StepFailed:
        stack.compose("start", "worker-cpu")
    job = wait_terminal(stack, job_id)
    check_epochs(stack, job, attempts=2)
    check(job["resumed_from_epoch"] == at["epoch"] - 1,
          f"job {job_id} killed in epoch {at['epoch']} resumed after epoch {job['resumed_from_epoch']}")
    digest = check_checkpoint(stack, job)
    out["kill"] = {"job": job_id, "killed_in_epoch": at["epoch"], "restart_policy": restarted,
                   "recovered_s": round(time.monotonic() - t0, 1), "sha256": digest}
    print(f"  killed in epoch {at['epoch']} (step {at['step']}/{at['steps']}); back by "
          f"{'the restart policy' if restarted else 'docker compose start'}; resumed after epoch "
          f"{job['resumed_from_epoch']}, attempts 2, no epoch lost or repeated, checkpoint sha256 ok")


def worker_crash(stack: Stack, out: dict) -> None:
    cid = stack.container("worker-cpu")
    before = int(stack.inspect(cid, "{{.RestartCount}}"))
    pid = worker_back(stack)["pid"]  # the worker's pid inside its container (PID 1 is docker-init)
    t0 = time.monotonic()
    stack.run(["docker", "exec", "-u", "0", cid, "sh", "-c", f"kill -KILL {int(pid)}"])
    wait_for("the restart policy to start the worker container again",
             lambda: int(stack.inspect(cid, "{{.RestartCount}}")) > before
             and stack.inspect(cid, "{{.State.Running}}") == "true", timeout=60)
    worker_back(stack, since=started_at(stack, cid))
    out["crash"] = {"back_s": round(time.monotonic() - t0, 1)}
    print(f"  worker process SIGKILLed inside its container: restarted by the policy, idle in /devices "
          f"after {out['crash']['back_s']}s")


def worker_stop(stack: Stack, out: dict) -> None:
    job_id = stack.submit(**FAULT_JOB)
    at = wait_mid_epoch(stack, job_id)["progress"]
    cid = stack.container("worker-cpu")
    grace = int(stack.inspect(cid, "{{.Config.StopTimeout}}"))
    issued_ms = time.time() * 1000
    t0 = time.monotonic()
    stack.run(["docker", "stop", cid], timeout=grace + 30)  # no -t: the container's own grace period
    stop_s = time.monotonic() - t0
    exit_code = int(stack.inspect(cid, "{{.State.ExitCode}}"))
    check(exit_code == 0, f"the stopped worker exited {exit_code}, not 0: it did not shut down cleanly")
    queued = stack.job(job_id)
    check(queued["status"] == "queued" and "shut down" in (queued["message"] or ""),
          f"after `docker stop` job {job_id} is {queued['status']}: {queued['message']}")
    requeue = stack.events(job_id, until=lambda kind, data: kind == "status" and data["status"] == "queued"
                           and "reason" in data)[-1]
    check("shut down" in requeue[2].get("reason", ""), f"job {job_id}: requeue event {requeue}")
    stack.compose("start", "worker-cpu")
    job = wait_terminal(stack, job_id)
    check_epochs(stack, job, attempts=2)
    check(job["resumed_from_epoch"] == at["epoch"] - 1,
          f"job {job_id} stopped in epoch {at['epoch']} resumed after epoch {job['resumed_from_epoch']}")
    # Redis stream ids are the server's millisecond clock (Redis runs on this host's kernel).
    requeue_ms = int(requeue[0].split("-")[0]) - issued_ms
    check(requeue_ms < grace * 1000, f"requeued {requeue_ms:.0f} ms after `docker stop`, grace is {grace}s")
    out["stop"] = {"job": job_id, "grace_s": grace, "stop_s": round(stop_s, 2), "requeue_ms": round(requeue_ms),
                   "exit_code": exit_code}
    print(f"  `docker stop` in epoch {at['epoch']}: job requeued {requeue_ms:.0f} ms after the stop "
          f"(grace {grace}s), container exited 0 after {stop_s:.1f}s; resumed after epoch "
          f"{job['resumed_from_epoch']} and succeeded (attempts 2)")


DRILLS = {"walk": walk, "redis": redis_restart, "kill": worker_kill, "crash": worker_crash, "stop": worker_stop}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--node-name", required=True)
    parser.add_argument("--compose-bin", required=True)
    parser.add_argument("--compose-file", required=True)
    parser.add_argument("--project", required=True)
    parser.add_argument("--summary", required=True, help="write the JSON summary here")
    parser.add_argument("drills", nargs="*", help=f"some of {', '.join(DRILLS)} (default: all, in this order)")
    args = parser.parse_args()
    unknown = set(args.drills) - set(DRILLS)
    if unknown:
        parser.error(f"unknown drills {sorted(unknown)}: choose from {', '.join(DRILLS)}")
    stack = Stack(args)
    out: dict[str, Any] = {"timings": {}}
    try:
        for name in args.drills or list(DRILLS):
            print(f"--- {name}", flush=True)
            t0 = time.monotonic()
            DRILLS[name](stack, out)
            out["timings"][name] = round(time.monotonic() - t0, 1)
            print(f"  ok ({out['timings'][name]}s)", flush=True)
    except (StepFailed, JobEndedEarly) as exc:
        print(f"\nFAILED in `{name}`: {exc}", file=sys.stderr)
        out["failed"] = {"drill": name, "error": str(exc)}
        return 1
    finally:
        with open(args.summary, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
