"""Exports end to end on the shared stack: for every architecture in GET /models, a job trained
for one epoch on a small uploaded dataset is exported as TorchScript and as ONNX through
GET /jobs/{id}/export (202 while a worker builds it, then the file; the second GET from the
cache), and each file is run in a fresh process that cannot import torchyard: TorchScript with
torch alone, ONNX with onnxruntime, numpy and PIL alone (not torch). Their top-1 on PNG files
written here is /predict's, and their probabilities match /predict's within 1e-4."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.datagen import SHAPE_CLASSES, shape_image, shapes_zip
from tests.support import wait_for_job, wait_until

pytestmark = pytest.mark.e2e

FORMATS = ("torchscript", "onnx")

# What a user writes (docs/deploying-models.md): the spec comes from the file, the transform is PIL's.
_PREPROCESS = """
import json, sys
import numpy as np
from PIL import Image

def preprocess(paths, spec):
    _, channels, height, width = spec["shape"]
    batch = []
    for path in paths:
        with Image.open(path) as image:
            image = image.convert(spec["color"])
            if image.size != (width, height):
                image = image.resize((width, height), Image.Resampling.BILINEAR)
            array = np.asarray(image, dtype=np.float32) / 255.0
        batch.append(array.reshape(height, width, channels).transpose(2, 0, 1))
    return np.stack(batch).astype(np.float32)

def softmax(logits):
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)

def ours_not_imported():
    ours = {"app", "core", "worker", "models", "client", "torchyard"}
    assert not ours & {name.split(".")[0] for name in sys.modules}, "torchyard was imported"
"""

_RUN_TORCHSCRIPT = _PREPROCESS + """
import torch
out = {}
for item in json.loads(sys.argv[1]):
    extra = {"torchyard.json": ""}
    model = torch.jit.load(item["file"], map_location="cpu", _extra_files=extra)
    manifest = json.loads(extra["torchyard.json"])
    with torch.no_grad():
        logits = model(torch.from_numpy(preprocess(item["images"], manifest["input"]))).numpy()
    out[item["file"]] = {"classes": manifest["classes"], "probabilities": softmax(logits).tolist()}
ours_not_imported()
print(json.dumps(out))
"""

_RUN_ONNX = _PREPROCESS + """
import onnxruntime
out = {}
for item in json.loads(sys.argv[1]):
    session = onnxruntime.InferenceSession(item["file"], providers=["CPUExecutionProvider"])
    manifest = json.loads(session.get_modelmeta().custom_metadata_map["torchyard"])
    inputs = {session.get_inputs()[0].name: preprocess(item["images"], manifest["input"])}
    logits = session.run(None, inputs)[0]
    out[item["file"]] = {"classes": manifest["classes"], "probabilities": softmax(logits).tolist()}
