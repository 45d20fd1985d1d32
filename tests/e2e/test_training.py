"""Training jobs through real processes: built-ins through torchvision's loaders, cancellation,
idempotent submission, listing, and resuming after a worker is killed."""

from __future__ import annotations

import hashlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.datagen import CIFAR_CLASSES, shapes_zip, write_cifar10, write_mnist
from tests.support import own_api, wait_for_job, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture
def own_stack(clean_redis_url: str, tmp_path: Path) -> Iterator[dict]:
    """An API of our own (its workers started by the tests): small lease TTL, few zip entries, test
    copies of built-ins."""
    with own_api(clean_redis_url, tmp_path, TORCHYARD_LEASE_TTL_S="3", TORCHYARD_MAX_ZIP_ENTRIES="50",
                 TORCHYARD_VERIFY_BUILTIN_CHECKSUMS="false") as stack:
        yield stack


def _events(client: httpx.Client, job_id: str) -> list[str]:
    with client.stream("GET", f"/jobs/{job_id}/events") as response:
        return [line.split(": ", 1)[1] for line in response.iter_lines() if line.startswith("event: ")]


def test_builtins_through_torchvision_and_missing_files(own_stack: dict) -> None:
    client, procs, data_dir = own_stack["client"], own_stack["procs"], own_stack["data_dir"]
    builtin = data_dir / "builtin"
    write_cifar10(builtin, per_batch=100)
    write_mnist(builtin, train=300)
    procs.worker("cpu")
    wait_until(lambda: client.get("/readyz").status_code == 200, timeout=90, what="a worker heartbeat")

    datasets = {d["id"]: d for d in client.get("/datasets").json()["datasets"]}
    assert datasets["cifar10"]["available"] and datasets["mnist"]["available"]
    assert not datasets["fashion_mnist"]["available"]

    cifar = client.post("/jobs", json={"model": "cifar_net", "dataset": "cifar10", "epochs": 5,
                                                  "batch_size": 32}).json()
    mnist = client.post("/jobs", json={"model": "catdog_net", "dataset": "mnist", "epochs": 2}).json()
    # A built-in whose files are missing (and may not be downloaded): refused at submit, saying where.
    missing = client.post("/jobs", json={"model": "cifar_net", "dataset": "fashion_mnist", "epochs": 1})
    assert missing.status_code == 422
    assert str(builtin / "FashionMNIST" / "raw") in missing.json()["detail"]
    assert "TORCHYARD_ALLOW_DOWNLOAD" in missing.json()["detail"]

    done = wait_for_job(client, cifar["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]
    assert done["classes"] == CIFAR_CLASSES  # from batches.meta, read by torchvision
    assert done["metrics"][-1]["val_accuracy"] >= 0.9
    assert done["progress"]["steps"] == 15  # 5 batches × 100, 10% held out: 450 images at batch 32
    # Evaluated on the built-in's test split (test_batch: 100 images), read through torchvision.
    evaluation = client.post(f"/jobs/{cifar['id']}/evaluate", json={"dataset": "cifar10"}).json()
    evaluated = wait_for_job(client, evaluation["id"], {"succeeded", "failed"})
    assert evaluated["status"] == "succeeded", evaluated["error"]
    result = client.get(f"/jobs/{cifar['id']}/evaluations/{evaluation['id']}").json()["result"]
    assert result["split"] == "test" and result["num_images"] == 100 and result["classes"] == CIFAR_CLASSES
    assert result["accuracy"] >= 0.9 and sum(map(sum, result["confusion_matrix"])) == 100

    done = wait_for_job(client, mnist["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]
    assert done["params"]["channels"] == 1 and done["params"]["height"] == 50  # 28×28 gray → catdog_net's 50×50


    # Too many entries for this API (TORCHYARD_MAX_ZIP_ENTRIES=50): refused, nothing written.
    refused = client.post("/datasets", files={"file": ("many.zip", shapes_zip(per_class=20), "application/zip")})
    assert refused.status_code == 413 and "entries" in refused.json()["detail"]
    assert not list(data_dir.glob("datasets/*")) and not list(data_dir.glob("datasets/.*"))


def _forward_threads(client: httpx.Client) -> int | None:
    (device,) = client.get("/devices").json()["devices"]
    return (device.get("inference") or {}).get("forward_threads")


def test_cancel_running_queued_and_finished(stack: dict) -> None:
    client = stack["client"]
    running = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 500, "patience": 0}).json()
    wait_until(lambda: client.get(f"/jobs/{running['id']}").json()["progress"]["step"] > 0, timeout=60,
               what="the long job to be training")
    queued = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()
    assert client.get(f"/jobs/{queued['id']}").json()["status"] == "queued"  # the only worker is busy

    answer = client.post(f"/jobs/{queued['id']}/cancel")
    assert answer.status_code == 202 and answer.json()["status"] == "cancelled"
    answer = client.post(f"/jobs/{running['id']}/cancel")
    assert answer.status_code == 202 and answer.json()["status"] in ("running", "cancelled")
    stopped = wait_for_job(client, running["id"], {"cancelled", "succeeded", "failed"}, timeout=30)
    assert stopped["status"] == "cancelled" and stopped["checkpoint"] is None
    assert len(stopped["metrics"]) < 500
    assert not list((stack["data_dir"] / "checkpoints" / running["id"]).glob("**/resume*.pt"))

    # The worker is free now and receives the cancelled job's message: it must not start it.
    probe = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()
    assert wait_for_job(client, probe["id"], {"succeeded", "failed"})["status"] == "succeeded"
    never = client.get(f"/jobs/{queued['id']}").json()
    assert never["status"] == "cancelled" and never["attempts"] == 0 and never["started_at"] is None
    assert _events(client, queued["id"]) == ["status", "status"]  # queued, cancelled

    finished = client.post(f"/jobs/{probe['id']}/cancel")
    assert finished.status_code == 409 and "succeeded" in finished.json()["detail"]
    assert client.post(f"/jobs/{queued['id']}/cancel").status_code == 409
    assert client.post("/jobs/doesnotexist/cancel").status_code == 404


def test_a_long_job_stops_by_patience_once_validation_accuracy_saturates(stack: dict) -> None:
    """What a new user tries: many epochs on `fake` with the default early stopping. Validation
    accuracy reaches 1.0 within a few epochs while val_loss goes on falling; the job stops 5 epochs
    after its last higher accuracy (the lower loss picks the kept weights, it is no improvement)."""
    client = stack["client"]
    epochs = 40
    job = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": epochs}).json()
    done = wait_for_job(client, job["id"], {"succeeded", "failed"}, timeout=600)
    assert done["status"] == "succeeded", done["error"]
    accuracies = [m["val_accuracy"] for m in done["metrics"]]
    last_gain = max(epoch for epoch in range(1, len(accuracies) + 1)
                    if epoch == 1 or accuracies[epoch - 1] > max(accuracies[:epoch - 1]))
    assert len(accuracies) == last_gain + 5 < epochs, accuracies
    best = done["best_epoch"]
    assert accuracies[best - 1] == max(accuracies) and done["evaluation"]["epoch"] == best
    assert done["stop_reason"] == (f"early stopping: val_accuracy did not improve for 5 epochs (patience 5); "
                                   f"best {max(accuracies):.4f} at epoch {best}")
    assert "early_stop" in _events(client, job["id"])


def test_idempotency_validation_and_listing(stack: dict) -> None:
    client = stack["client"]
    spec = {"model": "cifar_net", "dataset": "fake", "epochs": 1, "learning_rate": 0.002, "optimizer": "sgd"}
    first = client.post("/jobs", json=spec, headers={"Idempotency-Key": "retry-me-1"})
    again = client.post("/jobs", json=spec, headers={"Idempotency-Key": "retry-me-1"})
    assert first.status_code == 202 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    other = client.post("/jobs", json={**spec, "epochs": 2}, headers={"Idempotency-Key": "retry-me-1"})
    assert other.status_code == 422 and first.json()["id"] in other.json()["detail"], (
        f"another body under a used Idempotency-Key must be a 422 naming the first job, not {other.status_code} "
        f"{other.text[:200]}")
    params = first.json()["params"]
    assert params["learning_rate"] == 0.002 and params["optimizer"] == "sgd" and params["seed"] == 0
    assert params["val_fraction"] == 0.1 and params["epochs"] == 1

    models = {m["name"]: m for m in client.get("/models").json()["models"]}
    assert models["cifar_net"]["input"] == {"channels": 3, "height": 32, "width": 32}
    assert models["catdog_net"]["input"] == {"channels": 1, "height": 50, "width": 50}
    assert {"resnet18", "mobilenet_v3_small"} <= set(models) and all(m["parameters"] > 0 for m in models.values())

    for bad in ({"model": "nope", "dataset": "fake"}, {"model": "cifar_net", "dataset": "nope"},
                {"model": "cifar_net", "dataset": "fake", "epochs": 0},
                {"model": "cifar_net", "dataset": "fake", "optimizer": "lbfgs"},
                {"model": "cifar_net", "dataset": "fake", "image_size": 64},
                {"model": "cifar_net", "dataset": "fake", "device": "nowhere/cuda:7"},
                {"model": "cifar_net", "dataset": "fake", "surprise": 1}):
        response = client.post("/jobs", json=bad)
        assert response.status_code == 422 and response.json()["detail"], bad

    ids = [client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()["id"]
           for _ in range(3)]
    for job_id in [*ids, first.json()["id"]]:
        wait_for_job(client, job_id, {"succeeded", "failed"})
    seen: list[str] = []
    cursor = None
    while True:
        page = client.get("/jobs", params={"status": "succeeded", "limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        assert len(page["jobs"]) <= 2 and all(j["status"] == "succeeded" for j in page["jobs"])
        seen += [j["id"] for j in page["jobs"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert len(seen) == len(set(seen)) and set(ids) <= set(seen)
    assert seen == sorted(seen, reverse=True)  # newest first
    assert not {j["id"] for j in client.get("/jobs", params={"status": "queued"}).json()["jobs"]} & set(ids)


def test_a_retry_gets_its_job_after_what_was_checked_changed(stack: dict) -> None:
    """The Idempotency-Key is looked up before the request is checked again: a retry whose first
    attempt was acknowledged (the client just never saw the answer) gets that job, even after its
    dataset was deleted (a 422 "unknown dataset" before) or the parent it started from was deleted."""
    client = stack["client"]
    upload = client.post("/datasets", files={"file": ("d.zip", shapes_zip(per_class=6, seed=9, corrupt=None),
                                                      "application/zip")}, data={"name": "retry-after-delete"})
    assert upload.status_code == 201, upload.text
    spec = {"model": "cifar_net", "dataset": upload.json()["id"], "epochs": 1, "val_fraction": 0.25}
    first = client.post("/jobs", json=spec, headers={"Idempotency-Key": "retry-after-delete"})
    assert first.status_code == 202, first.text
    parent = wait_for_job(client, first.json()["id"], {"succeeded", "failed"})
    assert parent["status"] == "succeeded", parent
    child_spec = {"model": "cifar_net", "dataset": "fake", "epochs": 1, "init_from": parent["id"]}
    child = client.post("/jobs", json=child_spec, headers={"Idempotency-Key": "retry-after-parent"})
    assert child.status_code == 202, child.text
    wait_for_job(client, child.json()["id"], {"succeeded", "failed"})

    # (A dataset just given to a job is kept for a few seconds: core/datasets.IN_USE_GRACE_S.)
    wait_until(lambda: client.delete(f"/datasets/{spec['dataset']}").status_code == 204, timeout=30,
               interval=1, what="the dataset's deletion")
    retried = client.post("/jobs", json=spec, headers={"Idempotency-Key": "retry-after-delete"})
    assert retried.status_code == 200 and retried.json()["id"] == parent["id"], retried.text
    assert client.post("/jobs", json=spec).status_code == 422  # without the key: checked, and refused

    assert client.delete(f"/jobs/{parent['id']}").status_code == 204
    again = client.post("/jobs", json=child_spec, headers={"Idempotency-Key": "retry-after-parent"})
    assert again.status_code == 200 and again.json()["id"] == child.json()["id"], again.text
    assert client.post("/jobs", json=child_spec).status_code == 422


def test_resume_after_worker_sigkill(own_stack: dict) -> None:
    client, procs = own_stack["client"], own_stack["procs"]
    first = procs.worker("cpu", name="worker-first")
    wait_until(lambda: client.get("/readyz").status_code == 200, timeout=90, what="a worker heartbeat")
    epochs = 12
    job = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": epochs, "batch_size": 32,
                                     "patience": 0}).json()  # every epoch runs: no early stopping

    def some_epochs() -> dict | None:
        current = client.get(f"/jobs/{job['id']}").json()
        return current if len(current["metrics"]) >= 2 else None

    at_kill = wait_until(some_epochs, timeout=120, interval=0.05, what="two finished epochs")
    procs.stop(first, signal.SIGKILL)
    killed_after = len(client.get(f"/jobs/{job['id']}").json()["metrics"])
    assert at_kill["status"] == "running" and killed_after < epochs, "the job finished before the kill"

    time.sleep(1)
    second = procs.worker("cpu", name="worker-second")
    done = wait_for_job(client, job["id"], {"succeeded", "failed"}, timeout=180)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 2
    assert [m["epoch"] for m in done["metrics"]] == list(range(1, epochs + 1))
    # Continued after its last finished epoch (one more may have been saved just before the kill).
    assert done["resumed_from_epoch"] in (killed_after, killed_after + 1)
    assert f"resumes after epoch {done['resumed_from_epoch']}" in procs.log(second)
    assert "resumes after" not in procs.log(first)

    events = _events(client, job["id"])
    assert events.count("resumed") == 1
    body = client.get(f"/jobs/{job['id']}/checkpoint").content
    assert hashlib.sha256(body).hexdigest() == done["checkpoint"]["sha256"]


def test_a_job_has_the_cores_and_the_predict_forward_takes_them_back(own_stack: dict) -> None:
    """One OpenMP team at a time (worker/device/cpu_threads.py): a CPU worker's /predict forward runs on its
    threads while no job runs, on one while a job does, and on its threads again after."""
    client, procs = own_stack["client"], own_stack["procs"]
    procs.worker("cpu", TORCHYARD_PREDICT_CPU_THREADS="2")
    wait_until(lambda: client.get("/readyz").status_code == 200, timeout=90, what="a worker heartbeat")
    wait_until(lambda: _forward_threads(client) == 2, timeout=10, what="the forward on its 2 threads")
    job = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 500, "patience": 0}).json()
    wait_until(lambda: client.get(f"/jobs/{job['id']}").json()["progress"]["step"] > 0, timeout=60,
               what="the job to be training")
    wait_until(lambda: _forward_threads(client) == 1, timeout=10, what="the forward to leave the cores to the job")
    assert client.post(f"/jobs/{job['id']}/cancel").status_code == 202
    assert wait_for_job(client, job["id"], {"cancelled", "failed", "succeeded"}, timeout=30)["status"] == "cancelled"
    wait_until(lambda: _forward_threads(client) == 2, timeout=10, what="the forward to take the cores back")
