"""Jobs as MLflow runs and aliases as registered models, against a real `mlflow server` (SQLite
store, local artifacts, proxied), read back only through MLflow's public client. The faults are
real: the server SIGKILLed mid-job and started again on its store, the worker SIGKILLed mid-epoch;
a gang on two tracking workers; and tracking that cannot work (never there, a path the server does
not serve with wrong credentials, a scheme MLflow refuses), with /predict answered beside it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.mlflow_server import MlflowServer
from harness.processes import REPO, cli
from tests.support import (
    Processes,
    flush,
    free_port,
    get_job,
    pattern_png,
    submit_cifar,
    two_hosts,
    wait_for_job,
    wait_until,
    with_db,
)

pytestmark = pytest.mark.e2e

DB = 15  # a database of this module's own, flushed at its start
FAST = {"TORCHYARD_MLFLOW_POLL_S": "0.2", "TORCHYARD_MLFLOW_BACKOFF_MAX_S": "2",
        "TORCHYARD_MLFLOW_REQUEST_TIMEOUT_S": "3"}


@pytest.fixture(scope="module")
def tracked(redis_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """An MLflow server (started once: it takes 15-40 s), the API and one CPU worker tracking to it."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("mlflow")
    server = MlflowServer(root / "server").start()
    url = with_db(redis_base_url, DB)
    flush(url)
    procs = Processes(url, root / "data", root / "logs", TORCHYARD_MLFLOW_TRACKING_URI=server.url, **FAST)
    worker = procs.worker("cpu", name="ml", TORCHYARD_NODE_NAME="ml")
    client = httpx.Client(base_url=procs.ready_api(), timeout=60)
    try:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=120, what="the worker")
        yield {"server": server, "procs": procs, "worker": worker, "client": client, "data_dir": root / "data",
               "mlflow": MlflowClient(server.url, server.url)}
    finally:
        client.close()
        procs.stop_all()
        server.stop()


def run_complete(client: httpx.Client, job_id: str, timeout: float = 180) -> dict:
    """The job's `mlflow` once its run holds everything (ended, nothing behind)."""
    def complete() -> dict | None:
        run = get_job(client, job_id).get("mlflow")
        return run if run and run["status"] == "FINISHED" and not run["behind"] else None

    return wait_until(complete, timeout=timeout, interval=0.5, what=f"job {job_id}'s run to catch up")