ours_not_imported()
assert "torch" not in sys.modules, "torch was imported"
print(json.dumps(out))
"""


def _fresh_process(script: str, items: list[dict]) -> dict:
    """`python -I`: no cwd, no PYTHONPATH, no user site on sys.path, so torchyard cannot be found."""
    result = subprocess.run([sys.executable, "-I", "-c", script, json.dumps(items)], capture_output=True, text=True,
                            timeout=300, cwd="/")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _get_export(client: httpx.Client, job_id: str, fmt: str, timeout: float = 300) -> tuple[httpx.Response, list[int]]:
    """Follow the contract: 202 (Location, Retry-After) until the file comes; the statuses seen."""
    statuses = []
    deadline = time.monotonic() + timeout
    while True:
        answer = client.get(f"/jobs/{job_id}/export", params={"format": fmt})
        statuses.append(answer.status_code)
        if answer.status_code != 202:
            return answer, statuses
        assert answer.headers["Location"] == f"/jobs/{answer.json()['id']}" and answer.json()["kind"] == "export"
        assert int(answer.headers["Retry-After"]) >= 1
        assert time.monotonic() < deadline, f"export of {job_id} as {fmt} not ready within {timeout}s"
        time.sleep(0.5)  # faster than Retry-After: the test is in a hurry


@pytest.fixture(scope="module")
def exported(stack: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    client = stack["client"]
    where = tmp_path_factory.mktemp("exports")
    upload = client.post("/datasets", data={"name": "export-shapes"},
                         files={"file": ("shapes.zip", shapes_zip(per_class=12, corrupt=None), "application/zip")})
    assert upload.status_code == 201, upload.text
    models = [m["name"] for m in client.get("/models").json()["models"]]
    submitted = {m: client.post("/jobs", json={"model": m, "dataset": upload.json()["id"], "epochs": 1,
                                               "batch_size": 8, "seed": 1}).json()["id"] for m in models}
    jobs = {m: wait_for_job(client, job_id, {"succeeded", "failed"}, timeout=300) for m, job_id in submitted.items()}
    assert {m: j["status"] for m, j in jobs.items()} == dict.fromkeys(models, "succeeded"), \
        {m: j["error"] for m, j in jobs.items()}

    rng = np.random.default_rng(9)
    images = []
    for k in range(6):  # 40×40 RGB: resized (and made grayscale for catdog_net) on both sides
        path = where / f"{SHAPE_CLASSES[k % 3]}_{k}.png"
        shape_image(SHAPE_CLASSES[k % 3], rng).save(path, format="PNG")
        images.append(str(path))

    results: dict = {"jobs": jobs, "images": images, "files": {}, "first": {}, "second": {}, "predict": {}}
    for model, job in jobs.items():
        files = [("file", (Path(p).name, Path(p).read_bytes(), "image/png")) for p in images]
        answer = client.post("/predict", data={"job_id": job["id"], "top_k": "3"}, files=files)
        assert answer.status_code == 200, answer.text
        results["predict"][model] = answer.json()
        for fmt in FORMATS:
            answer, statuses = _get_export(client, job["id"], fmt)
            assert answer.status_code == 200, (model, fmt, answer.text)
            target = where / f"{model}.{fmt}"
            target.write_bytes(answer.content)
            results["files"][model, fmt] = str(target)
            results["first"][model, fmt] = (statuses, answer.headers)
            results["second"][model, fmt] = client.get(f"/jobs/{job['id']}/export", params={"format": fmt})
    results["torchscript"] = _fresh_process(_RUN_TORCHSCRIPT, [
        {"file": results["files"][m, "torchscript"], "images": images} for m in models])
    results["onnx"] = _fresh_process(_RUN_ONNX, [
        {"file": results["files"][m, "onnx"], "images": images} for m in models])
    return results


def _models(stack_client: httpx.Client) -> list[str]:
    return [m["name"] for m in stack_client.get("/models").json()["models"]]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("model", ["cifar_net", "catdog_net", "resnet18", "mobilenet_v3_small"])
def test_export_runs_without_torchyard_and_agrees_with_predict(exported: dict, model: str, fmt: str) -> None:
    job = exported["jobs"][model]
    statuses, headers = exported["first"][model, fmt]
    assert statuses[0] == 202 and statuses[-1] == 200  # built on a worker, not in the API
    assert headers["X-Checkpoint-SHA256"] == job["checkpoint"]["sha256"]
    second = exported["second"][model, fmt]
    assert second.status_code == 200  # from the cache: the same export job's file
    assert second.headers["X-Export-Job"] == headers["X-Export-Job"]
    assert second.headers["X-Export-SHA256"] == headers["X-Export-SHA256"]

    ran = exported[fmt][exported["files"][model, fmt]]
    assert ran["classes"] == job["classes"] == sorted(SHAPE_CLASSES)
    probabilities = np.array(ran["probabilities"])
    for row, result in enumerate(exported["predict"][model]["results"]):
        top = result["predictions"][0]
        assert int(probabilities[row].argmax()) == top["index"], (model, fmt, result["filename"])
        for p in result["predictions"]:
            assert abs(probabilities[row, p["index"]] - p["probability"]) < 1e-4


def test_every_architecture_is_covered(stack: dict) -> None:
    assert sorted(_models(stack["client"])) == sorted(["cifar_net", "catdog_net", "resnet18", "mobilenet_v3_small"])


def test_export_job_records_its_parity(stack: dict, exported: dict) -> None:
    client = stack["client"]
    _, headers = exported["first"]["resnet18", "onnx"]
    export = client.get(f"/jobs/{headers['X-Export-Job']}").json()
    assert export["kind"] == "export" and export["status"] == "succeeded"
    parity = export["params"]["parity"]
    assert parity["max_abs_probability_difference"] <= parity["tolerance"] == 1e-4
    assert "images of dataset" in parity["inputs_from"] and parity["inputs"] >= 30
    assert export["checkpoint"]["sha256"] == headers["X-Export-SHA256"]


def test_an_export_decodes_only_the_images_it_checks(stack: dict) -> None:
    """The parity check reads PARITY_INPUTS images of the dataset, not the whole set: an upload of
    48 images trained on, its decoded copy (the trainer's cache beside it) removed, then exported:
    the record names 32 images of the dataset, and the whole set was not decoded again (the old
    export loaded every image and wrote that cache back)."""
    client = stack["client"]
    upload = client.post("/datasets", data={"name": "export-bounded"},
                         files={"file": ("s.zip", shapes_zip(per_class=16, seed=5, corrupt=None), "application/zip")})
    assert upload.status_code == 201 and upload.json()["num_images"] == 48, upload.text
    dataset = upload.json()["id"]
    job = client.post("/jobs", json={"model": "cifar_net", "dataset": dataset, "epochs": 1, "batch_size": 8}).json()
    assert wait_for_job(client, job["id"], {"succeeded", "failed"}, timeout=300)["status"] == "succeeded"
    decoded = stack["data_dir"] / "datasets" / f".{dataset}.cache"
    assert decoded.is_dir()
    shutil.rmtree(decoded)
    answer, _ = _get_export(client, job["id"], "torchscript")
    assert answer.status_code == 200, answer.text
    parity = client.get(f"/jobs/{answer.headers['X-Export-Job']}").json()["params"]["parity"]
    assert parity["inputs"] == 32 + 4 and parity["inputs_from"].startswith(f"32 images of dataset {dataset}"), parity
    assert not decoded.exists(), list(decoded.rglob("*"))


def test_export_refusals(stack: dict, exported: dict) -> None:
    client = stack["client"]
    job = exported["jobs"]["cifar_net"]
    assert client.get("/jobs/00000000000000nosuchjob/export", params={"format": "onnx"}).status_code == 404
    assert client.get(f"/jobs/{job['id']}/export", params={"format": "tensorrt"}).status_code == 422
    assert client.get(f"/jobs/{job['id']}/export").status_code == 422
    _, headers = exported["first"]["cifar_net", "onnx"]
    of_an_export = client.get(f"/jobs/{headers['X-Export-Job']}/export", params={"format": "onnx"})
    assert of_an_export.status_code == 409 and "training job" in of_an_export.json()["detail"]
    running = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 200}).json()
    try:
        refused = client.get(f"/jobs/{running['id']}/export", params={"format": "torchscript"})
        assert refused.status_code == 409 and "succeeded" in refused.json()["detail"]
    finally:
        client.post(f"/jobs/{running['id']}/cancel")
    wait_until(lambda: client.get(f"/jobs/{running['id']}").json()["status"] != "running", timeout=60,
               what="the long job to stop")


def test_deleting_a_training_job_deletes_its_exports(stack: dict, exported: dict) -> None:
    """Last in this module: it deletes the catdog_net job the others read. An export is its model in
    another format and nothing else's, so it goes with it (files and records); the job's predict
    results and evaluations are the user's and stay (tests/e2e/test_retention.py)."""
    client = stack["client"]
    job = exported["jobs"]["catdog_net"]
    export_ids = {fmt: exported["first"]["catdog_net", fmt][1]["X-Export-Job"] for fmt in FORMATS}
    checkpoints = stack["data_dir"] / "checkpoints"
    assert all((checkpoints / export_id).is_dir() for export_id in export_ids.values())
    other = exported["first"]["cifar_net", "onnx"][1]["X-Export-Job"]

    assert client.delete(f"/jobs/{job['id']}").status_code == 204
    for fmt, export_id in export_ids.items():
        assert client.get(f"/jobs/{export_id}").status_code == 404, fmt
        assert not (checkpoints / export_id).exists(), fmt
    assert client.get(f"/jobs/{job['id']}/export", params={"format": "onnx"}).status_code == 404
    assert client.get(f"/jobs/{other}").json()["status"] == "succeeded"  # another job's export stays
