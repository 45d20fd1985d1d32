"""Evaluations and datasets by name, through the real API, worker and CLI: a job trained on an
upload named at submit, its validation confusion matrix, an evaluation job on the same data, the
evaluation's record on the job, the CLI's rendering, and the 4xx of every refusal."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.datagen import SHAPE_CLASSES, shapes_zip
from tests.e2e.test_cli import cli
from tests.support import wait_for_job

pytestmark = pytest.mark.e2e


def _upload(client, name: str, seed: int = 0) -> dict:
    answer = client.post("/datasets", data={"name": name},
                         files={"file": ("shapes.zip", shapes_zip(per_class=30, seed=seed), "application/zip")})
    assert answer.status_code == 201, answer.text
    return answer.json()


def _consistent(result: dict) -> None:
    matrix = result["confusion_matrix"]
    assert len(matrix) == len(result["classes"]) and all(len(row) == len(matrix) for row in matrix)
    assert sum(map(sum, matrix)) == result["num_images"]
    assert result["accuracy"] == pytest.approx(sum(matrix[k][k] for k in range(len(matrix))) / result["num_images"],
                                               abs=1e-6)
    for k, name in enumerate(result["classes"]):
        if sum(matrix[k]):
            assert result["per_class_accuracy"][name] == pytest.approx(matrix[k][k] / sum(matrix[k]), abs=1e-4)


def test_train_by_name_and_evaluate(stack: dict) -> None:
    client = stack["client"]
    name = f"shapes-{uuid.uuid4().hex[:6]}"
    uploaded = _upload(client, name)
    submitted = client.post("/jobs", json={"model": "cifar_net", "dataset": name, "epochs": 3, "batch_size": 16})
    assert submitted.status_code == 202, submitted.text
    job = submitted.json()
    assert job["dataset"] == uploaded["id"] and job["dataset_name"] == name  # the id is recorded, the name shown
    done = wait_for_job(client, job["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]
    assert done["stop_reason"] == "completed 3 epochs" and 1 <= done["best_epoch"] <= 3
    assert done["params"]["keep"] == "best" and done["params"]["optimizer"] == "adamw"
    validation = done["evaluation"]  # the kept weights on the validation split
    assert validation["split"] == "validation" and validation["epoch"] == done["best_epoch"]
    assert validation["classes"] == list(SHAPE_CLASSES) and validation["num_images"] == 9
    _consistent(validation)
    assert done["metrics"][-1]["confusion_matrix"] is not None and done["metrics"][0]["confusion_matrix"] is None
    best = done["metrics"][done["best_epoch"] - 1]
    assert validation["accuracy"] == best["val_accuracy"] and validation["loss"] == best["val_loss"]

    answer = client.post(f"/jobs/{job['id']}/evaluate", json={"dataset": name})
    assert answer.status_code == 202, answer.text
    evaluation = answer.json()
    assert answer.headers["location"] == f"/jobs/{job['id']}/evaluations/{evaluation['id']}"
    assert evaluation["status"] == "queued" and evaluation["job_id"] == job["id"]
    finished = wait_for_job(client, evaluation["id"], {"succeeded", "failed"})  # a job of its own
    assert finished["status"] == "succeeded", finished["error"]
    assert finished["kind"] == "evaluate" and finished["params"]["trained_job"] == job["id"]
    record = client.get(f"/jobs/{job['id']}/evaluations/{evaluation['id']}").json()
    result = record["result"]
    assert record["status"] == "succeeded" and record["dataset_name"] == name
    assert result["split"] == "all" and result["num_images"] == 90  # every readable image of the upload
    _consistent(result)
    listed = client.get(f"/jobs/{job['id']}").json()["evaluations"]
    assert [e["id"] for e in listed] == [evaluation["id"]] and listed[0]["result"] == result

    # The CLI: the tables by default, the API's JSON with --json.
    shown = cli(stack, "evaluate", job["id"], "--dataset", uploaded["id"])
    assert shown.returncode == 0, shown.stderr
    assert "confusion matrix" in shown.stdout and "Accuracy of circle" in shown.stdout
    assert "2 triangle" in shown.stdout and "all images" in shown.stdout
    as_json = cli(stack, "evaluate", job["id"], "--dataset", name, "--json")
    assert as_json.returncode == 0, as_json.stderr
    parsed = json.loads(as_json.stdout)
    assert parsed["status"] == "succeeded" and parsed["result"]["confusion_matrix"] == result["confusion_matrix"]
    report = cli(stack, "job", job["id"])
    assert "evaluations" in report.stdout and "validation split" in report.stdout and name in report.stdout

    # Refusals, each saying why.
    other_classes = client.post(f"/jobs/{job['id']}/evaluate", json={"dataset": "fake"})
    assert other_classes.status_code == 422 and "pattern_0" in other_classes.json()["detail"]
    taken = client.post("/datasets", data={"name": name},  # a name means one set (versions: test_dataset_names.py)
                        files={"file": ("shapes.zip", shapes_zip(per_class=30, seed=1), "application/zip")})
    assert taken.status_code == 409 and uploaded["id"] in taken.json()["detail"]
    assert client.post(f"/jobs/{job['id']}/evaluate", json={"dataset": "no-such-set"}).status_code == 422
    assert client.post("/jobs/nonexistent/evaluate", json={"dataset": "fake"}).status_code == 404
    assert client.get(f"/jobs/{job['id']}/evaluations/{job['id']}").status_code == 404
    assert client.post(f"/jobs/{evaluation['id']}/evaluate", json={"dataset": name}).status_code == 422
    queued = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()
    client.post(f"/jobs/{queued['id']}/cancel")
    unfinished = client.post(f"/jobs/{queued['id']}/evaluate", json={"dataset": "fake"})
    assert unfinished.status_code == 409 and "no checkpoint" in unfinished.json()["detail"]