def test_one_run_each_epoch_once_through_a_worker_kill_and_a_server_kill(tracked: dict) -> None:
    """The worker SIGKILLed mid-epoch and started again (the job redelivered), then the server
    SIGKILLed: the job succeeds meanwhile, its record says what the run lacks; the server back on
    its store, the run catches up: one run, every epoch once, FINISHED, params, tags, artifacts."""
    client, procs, server, mlflow = tracked["client"], tracked["procs"], tracked["server"], tracked["mlflow"]
    epochs = 6
    job_id = submit_cifar(client, epochs)
    wait_until(lambda: len(get_job(client, job_id)["metrics"]) >= 2 and get_job(client, job_id)["mlflow"]["epochs_logged"],
               timeout=180, what="two recorded epochs, the run holding some")
    procs.stop(tracked["worker"], signal.SIGKILL)  # mid-epoch 3
    procs.worker("cpu", name="ml", TORCHYARD_NODE_NAME="ml")  # takes its job back at once
    wait_until(lambda: len(get_job(client, job_id)["metrics"]) >= 4, timeout=180, what="epochs after the restart")
    assert get_job(client, job_id)["attempts"] == 2

    server.kill()
    done = wait_for_job(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=240)
    assert done["status"] == "succeeded", done.get("error")
    behind = wait_until(lambda: (run := get_job(client, job_id)["mlflow"]) and "status succeeded" in run["behind"]
                        and run, timeout=60, what="the record to say what the run lacks")
    assert behind["error"] and behind["run_id"], behind

    server.start()
    run_field = run_complete(client, job_id)
    runs = mlflow.search_runs([run_field["experiment_id"]], filter_string=f"tags.`torchyard.job_id` = '{job_id}'")
    assert [r.info.run_id for r in runs] == [run_field["run_id"]]
    run = mlflow.get_run(run_field["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == job_id
    assert run_field["epochs_logged"] == epochs and run_field["url"].endswith(run_field["run_id"])
    for metric in ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "images_per_second", "learning_rate"):
        steps = [m.step for m in mlflow.get_metric_history(run.info.run_id, metric)]
        assert sorted(steps) == list(range(1, epochs + 1)), (metric, steps)
    recorded = {m["epoch"]: m["train_loss"] for m in done["metrics"]}
    assert {m.step: m.value for m in mlflow.get_metric_history(run.info.run_id, "train_loss")} == pytest.approx(recorded)
    assert run.data.params["epochs"] == str(epochs) and run.data.params["optimizer"] == done["params"]["optimizer"]
    tags = run.data.tags
    assert tags["torchyard.model"] == "cifar_net" and tags["torchyard.dataset_id"] == "fake"
    assert tags["torchyard.node"] == "ml" and tags["torchyard.device"] == "ml/cpu"
    assert tags["torchyard.device_choices.batch_size"] == str(done["device_choices"]["batch_size"])
    files = {f.path for d in ("model", "evaluation") for f in mlflow.list_artifacts(run.info.run_id, d)}
    assert files == {"model/state_dict.pt", "model/spec.json", "evaluation/confusion_matrix.json",
                     "evaluation/per_class_accuracy.json"}


def test_aliases_as_registered_versions_and_evaluations_as_child_runs(tracked: dict, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """PUT /aliases registers each job's weights once as a version and points `current` at it; a
    rollback moves `current` back (no new version); the weights load into the model. An evaluation
    is a child run of its trained job's run; a fine-tune's run names its parent's."""
    import mlflow.artifacts
    import torch

    from models.registry import build_model

    client, mlflow_client = tracked["client"], tracked["mlflow"]
    first, second = (submit_cifar(client, 1, seed=seed) for seed in (21, 22))
    for job_id in (first, second):
        assert wait_for_job(client, job_id, {"succeeded", "failed"}, timeout=240)["status"] == "succeeded"
    runs = {job_id: run_complete(client, job_id)["run_id"] for job_id in (first, second)}

    def current() -> tuple[str, str]:
        version = mlflow_client.get_model_version_by_alias("pets", "current")
        return version.version, version.run_id

    assert client.put("/aliases/pets", json={"job_id": first}).status_code == 201
    v1 = wait_until(lambda: current()[1] == runs[first] and current(), timeout=60, what="pets@current → first")
    assert client.put("/aliases/pets", json={"job_id": second}).status_code == 200
    v2 = wait_until(lambda: current()[1] == runs[second] and current(), timeout=60, what="pets@current → second")
    assert int(v2[0]) == int(v1[0]) + 1
    assert client.post("/aliases/pets/rollback").status_code == 200
    assert wait_until(lambda: current()[1] == runs[first] and current(), timeout=60,
                      what="pets@current back to first") == v1
    assert len(mlflow_client.search_model_versions("name = 'pets'")) == 2

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracked["server"].url)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracked["server"].url)
    local = Path(mlflow.artifacts.download_artifacts("models:/pets@current", dst_path=str(tmp_path)))

    spec = json.loads((local / "spec.json").read_text())
    model = build_model(spec["architecture"], spec["num_classes"], spec["preprocessing"]["channels"])
    model.load_state_dict(torch.load(local / "state_dict.pt", weights_only=True))
    kept = torch.load(tracked["data_dir"] / "checkpoints" / first / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in kept.items())
    assert spec["job_id"] == first

    # An evaluation of `first`: a child run of its run, with its metrics and confusion matrix; a
    # fine-tune of it: its own run, tagged with its parent's.
    created = client.post(f"/jobs/{first}/evaluate", json={"dataset": "fake"})
    assert created.status_code == 202, created.text
    child_job = submit_cifar(client, 1, init_from=first)
    evaluation = wait_for_job(client, created.json()["id"], {"succeeded", "failed"}, timeout=240)
    assert evaluation["status"] == "succeeded", evaluation.get("error")
    child = mlflow_client.get_run(run_complete(client, evaluation["id"])["run_id"])
    assert child.data.tags["mlflow.parentRunId"] == runs[first] and child.info.status == "FINISHED"
    assert child.data.metrics["eval_accuracy"] == pytest.approx(evaluation["evaluation"]["accuracy"])
    assert {f.path for f in mlflow_client.list_artifacts(child.info.run_id, "evaluation")} == {
        "evaluation/confusion_matrix.json", "evaluation/per_class_accuracy.json"}
    assert wait_for_job(client, child_job, {"succeeded", "failed"}, timeout=240)["status"] == "succeeded"
    tuned = mlflow_client.get_run(run_complete(client, child_job)["run_id"])
    assert tuned.data.tags["torchyard.parent_run_id"] == runs[first] and tuned.data.params["init_from"] == first


