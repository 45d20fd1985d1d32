"""Small traps of hostile or unlucky input, through the real stack: a last training batch of one image in a
BatchNorm net, a job whose memory fits no worker, and deleting a trained job with its files."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from tests.support import png_bytes, wait_for_job

pytestmark = pytest.mark.e2e


def _two_class_zip(total: int) -> bytes:
    rng = np.random.default_rng(13)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for i in range(total):
            label = i % 2
            pixels = rng.integers(0, 60, (32, 32, 3), dtype=np.uint8)
            pixels[..., label] += 150  # red or green: learnable
            archive.writestr(f"{'red' if label == 0 else 'green'}/{i:03d}.png", png_bytes(pixels))
    return buffer.getvalue()


def test_a_last_batch_of_one_image_trains_a_batchnorm_net_and_the_job_deletes_cleanly(stack: dict) -> None:
    client = stack["client"]
    uploaded = client.post("/datasets", files={"file": ("rg.zip", _two_class_zip(143), "application/zip")})
    assert uploaded.status_code == 201 and uploaded.json()["num_images"] == 143
    dataset = uploaded.json()["id"]
    # 143 images, 10% for validation (14): 129 to train, in batches of 128 → a last batch of 1,
    # which BatchNorm cannot train on ("Expected more than 1 value per channel").
    job = client.post("/jobs", json={"model": "resnet18", "dataset": dataset, "epochs": 2, "batch_size": 128,
                                     "val_fraction": 0.1}).json()
    done = wait_for_job(client, job["id"], {"succeeded", "failed"}, timeout=240)
    assert done["status"] == "succeeded", done["error"]
    assert done["progress"]["steps"] == 1  # the lone last image sits this epoch out

    # A validation fraction that leaves nothing to train on: refused at submit, not a crash later.
    none_left = client.post("/jobs", json={"model": "cifar_net", "dataset": dataset, "val_fraction": 0.999})
    assert none_left.status_code == 422 and "no training image" in none_left.json()["detail"]

    # Deleting the finished job takes its record, events, checkpoint and directory.
    job_dir = stack["data_dir"] / "checkpoints" / job["id"]
    assert (job_dir / "model.pt").exists()
    assert client.delete(f"/jobs/{job['id']}").status_code == 204
    assert not job_dir.exists()
    assert client.get(f"/jobs/{job['id']}").status_code == 404
    assert client.get(f"/jobs/{job['id']}/checkpoint").status_code == 404
    gone = client.post("/predict", data={"job_id": job["id"]}, files={"file": ("a.png", png_bytes(
        np.zeros((32, 32, 3), dtype=np.uint8)), "image/png")})
    assert gone.status_code == 404
    assert client.delete(f"/datasets/{dataset}").status_code in (204, 409)  # 409: given to a job a moment ago


def test_a_job_that_fits_no_worker_is_refused_with_what_would_fit(stack: dict) -> None:
    client = stack["client"]
    before = client.get("/jobs").json()["jobs"]
    # ResNet-18 at 512×512 in batches of 8192 holds hundreds of GB of activations: no host here has that.
    refused = client.post("/jobs", json={"model": "resnet18", "dataset": "fake", "image_size": 512,
                                         "batch_size": 8192})
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"]
    assert "does not fit in memory" in detail and "TORCHYARD_ADMISSION_HEADROOM" in detail
    assert "batch_size up to" in detail or "image_size up to" in detail
    assert client.get("/jobs").json()["jobs"] == before  # nothing was queued
    # The suggestion is admitted (the worker reports its RAM in /devices, the check reads the same).
    device = client.get("/devices").json()["devices"][0]
    assert device["host_memory_total_bytes"] > 0
