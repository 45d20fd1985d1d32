"""Uploaded ImageFolder zips over HTTP: what is accepted, what is refused, and that the seed
architectures learn from them through the real worker."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import torch

from tests.datagen import SHAPE_CLASSES, bomb_zip, png, shapes_zip, symlink_zip, zip_of
from tests.support import hold_flock, wait_for_job, wait_until

pytestmark = pytest.mark.e2e


def _upload(client, data: bytes, name: str | None = None):
    form = {"name": name} if name else {}
    return client.post("/datasets", files={"file": ("data.zip", data, "application/zip")}, data=form)


def _tree(root: Path) -> set[Path]:
    return set(root.rglob("*")) if root.exists() else set()


def test_upload_train_cifar_net_and_resnet18(stack: dict) -> None:
    client = stack["client"]
    created = _upload(client, shapes_zip(per_class=100, seed=1), name="shapes")
    assert created.status_code == 201, created.text
    ds = created.json()
    assert ds["name"] == "shapes" and ds["classes"] == list(SHAPE_CLASSES)
    assert ds["num_images"] == 300 and ds["class_counts"] == dict.fromkeys(SHAPE_CLASSES, 100)
    assert [s["path"] for s in ds["skipped"]] == ["shapes/circle/broken.png"] and ds["skipped"][0]["reason"]
    assert client.get(f"/datasets/{ds['id']}").json()["num_images"] == 300
    listed = [d["id"] for d in client.get("/datasets").json()["datasets"]]
    assert {"fake", "cifar10", "mnist", "fashion_mnist", ds["id"]} <= set(listed)

    small = client.post("/jobs", json={"model": "cifar_net", "dataset": ds["id"], "epochs": 12,
                                       "batch_size": 32, "val_fraction": 0.2, "seed": 1})
    assert small.status_code == 202, small.text
    # A queued or running job holds the dataset.
    held = client.delete(f"/datasets/{ds['id']}")
    assert held.status_code == 409 and "job" in held.json()["detail"]
    resnet = client.post("/jobs", json={"model": "resnet18", "dataset": ds["id"], "epochs": 4,
                                        "batch_size": 32, "val_fraction": 0.2, "seed": 1}).json()

    for job_id, model in ((small.json()["id"], "cifar_net"), (resnet["id"], "resnet18")):
        done = wait_for_job(client, job_id, {"succeeded", "failed"}, timeout=240)
        assert done["status"] == "succeeded", done["error"]
        assert done["classes"] == list(SHAPE_CLASSES)
        assert done["metrics"][-1]["val_accuracy"] >= 0.9, (model, done["metrics"])
        assert done["params"]["image_size"] == 32 and done["params"]["val_fraction"] == 0.2
        body = client.get(f"/jobs/{job_id}/checkpoint").content
        assert hashlib.sha256(body).hexdigest() == done["checkpoint"]["sha256"]
        assert len(body) == done["checkpoint"]["bytes"]
        meta = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)["meta"]
        assert meta["architecture"] == model and meta["classes"] == list(SHAPE_CLASSES)
        assert meta["preprocessing"]["channels"] == 3 and len(meta["preprocessing"]["mean"]) == 3

    deleted = client.delete(f"/datasets/{ds['id']}")
    if deleted.status_code == 409:  # both jobs ended inside the grace that covers a submission in flight
        assert "just given to a new job" in deleted.json()["detail"]
        deleted = wait_until(lambda: (r := client.delete(f"/datasets/{ds['id']}")).status_code != 409 and r,
                             timeout=15, interval=0.5, what="the end of the dataset's in-use grace")
    assert deleted.status_code == 204
    assert client.get(f"/datasets/{ds['id']}").status_code == 404
    assert not (stack["data_dir"] / "datasets" / ds["id"]).exists()


def test_grayscale_architecture_on_colour_upload(stack: dict) -> None:
    """catdog_net takes 1×50×50: colour uploads are converted, and the checkpoint says so."""
    client = stack["client"]
    ds = _upload(client, shapes_zip(per_class=20, seed=2, corrupt=None, top_folder=None)).json()
    job = client.post("/jobs", json={"model": "catdog_net", "dataset": ds["id"], "epochs": 1}).json()
    done = wait_for_job(client, job["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]
    meta = torch.load(io.BytesIO(client.get(f"/jobs/{job['id']}/checkpoint").content),
                      map_location="cpu", weights_only=True)["meta"]
    pre = meta["preprocessing"]
    assert (pre["channels"], pre["height"], pre["width"]) == (1, 50, 50) and len(pre["mean"]) == 1


def test_a_job_waiting_for_a_stuck_decode_is_cancelled_through_the_api(stack: dict) -> None:
    """Another worker holds the set's decode lock and never lets go (stuck mid-decode; here a process
    that takes the flock and sleeps). The job that waits for it is cancelled through the API and ends
    `cancelled` while the lock is still held; the worker then takes the next job on that set."""
    client, procs, worker = stack["client"], stack["procs"], stack["worker"]
    ds = _upload(client, shapes_zip(per_class=6, seed=3, corrupt=None)).json()
    lock = stack["data_dir"] / "datasets" / f".{ds['id']}.cache" / "3x32x32.lock"  # cifar_net's spec
    holder = hold_flock(lock)
    try:
        job = client.post("/jobs", json={"model": "cifar_net", "dataset": ds["id"], "epochs": 1}).json()
        waiting = f"waiting for another worker's decode of dataset {ds['id']} at 3x32x32"
        wait_until(lambda: waiting in procs.log(worker), timeout=120, what="the job to wait for the set's lock")
        assert client.get(f"/jobs/{job['id']}").json()["status"] == "running"
        assert client.post(f"/jobs/{job['id']}/cancel").status_code == 202
        stopped = wait_for_job(client, job["id"], {"cancelled", "succeeded", "failed"}, timeout=60)
        assert stopped["status"] == "cancelled" and stopped["metrics"] == [] and stopped["checkpoint"] is None
        assert holder.poll() is None  # still held: the job did not wait for its release
    finally:
        holder.kill()
        holder.communicate()
    after = client.post("/jobs", json={"model": "cifar_net", "dataset": ds["id"], "epochs": 1}).json()
    assert wait_for_job(client, after["id"], {"succeeded", "failed"})["status"] == "succeeded"


def test_unsafe_and_unusable_zips_are_refused(stack: dict) -> None:
    client = stack["client"]
    data_dir: Path = stack["data_dir"]
    outside = data_dir.parent
    before_outside = set(outside.iterdir())
    before_datasets = _tree(data_dir / "datasets")
    image = png(torch.zeros(8, 8, 3, dtype=torch.uint8).numpy())

    cases = {
        "traversal": zip_of({"cls/ok.png": image, "../../escaped.png": image, "cls/../../../escaped.png": image}),
        "absolute": zip_of({"cls/ok.png": image, "/tmp/torchyard-absolute.png": image}),
        "symlink": symlink_zip(),
        "bomb": bomb_zip(),
        "no class": zip_of({"readme.txt": b"hello"}),
        "only corrupt": zip_of({"cls/a.png": b"garbage"}),
        "not a zip": b"this is not a zip file",
    }
    for what, data in cases.items():
        response = _upload(client, data)
        assert 400 <= response.status_code < 500, (what, response.status_code, response.text)
        assert response.json()["detail"], what

    assert set(outside.iterdir()) == before_outside
    assert not list(outside.rglob("escaped.png"))
    assert not Path("/tmp/torchyard-absolute.png").exists()
    assert _tree(data_dir / "datasets") == before_datasets  # nothing left behind, not even empty folders
    assert client.post("/datasets", data={"name": "x"}).status_code == 415  # a form without a file: not multipart
