"""Takeover after a crash under `torchyard up`: SIGKILL the worker mid-epoch and time
how long its job takes to run again on the worker `up` restarts.

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/takeover.py [--rounds 3] [--no-write-docs]

One `torchyard up` (embedded Redis, the API, one CPU worker; every setting at its default: the
20 s lease, the 1 s heartbeat) on a data dir of its own. Each round submits a training job
(cifar_net on `fake`, batch 8, many epochs), waits until it is inside an epoch (a step recorded,
not the last), SIGKILLs the worker process and polls, every 20 ms from the kill: the restarted
worker's process seen (a new `worker --device cpu` child of `up`), the job's record `running`
with one more attempt (the brief's "runs again"), and the new attempt's first progress report
(training again). The job is then cancelled. Before each kill the worker has been up for `up`'s
HEALTHY_AFTER_S and a margin (the supervisor times a child from after its Popen returned, later
than the process's own start), so each crash is a first one to the supervisor (restarted 1 s
after its exit is seen), not a crash loop whose restart delay doubles.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.docs import write_section  # noqa: E402 (after the sys.path entry above)
from bench.harness import load_average, machine  # noqa: E402

MARGIN_S = 5.0
JOB = {"model": "cifar_net", "dataset": "fake", "epochs": 200, "batch_size": 8, "patience": 0}
POLL_S = 0.02


def _worker(up_pid: int):
    import psutil

    for proc in psutil.Process(up_pid).children(recursive=True):
        try:
            if "worker --device" in " ".join(proc.cmdline()):
                return proc
        except psutil.NoSuchProcess:
            continue
    return None


def one_round(client, up_pid: int, healthy_after_s: float) -> dict[str, Any]:
    from harness import wait_for_job, wait_until

    worker = wait_until(lambda: _worker(up_pid), timeout=120, what="the worker process")
    job_id = client.post("/jobs", json=JOB).json()["id"]

    def inside_an_epoch() -> dict | None:
        job = client.get(f"/jobs/{job_id}").json()
        p = job["progress"]
        up_for = time.time() - worker.create_time()
        return job if job["status"] == "running" and 0 < p["step"] < p["steps"] and up_for >= healthy_after_s + MARGIN_S \
            else None

    before = wait_until(inside_an_epoch, timeout=600, interval=0.05, what="the job inside an epoch")
    worker.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    seen: dict[str, float] = {}
    while len(seen) < 3 and time.monotonic() - killed < 300:
        now = time.monotonic() - killed
        if "worker_restarted_s" not in seen and (w := _worker(up_pid)) is not None and w.pid != worker.pid:
            seen["worker_restarted_s"] = now
        job = client.get(f"/jobs/{job_id}").json()
        if "running_again_s" not in seen and job["status"] == "running" and job["attempts"] > before["attempts"]:
            seen["running_again_s"] = now
        if "running_again_s" in seen and "training_again_s" not in seen and job["progress"] != before["progress"] \
                and job["progress"]["step"] > 0:
            seen["training_again_s"] = now
        time.sleep(POLL_S)
    client.post(f"/jobs/{job_id}/cancel")
    wait_for_job(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=120)
    # The requeue's reason, in the event stream (which ends with the job): the fast path's words,
    # not the lease sweep's.
    took_back = "its worker process (cpu@" in client.get(f"/jobs/{job_id}/events", timeout=30).text
    return {"job": job_id, "attempts_before": before["attempts"], "taken_back_as_dead": took_back,
            **{k: round(v, 2) for k, v in seen.items()}}


def main() -> None:
    from app.supervisor import HEALTHY_AFTER_S
    from harness import UpStack

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write-docs", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="torchyard-bench-takeover-"))
    load = load_average()
    rounds = []
    with UpStack(root / "var", root / "up.log", {"TORCHYARD_DEVICES": "cpu"}, start_timeout=300,
                 client_timeout=30) as stack:
        assert stack.proc is not None
        for _ in range(args.rounds):
            rounds.append(one_round(stack.client, stack.proc.pid, HEALTHY_AFTER_S))
            print(json.dumps(rounds[-1]), flush=True)
    load_after = load_average()
    rows = "\n".join(
        f"| {i} | {r.get('worker_restarted_s', '–')} | **{r.get('running_again_s', '–')}** | "
        f"{r.get('training_again_s', '–')} | {'yes' if r['taken_back_as_dead'] else 'no'} |"
        for i, r in enumerate(rounds, 1))
    text = (
        f"```\n.venv/bin/python bench/takeover.py --rounds {args.rounds}\n```\n\n"
        f"Host: {machine()}. `torchyard up` with one CPU worker, every setting at its default (lease "
        f"{20} s); cifar_net on `fake` at batch 8, the worker SIGKILLed inside an epoch after "
        f"{HEALTHY_AFTER_S + MARGIN_S:.0f} s up (a first crash to the supervisor: restarted after 1 s); seconds from "
        f"the kill, polled every {1000 * POLL_S:.0f} ms. Load average {load:.1f} before, {load_after:.1f} "
        f"after.\n\n"
        f"| round | new worker process | job `running` again, attempt + 1 | first progress of that attempt | "
        f"taken back as its worker died (not by the lease) |\n| ---: | ---: | ---: | ---: | --- |\n{rows}\n\n"
    )
    if not args.no_write_docs:
        write_section("takeover", "Takeover after a worker's crash under `torchyard up`", text)
    print(text)


if __name__ == "__main__":
    main()
