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
stack's logs. A JSON summary (timings, attempts, requeue latency) goes to --summary. How the stack
is reached, waited on and checked is scripts/compose_stack.py's.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import time
import zipfile
from typing import Any

import httpx
from compose_stack import (
    JobEndedEarly,
    Stack,
    StepFailed,
    check,
    check_checkpoint,
    check_epochs,
    started_at,
    wait_for,
    wait_mid_epoch,
    wait_terminal,
    worker_back,
)
from PIL import Image, ImageDraw

CLASSES = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 230)}
# cifar_net on the built-in `fake` dataset at batch size 1: long enough to land a fault in the middle
# of an epoch, short enough for the whole run. Sized by the per-step cost, which dominates at tiny
# batches and differs between hosts by several times: at batch size 4 a fast host's epoch could end
# inside the trainer's progress interval plus the probe's poll, so no mid-epoch progress was ever
# seen; batch size 1 makes an epoch about three times longer (docs/benchmarks.md has the epochs).
FAULT_JOB = {"model": "cifar_net", "dataset": "fake", "epochs": 3, "batch_size": 1, "seed": 7}


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