# What a tracking URI that cannot work looks like to the job: a port nothing listens on; the real
# server addressed under a path it does not serve (it answers 404), with wrong credentials in MLflow's
# own variables (MLflow's basic-auth server app needs Flask-WTF, `mlflow[auth]`, which the test
# environment does not install, so no real server here refuses a password); a scheme MLflow's
# client refuses to make a store for.
UNREACHABLE = {
    "never there": lambda server: (f"http://127.0.0.1:{free_port()}", {}),
    "refused": lambda server: (f"{server.url}/no-mlflow-here", {"MLFLOW_TRACKING_USERNAME": "nobody",
                                                                "MLFLOW_TRACKING_PASSWORD": "wrong"}),
    "unknown scheme": lambda server: ("nowhere://tracking", {}),
}


@pytest.mark.parametrize("case", sorted(UNREACHABLE))
def test_a_server_that_cannot_be_used_costs_the_job_nothing(tracked: dict, redis_base_url: str, case: str,
                                                            tmp_path: Path) -> None:
    """Tracking that cannot work (see UNREACHABLE): the job succeeds, and its record (and the
    CLI's `job`) says what is behind and why."""
    uri, credentials = UNREACHABLE[case](tracked["server"])
    url = with_db(redis_base_url, DB - 1)
    flush(url)
    procs = Processes(url, tmp_path / "data", tmp_path / "logs", TORCHYARD_MLFLOW_TRACKING_URI=uri, **FAST,
                      **credentials)
    worker = procs.worker("cpu", name="nomlflow", TORCHYARD_NODE_NAME="nomlflow")
    base = procs.ready_api()
    client = httpx.Client(base_url=base, timeout=60)
    try:
        job_id = submit_cifar(client, 2)
        done = wait_for_job(client, job_id, {"succeeded", "failed"}, timeout=240)
        assert done["status"] == "succeeded", done.get("error")
        assert len(done["metrics"]) == 2
        record = wait_until(lambda: (run := get_job(client, job_id)["mlflow"]) and "status succeeded" in run["behind"]
                            and run, timeout=60, what="the record to say what is behind")
        assert record["run_id"] is None and record["behind"][:2] == ["the run", "2 epochs"], record
        assert record["error"], record
        shown = subprocess.run([*cli("--url", base, "job", job_id)], cwd=REPO, capture_output=True, text=True,
                               timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL)
        assert shown.returncode == 0, shown.stderr
        assert "mlflow" in shown.stdout and "no run yet; behind: the run" in shown.stdout, shown.stdout
        # /predict while the tracking thread keeps failing beside it: answered by the same worker.
        answer = client.post("/predict", data={"job_id": job_id}, files={"file": ("p.png", pattern_png(3), "image/png")})
        assert answer.status_code == 200, answer.text
        assert answer.json()["device"] == "nomlflow/cpu" and answer.json()["results"][0]["predictions"]
        assert worker.poll() is None  # the worker is still up, and takes the next job
        assert wait_for_job(client, submit_cifar(client, 1), {"succeeded", "failed"}, timeout=240)["status"] == "succeeded"
    finally:
        client.close()
        procs.stop_all()


def test_a_gang_is_one_run_each_epoch_once(tracked: dict, tmp_path: Path) -> None:
    """A 2-rank job on two tracking workers (two "hosts" on their own Redis, the module's server):
    one run, each epoch's metrics once (rank 0's record), FINISHED, the weights logged."""
    mlflow, epochs = tracked["mlflow"], 2
    with two_hosts(tmp_path, timeout=240, TORCHYARD_MLFLOW_TRACKING_URI=tracked["server"].url,
                   TORCHYARD_ADVERTISE_ADDRESS="127.0.0.1", OMP_NUM_THREADS="1", **FAST) as hosts:
        client = hosts["client"]
        job_id = submit_cifar(client, epochs, world_size=2, batch_size=32, seed=3)
        done = wait_for_job(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=300)
        assert done["status"] == "succeeded", done.get("error")
        assert done["world_size"] == 2 and len(done["metrics"]) == epochs
        run_field = run_complete(client, job_id)
    runs = mlflow.search_runs([run_field["experiment_id"]], filter_string=f"tags.`torchyard.job_id` = '{job_id}'")
    assert [r.info.run_id for r in runs] == [run_field["run_id"]]
    run = mlflow.get_run(run_field["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["torchyard.job_id"] == job_id
    for metric in ("train_loss", "val_accuracy", "images_per_second"):
        steps = [m.step for m in mlflow.get_metric_history(run.info.run_id, metric)]
        assert sorted(steps) == list(range(1, epochs + 1)), (metric, steps)
    assert {m.step: m.value for m in mlflow.get_metric_history(run.info.run_id, "train_loss")} == pytest.approx(
        {m["epoch"]: m["train_loss"] for m in done["metrics"]})
    assert "model/state_dict.pt" in {f.path for f in mlflow.list_artifacts(run.info.run_id, "model")}
