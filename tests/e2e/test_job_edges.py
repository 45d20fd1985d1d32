"""What a job answers when it is asked for what it does not have: the checkpoint of a running job
(409: written when it succeeds), a prediction with an evaluation's id (which job to use instead, and
no server path), and `torchyard delete JOB` with the API's reason when the job must stay. Against
the shared stack."""

from __future__ import annotations

import pytest

from tests.e2e.test_cli import cli
from tests.support import REPO, wait_for_job, wait_until

pytestmark = pytest.mark.e2e

PATTERN_3 = REPO / "examples" / "pattern_3.png"


def test_a_running_job_an_evaluation_and_a_kept_job_say_what_they_are(stack: dict,
                                                                       cifar_pair: tuple[str, str]) -> None:
    client, trained = stack["client"], cifar_pair[0]
    long = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 40}).json()
    wait_for_job(client, long["id"], {"running"}, timeout=120)
    running = client.get(f"/jobs/{long['id']}/checkpoint")
    assert running.status_code == 409, running.text
    assert "still running; its checkpoint is written when it succeeds" in running.json()["detail"]
    # A CPU device's utilisation is its worker's own use of the host's CPUs, busy now ...
    wait_until(lambda: (_cpu_device(client)["utilization_percent"] or 0) > 5, timeout=30, what="a busy CPU device")
    refused = cli(stack, "delete", long["id"])
    assert refused.returncode == 1 and "cancel it first" in refused.stderr, refused.stderr
    assert client.post(f"/jobs/{long['id']}/cancel").status_code == 202

    evaluation = client.post(f"/jobs/{trained}/evaluate", json={"dataset": "fake"}).json()
    assert wait_for_job(client, evaluation["id"], {"succeeded", "failed"})["status"] == "succeeded"
    with PATTERN_3.open("rb") as image:
        predicted = client.post("/predict", data={"job_id": evaluation["id"]}, files={"file": ("p.png", image)})
    detail = predicted.json()["detail"]
    assert predicted.status_code == 409 and f"is an evaluation of job {trained}" in detail, detail
    assert "training job" in detail and "/" not in detail.replace("N/A", ""), detail  # no server path
    by_cli = cli(stack, "predict", "--job", evaluation["id"], str(PATTERN_3))
    assert by_cli.returncode == 1 and f"evaluation of job {trained}" in by_cli.stderr
    weights = client.get(f"/jobs/{evaluation['id']}/checkpoint")
    assert weights.status_code == 404 and f"an evaluation of job {trained}" in weights.json()["detail"]

    aliased = client.put("/aliases/edges-kept", json={"job_id": evaluation["id"]})
    assert aliased.status_code == 409 and f"is an evaluation of job {trained}" in aliased.json()["detail"]
    assert client.put("/aliases/edges-kept", json={"job_id": trained}).status_code in (200, 201)
    try:
        kept = cli(stack, "delete", trained)
        assert kept.returncode == 1 and "alias" in kept.stderr and "(409)" in kept.stderr, kept.stderr
    finally:
        client.delete("/aliases/edges-kept")
    assert client.get(f"/jobs/{trained}").status_code == 200

    for job_id in (evaluation["id"], long["id"]):
        wait_for_job(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=120)
        deleted = cli(stack, "delete", job_id)
        assert deleted.returncode == 0 and f"job {job_id} deleted" in deleted.stdout, deleted.stderr
        assert client.get(f"/jobs/{job_id}").status_code == 404

    # ... and near nothing once it is idle, however busy the host is with other programs.
    wait_until(lambda: (d := _cpu_device(client))["status"] == "idle" and d["utilization_percent"] < 30, timeout=60,
               what="an idle CPU device to show its own, idle use")


def _cpu_device(client) -> dict:
    return next(d for d in client.get("/devices").json()["devices"] if d["type"] == "cpu" and d["status"] != "offline")
