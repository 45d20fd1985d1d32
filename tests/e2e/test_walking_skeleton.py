"""The whole product path through real processes: train → checkpoint → predict → devices."""

from __future__ import annotations

import io

import pytest
import torch

from tests.support import png_bytes, wait_for_job
from worker.data.datasets import fake_images

pytestmark = pytest.mark.e2e


def _pattern_png(label: int) -> bytes:
    image = fake_images(torch.tensor([label]), 3, 32, 32, seed=4242)[0]
    return png_bytes(image.permute(1, 2, 0).numpy())


def test_train_predict_and_devices(stack: dict) -> None:
    client = stack["client"]
    created = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 2})
    assert created.status_code == 202, created.text
    job = created.json()
    assert created.headers["location"] == f"/jobs/{job['id']}"
    assert job["status"] == "queued"
    assert job["params"]["learning_rate"] > 0 and job["params"]["epochs"] == 2

    done = wait_for_job(client, job["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]
    assert done["device"].endswith("/cpu")
    assert done["attempts"] == 1
    assert [m["epoch"] for m in done["metrics"]] == [1, 2]
    assert done["metrics"][-1]["val_accuracy"] >= 0.9
    assert done["progress"]["epoch"] == 2 and done["progress"]["step"] == done["progress"]["steps"]
    assert done["params"]["batch_size"] is None  # left open at submit: the device type's, chosen on the worker
    assert done["device_choices"]["batch_size"] == 128 and done["device_choices"]["device"] == "cpu"
    assert done["checkpoint"]["sha256"] and done["checkpoint"]["bytes"] > 0
    assert done["started_at"] and done["finished_at"]

    # The checkpoint downloads and loads safely on a CPU-only process.
    download = client.get(f"/jobs/{job['id']}/checkpoint")
    assert download.status_code == 200
    payload = torch.load(io.BytesIO(download.content), map_location="cpu", weights_only=True)
    assert payload["meta"]["architecture"] == "cifar_net"
    assert payload["meta"]["classes"] == done["classes"]
    assert set(payload["meta"]["preprocessing"]) >= {"channels", "height", "width", "mean", "std"}
    assert "conv1.weight" in payload["state_dict"]

    # An image drawn from class 3's pattern comes back as class 3, twice (the second from the resident model).
    for _ in range(2):
        answer = client.post("/predict", data={"job_id": job["id"], "top_k": "3"},
                             files={"file": ("three.png", _pattern_png(3), "image/png")})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        top = body["results"][0]["predictions"]
        assert top[0]["label"] == done["classes"][3] and top[0]["index"] == 3
        assert len(top) == 3 and top[0]["probability"] >= top[1]["probability"] >= top[2]["probability"]
        assert body["device"] == done["device"] and body["model"] == "cifar_net"

    devices = client.get("/devices").json()["devices"]
    mine = next(d for d in devices if d["id"] == done["device"])
    assert mine["type"] == "cpu" and mine["status"] in ("idle", "busy")
    assert mine["worker"].startswith("cpu@")
    assert mine["memory_total_bytes"] > 0
    assert job["id"] in mine["loaded_models"] or _eventually_loaded(client, done["device"], job["id"])

    listed = client.get("/jobs").json()
    assert any(j["id"] == job["id"] for j in listed["jobs"])


def _eventually_loaded(client, device_id: str, job_id: str) -> bool:
    from tests.support import wait_until

    return wait_until(lambda: job_id in next(d for d in client.get("/devices").json()["devices"]
                                             if d["id"] == device_id)["loaded_models"], timeout=5)


def test_health_and_readiness(stack: dict) -> None:
    client = stack["client"]
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200


def test_events_stream_ends_after_terminal_status(stack: dict) -> None:
    client = stack["client"]
    job = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()
    with client.stream("GET", f"/jobs/{job['id']}/events") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.split(": ", 1)[1] for line in response.iter_lines() if line.startswith("event: ")]
    assert events[0] == "status" and "metrics" in events and events[-1] == "status"
    assert client.get(f"/jobs/{job['id']}").json()["status"] == "succeeded"


def test_predict_errors(stack: dict) -> None:
    client = stack["client"]
    image = {"file": ("x.png", _pattern_png(1), "image/png")}
    assert client.post("/predict", data={"job_id": "nope"}, files=image).status_code == 404
    queued = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 50}).json()
    conflict = client.post("/predict", data={"job_id": queued["id"]}, files=image)
    assert conflict.status_code == 409 and "detail" in conflict.json()
    client.post(f"/jobs/{queued['id']}/cancel")
    not_image = client.post("/predict", data={"job_id": queued["id"]}, files={"file": ("a.txt", b"hello", "text/plain")})
    assert not_image.status_code == 415
