"""Starting from weights, through the real API and worker: `init_from` a finished job (the goal:
one low-learning-rate epoch lands near the parent, a fresh net does not), a new head for other
classes, `pretrained` torchvision weights read from the hub cache under the data dir, and the
422s that say why a start is refused."""

from __future__ import annotations

import io

import pytest
import torch
import torchvision

from tests.datagen import shapes_zip
from tests.support import REPO, wait_for_job

pytestmark = pytest.mark.e2e


def _checkpoint(client, job_id: str) -> dict:
    return torch.load(io.BytesIO(client.get(f"/jobs/{job_id}/checkpoint").content), map_location="cpu",
                      weights_only=True)


def test_init_from_lands_near_its_parent(stack: dict) -> None:
    client = stack["client"]
    parent = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 3, "seed": 5}).json()
    parent = wait_for_job(client, parent["id"], {"succeeded", "failed"})
    assert parent["status"] == "succeeded", parent["error"]
    low = {"model": "cifar_net", "dataset": "fake", "epochs": 1, "seed": 5, "learning_rate": 1e-5,
           "schedule": "constant"}
    child = client.post("/jobs", json={**low, "init_from": parent["id"]})
    assert child.status_code == 202, child.text
    fresh = client.post("/jobs", json=low).json()
    child = wait_for_job(client, child.json()["id"], {"succeeded", "failed"})
    fresh = wait_for_job(client, fresh["id"], {"succeeded", "failed"})
    assert child["status"] == fresh["status"] == "succeeded", (child["error"], fresh["error"])
    parent_accuracy = parent["evaluation"]["accuracy"]
    assert abs(child["evaluation"]["accuracy"] - parent_accuracy) <= 0.03, (child["evaluation"], parent_accuracy)
    assert fresh["evaluation"]["accuracy"] < parent_accuracy - 0.3  # one low-lr epoch from scratch cannot

    assert child["params"]["init_from"] == parent["id"]
    meta = _checkpoint(client, child["id"])["meta"]
    assert meta["lineage"]["init_from"] == parent["id"] and meta["lineage"]["head"] == "kept"
    assert meta["lineage"]["init_from_sha256"] == parent["checkpoint"]["sha256"]
    assert meta["preprocessing"]["mean"] == _checkpoint(client, parent["id"])["meta"]["preprocessing"]["mean"]

    # Other classes: a new head, the rest kept.
    upload = client.post("/datasets", files={"file": ("s.zip", shapes_zip(per_class=20), "application/zip")}).json()
    other = client.post("/jobs", json={"model": "cifar_net", "dataset": upload["id"], "epochs": 1,
                                       "init_from": parent["id"]}).json()
    other = wait_for_job(client, other["id"], {"succeeded", "failed"})
    assert other["status"] == "succeeded", other["error"]
    assert _checkpoint(client, other["id"])["meta"]["lineage"]["head"] == "reinitialised"

    refusals = {
        "does not exist": {"init_from": "nosuchjob"},
        "the architecture must be the same": {"model": "catdog_net", "init_from": parent["id"]},
        "not both": {"init_from": parent["id"], "pretrained": True},
        "has no pretrained weights": {"pretrained": True},
    }
    for reason, change in refusals.items():
        answer = client.post("/jobs", json={**low, **change})
        assert answer.status_code == 422 and reason in answer.json()["detail"], (reason, answer.text)
    cancelled = client.post("/jobs", json={**low, "epochs": 1}).json()
    client.post(f"/jobs/{cancelled['id']}/cancel")
    answer = client.post("/jobs", json={**low, "init_from": cancelled["id"]})
    assert answer.status_code == 422 and "only a succeeded job" in answer.json()["detail"]


def test_pretrained_weights_from_the_hub_cache(stack: dict) -> None:
    client = stack["client"]
    weights = stack["data_dir"] / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    small = client.post("/datasets", files={"file": ("s.zip", shapes_zip(per_class=12), "application/zip")}).json()
    spec = {"model": "resnet18", "dataset": small["id"], "epochs": 1, "pretrained": True, "image_size": 32,
            "learning_rate": 1e-6, "schedule": "constant", "batch_size": 8}
    missing = client.post("/jobs", json=spec)
    assert missing.status_code == 422
    assert str(weights) in missing.json()["detail"] and "TORCHYARD_ALLOW_DOWNLOAD" in missing.json()["detail"]

    # Weights of the right architecture where torchvision's loader looks (the real file cannot be
    # downloaded here); torch.hub reads a cached file as it is.
    torch.manual_seed(7)
    state = torchvision.models.resnet18(weights=None).state_dict()
    weights.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, weights)
    job = client.post("/jobs", json=spec)
    assert job.status_code == 202, job.text
    done = wait_for_job(client, job.json()["id"], {"succeeded", "failed"}, timeout=240)
    assert done["status"] == "succeeded", done["error"]
    assert done["params"]["pretrained"] is True and done["params"]["resize_size"] == 37  # 32 × 256/224
    checkpoint = _checkpoint(client, done["id"])
    meta = checkpoint["meta"]
    assert meta["lineage"] == {"pretrained": "ResNet18_Weights.IMAGENET1K_V1", "file": weights.name,
                               "head": "reinitialised"}
    pre = meta["preprocessing"]
    assert pre["mean"] == pytest.approx([0.485, 0.456, 0.406]) and pre["std"] == pytest.approx([0.229, 0.224, 0.225])
    assert pre["resize_size"] == 37 and "centre crop" in pre["transform"]
    assert torch.allclose(checkpoint["state_dict"]["conv1.weight"], state["conv1.weight"], atol=1e-3)
    assert checkpoint["state_dict"]["fc.weight"].shape == (3, 512)  # a head for the three shapes

    # /predict uses the recorded resize and crop.
    with open(REPO / "examples" / "pattern_3.png", "rb") as image:
        answer = client.post("/predict", data={"job_id": done["id"]}, files={"file": ("p.png", image, "image/png")})
    assert answer.status_code == 200, answer.text
