"""Sweeps through HTTP on real processes: the 422s, a small grid sweep to its end with one trial
pruned (the session's `grid_sweep`), a cancel, the Idempotency-Key, the CLI, and the API, Redis and
a worker SIGKILLed mid-sweep without a trial lost, asked twice or run twice. Every sweep is
cifar_net on `fake`, two epochs."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest
import redis

from tests.e2e.sweeps_support import BASE, GRID_BODY, GRID_KEY, sweep_body, wait_for_sweep
from tests.support import TERMINAL, free_port, get_job, wait_for_job, wait_until

pytestmark = pytest.mark.e2e


def sweep_jobs(client: httpx.Client, sweep_id: str) -> list[dict]:
    """Every job whose record says it is a trial of this sweep (all jobs, from the job list)."""
    jobs = client.get("/jobs", params={"limit": 500}).json()["jobs"]
    return [j for j in jobs if j.get("sweep_id") == sweep_id]


def assert_one_job_per_trial(client: httpx.Client, sweep: dict) -> None:
    """The study and the jobs agree one to one: each trial names its own job, which names it back,
    and no job claims a trial the study does not hold; no job trained an epoch twice."""
    trials = sweep["trials"]
    assert [t["number"] for t in trials] == list(range(len(trials)))
    by_job = {t["job_id"]: t["number"] for t in trials}
    assert None not in by_job and len(by_job) == len(trials), trials
    tagged = {j["id"]: j["trial"] for j in sweep_jobs(client, sweep["id"])}
    assert tagged == by_job
    for job_id in by_job:
        epochs = [m["epoch"] for m in get_job(client, job_id)["metrics"]]
        assert epochs == list(range(1, len(epochs) + 1)), (job_id, epochs)


@pytest.mark.parametrize(("change", "field"), [
    ({"space": {"dataset": {"type": "categorical", "choices": ["fake"]}}}, "space.dataset"),
    ({"space": {"colour": {"type": "categorical", "choices": [1]}}}, "space.colour"),
    ({"space": {"learning_rate": {"type": "float", "low": 0.1, "high": 0.1}}}, "space.learning_rate"),
    ({"space": {"weight_decay": {"type": "float", "low": 0, "high": 0.1, "log": True}}}, "space.weight_decay"),
    ({"space": {"batch_size": {"type": "categorical", "choices": []}}}, "space.batch_size.choices"),
    ({"space": {"batch_size": {"type": "categorical", "choices": [32, 0]}}}, "space.batch_size.choices[1]"),
    ({"sampler": "grid"}, "space.learning_rate"),
    ({"trials": 100_000}, "trials"),
    ({"parallel": 0}, "parallel"),
    ({"metric": "val_f1"}, "metric"),
    ({"metric": "val_loss", "base": {**BASE, "val_fraction": 0}}, "metric"),
    ({"base": {**BASE, "model": "no_such_net"}}, "no_such_net"),
    ({"base": {**BASE, "epochs": 0}}, "epochs"),
])
def test_a_bad_sweep_is_refused_naming_the_field(stack: dict, change: dict, field: str) -> None:
    client = stack["client"]
    before = client.get("/sweeps").json()["sweeps"]
    reply = client.post("/sweeps", json=sweep_body(**change))
    assert reply.status_code == 422, reply.text
    assert field in reply.json()["detail"], reply.json()
    assert client.get("/sweeps").json()["sweeps"] == before


def test_a_grid_sweep_runs_its_trials_as_jobs_and_prunes_the_hopeless_one(stack: dict, grid_sweep: dict) -> None:
    """Two trials of a 2×2 grid, one at a time, the median pruner judging from the first complete
    trial on: the seed puts lr 0.03 first and lr 1e-7 (which learns nothing) second. The second is
    pruned after its first epoch: its job succeeded with its best weights and says why."""
    client, sweep, sweep_id = stack["client"], grid_sweep, grid_sweep["id"]
    again = client.post("/sweeps", json=GRID_BODY, headers={"Idempotency-Key": GRID_KEY})
    assert (again.status_code, again.json()["id"]) == (200, sweep_id)
    other = client.post("/sweeps", json={**GRID_BODY, "seed": 7}, headers={"Idempotency-Key": GRID_KEY})
    assert other.status_code == 422 and "Idempotency-Key" in other.json()["detail"]

    assert sweep["status"] == "succeeded", sweep
    first, hopeless = sweep["trials"]
    assert first["params"]["learning_rate"] == 0.03 and first["state"] == "complete" and first["epoch"] == 2
    assert hopeless["params"]["learning_rate"] == 1e-7 and hopeless["state"] == "pruned", hopeless
    assert hopeless["epoch"] == 1
    job = get_job(client, hopeless["job_id"])
    assert job["status"] == "succeeded" and job["stop_reason"].startswith("pruned by the sweep"), job
    assert job["checkpoint"] is not None and job["best_epoch"] == 1
    assert sweep["best"]["params"]["learning_rate"] == 0.03
    assert sweep["best"]["value"] == max(t["value"] for t in sweep["trials"] if t["state"] == "complete")
    assert set(sweep["importances"]) == {"learning_rate", "weight_decay"}
    assert_one_job_per_trial(client, sweep)

    with client.stream("GET", f"/sweeps/{sweep_id}/events") as events:
        lines = [line for line in events.iter_lines() if line.startswith("data:")]
    told = [json.loads(line[5:]) for line in lines]
    assert told[-1] == {"status": "succeeded"}
    assert [e["state"] for e in told if e.get("number") == 1] == ["running", "pruned"]


def test_cancel_stops_the_running_trial_and_asks_no_more(stack: dict) -> None:
    client = stack["client"]
    created = client.post("/sweeps", json=sweep_body(base={**BASE, "epochs": 50}, trials=4))
    assert created.status_code == 201, created.text
    sweep_id = created.json()["id"]
    job_id = wait_until(lambda: (t := client.get(f"/sweeps/{sweep_id}").json()["trials"]) and t[0]["job_id"],
                        timeout=30, what="the first trial's job")
    wait_until(lambda: get_job(client, job_id)["status"] == "running", timeout=120, what="the trial running")
    cancelled = client.post(f"/sweeps/{sweep_id}/cancel")
    assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelled"
    assert wait_for_job(client, job_id, TERMINAL, timeout=60)["status"] == "cancelled"
    sweep = wait_for_sweep(client, sweep_id, timeout=60)
    assert sweep["status"] == "cancelled" and [t["state"] for t in sweep["trials"]] == ["failed"]
    assert client.post(f"/sweeps/{sweep_id}/cancel").status_code == 409
    with client.stream("GET", f"/sweeps/{sweep_id}/events") as events:
        told = [(e, json.loads(d[5:])) for e, d in zip(*[iter(line for line in events.iter_lines()
                                                               if line.startswith(("event:", "data:")))] * 2,
                                                       strict=True)]
    assert [(e.removeprefix("event:").strip(), d.get("state") or d.get("status")) for e, d in told[-3:]] == \
        [("cancel_requested", None), ("trial", "failed"), ("status", "cancelled")]
    journal = redis.Redis.from_url(stack["redis_url"])
    assert journal.keys(f"ty:optuna:{sweep_id}:*")  # the study's own journal
    assert client.delete(f"/sweeps/{sweep_id}").status_code == 204
    assert client.get(f"/sweeps/{sweep_id}").status_code == 404
    assert journal.keys(f"ty:optuna:{sweep_id}:*") == []  # deleted with the sweep
    journal.close()
    assert get_job(client, job_id)["status"] == "cancelled"  # its trials' jobs stay


def test_the_api_redis_and_a_worker_killed_mid_sweep_lose_no_trial_and_run_none_twice(tmp_path: Path) -> None:
    """Two trials at once on two workers, on a Redis of the test's own. The API is SIGKILLed as soon
    as the first trials' jobs exist and started again; then redis-server is SIGKILLed mid-epoch
    (GET /sweeps/{id} answers 503 meanwhile) and started again on its files; then one trial's worker
    is SIGKILLed (its job is redelivered to a new worker). The sweep ends with exactly `trials`
    trials, one job each, no epoch trained twice."""
    from app.embedded_redis import EmbeddedRedis
    from tests.support import Processes

    server = EmbeddedRedis(tmp_path / "redis")
    procs = Processes(server.start(), tmp_path / "data", tmp_path / "logs", TORCHYARD_LEASE_TTL_S="3")
    client = httpx.Client(timeout=60)
    try:
        workers = [procs.worker("cpu", name=f"sw{k}", TORCHYARD_NODE_NAME=f"sw{k}") for k in range(2)]
        api = procs.api(port := free_port())
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        wait_until(lambda: len(client.get("/devices").json()["devices"]) == 2, timeout=120, what="two workers")
        created = client.post("/sweeps", json=sweep_body(trials=3, parallel=2))
        assert created.status_code == 201, created.text
        sweep_id = created.json()["id"]
        assert len(created.json()["trials"]) == 2  # asked at once, up to `parallel`

        procs.stop(api, signal.SIGKILL)
        procs.api(port)
        wait_until(lambda: client.get("/healthz").status_code == 200, timeout=60, what="the restarted API")

        wait_until(lambda: any(t["epoch"] >= 1 for t in client.get(f"/sweeps/{sweep_id}").json()["trials"]),
                   timeout=180, what="a trial past its first epoch")
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        assert client.get(f"/sweeps/{sweep_id}").status_code == 503
        server.start()

        running = wait_until(lambda: [t for t in client.get(f"/sweeps/{sweep_id}").json()["trials"]
                                      if t["job_status"] == "running" and t["epoch"] >= 1],
                             timeout=180, what="a trial running past its first epoch")
        victim = get_job(client, running[0]["job_id"])
        procs.stop(workers[int(victim["device"].split("/")[0].removeprefix("sw"))], signal.SIGKILL)
        procs.worker("cpu", name="sw9", TORCHYARD_NODE_NAME="sw9")

        sweep = wait_for_sweep(client, sweep_id, timeout=300)
        assert sweep["status"] == "succeeded", sweep
        assert len(sweep["trials"]) == 3 and all(t["state"] == "complete" for t in sweep["trials"]), sweep["trials"]
        assert_one_job_per_trial(client, sweep)
        redelivered = get_job(client, victim["id"])
        assert redelivered["attempts"] == 2 and len(redelivered["metrics"]) == 2, redelivered
    finally:
        client.close()
        procs.stop_all()
        server.stop()


def test_the_cli_shows_lists_starts_and_cancels_sweeps(stack: dict, grid_sweep: dict, tmp_path: Path) -> None:
    from tests.e2e.test_cli import cli

    shown = cli(stack, "sweep", grid_sweep["id"], "--follow")  # ended: the table and the best line at once
    assert shown.returncode == 0, shown.stderr
    assert "best val_accuracy" in shown.stdout and "pruned" in shown.stdout, shown.stdout
    assert json.loads(cli(stack, "sweep", grid_sweep["id"], "--json").stdout)["best"] == grid_sweep["best"]
    listed = cli(stack, "sweeps")
    assert grid_sweep["id"] in listed.stdout and "succeeded" in listed.stdout

    (tmp_path / "job.json").write_text(json.dumps({**BASE, "epochs": 50}))
    (tmp_path / "space.json").write_text(json.dumps({"batch_size": {"type": "categorical", "choices": [64, 128]}}))
    started = cli(stack, "sweep", "--base", str(tmp_path / "job.json"), "--space", str(tmp_path / "space.json"),
                  "--trials", "2", "--parallel", "1", "--detach")
    assert started.returncode == 0, started.stderr
    sweep_id = started.stdout.strip()
    cancelled = cli(stack, "sweep", sweep_id, "--cancel", "--json")
    assert json.loads(cancelled.stdout)["status"] == "cancelled"
    flags = cli(stack, "sweep", "--model", "cifar_net", "--dataset", "fake", "--epochs", "50", "--float",
                "learning_rate=1e-4:0.1:log", "--choice", "batch_size=64,128", "--trials", "3", "--detach", "--json")
    assert flags.returncode == 0, flags.stderr
    as_flags = json.loads(flags.stdout)
    assert as_flags["spec"]["space"] == {"learning_rate": {"type": "float", "low": 1e-4, "high": 0.1, "log": True,
                                                           "step": None},
                                         "batch_size": {"type": "categorical", "choices": [64, 128]}}
    cli(stack, "sweep", as_flags["id"], "--cancel")
    refused = cli(stack, "sweep", "--base", str(tmp_path / "job.json"), "--space", str(tmp_path / "job.json"))
    assert refused.returncode == 1 and "space.model" in refused.stderr, refused.stderr
    wait_for_sweep(stack["client"], sweep_id, timeout=60)
    wait_for_sweep(stack["client"], as_flags["id"], timeout=60)


def test_the_states_a_kill_leaves_between_the_steps_are_finished_once(stack: dict) -> None:
    """What an API killed inside an advance leaves, made directly in the real study and Redis while
    the stack's API drives the sweep: a trial asked with no job (killed after the ask), then a job
    created but not recorded as the trial's (killed after the job). The next advance gives the
    first its job, and finds the second's job again under its Idempotency-Key: one job per trial,
    and no trial asked beyond `trials`."""
    from core import keys
    from core.sweeps import study as studies
    from core.sweeps.spec import SweepSpec

    client = stack["client"]
    body = sweep_body(base={**BASE, "epochs": 50}, trials=2)
    sweep_id = client.post("/sweeps", json=body).json()["id"]
    first = wait_until(lambda: (t := client.get(f"/sweeps/{sweep_id}").json()["trials"]) and t[0]["job_id"],
                       timeout=30, what="the first trial's job")
    spec = SweepSpec.model_validate(client.get(f"/sweeps/{sweep_id}").json()["spec"])
    orphan = studies.open_study(stack["redis_url"], sweep_id, spec, asked=1).ask(studies.distributions(spec))
    assert orphan.number == 1
    second = wait_until(lambda: client.get(f"/sweeps/{sweep_id}").json()["trials"][1]["job_id"],
                        timeout=30, what="the orphan trial's job")
    assert get_job(client, second)["trial"] == 1 and get_job(client, second)["sweep_id"] == sweep_id

    db = redis.Redis.from_url(stack["redis_url"], decode_responses=True)
    db.hdel(keys.sweep_jobs(sweep_id), "1")  # the job exists, its record as the trial's is lost
    wait_until(lambda: db.hget(keys.sweep_jobs(sweep_id), "1"), timeout=30, what="the trial's job recorded again")
    assert db.hget(keys.sweep_jobs(sweep_id), "1") == second
    db.close()

    client.post(f"/sweeps/{sweep_id}/cancel")
    sweep = wait_for_sweep(client, sweep_id, timeout=120)
    assert [t["job_id"] for t in sweep["trials"]] == [first, second]
    assert_one_job_per_trial(client, sweep)
