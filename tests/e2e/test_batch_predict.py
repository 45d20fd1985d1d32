"""Batch predictions through the real API and worker: an unlabelled zip of PNG and JPEG images and a
labelled upload labelled by a trained model, lines that match /predict, a file that no longer
decodes, progress events, cancel, a worker SIGKILLed mid-job whose redelivery resumes (every file
exactly once, in order), deletion of the results, and the 4xx of every refusal."""

from __future__ import annotations

import io
import json
import signal
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.datagen import shapes_zip
from tests.support import own_api, wait_for_job, wait_until

pytestmark = pytest.mark.e2e

TERMINAL = {"succeeded", "failed", "cancelled"}


def _images_zip(n: int, seed: int = 0, size: int = 40) -> tuple[bytes, list[str]]:
    """An unlabelled zip: PNG and JPEG images in a couple of folders (real encodings), and their sorted paths."""
    rng = np.random.default_rng(seed)
    buffer, names = io.BytesIO(), []
    with zipfile.ZipFile(buffer, "w") as archive:
        for k in range(n):
            fmt, ext = ("JPEG", "jpg") if k % 4 == 0 else ("PNG", "png")
            name = f"{'holiday/day2/' if k % 3 == 0 else ''}img{k:05d}.{ext}"
            out = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(out, format=fmt, quality=90)
            archive.writestr(name, out.getvalue())
            names.append(name)
    return buffer.getvalue(), sorted(names)


def _upload(client: httpx.Client, data: bytes, *, labels: str | None = "none") -> dict:
    form = {"name": f"set-{uuid.uuid4().hex[:6]}", **({"labels": labels} if labels else {})}
    answer = client.post("/datasets", data=form, files={"file": ("images.zip", data, "application/zip")})
    assert answer.status_code == 201, answer.text
    return answer.json()


def _predict(client: httpx.Client, dataset: str, job_id: str, **fields) -> dict:
    answer = client.post("/jobs", json={"kind": "predict", "job_id": job_id, "dataset": dataset, **fields})
    assert answer.status_code == 202, answer.text
    return answer.json()


def _lines(client: httpx.Client, job_id: str) -> list[dict]:
    answer = client.get(f"/jobs/{job_id}/results")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/x-ndjson")
    assert answer.headers["content-disposition"].startswith("attachment")
    return [json.loads(line) for line in answer.text.splitlines()]


def _events(client: httpx.Client, job_id: str) -> list[tuple[str, dict]]:
    events, kind = [], None
    with client.stream("GET", f"/jobs/{job_id}/events") as stream:
        for line in stream.iter_lines():
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and kind:
                events.append((kind, json.loads(line.split(":", 1)[1])))
                if kind == "status" and events[-1][1].get("status") in TERMINAL:
                    break
    return events


def test_an_unlabeled_zip_is_labelled_like_predict_does_it(stack: dict, cifar_pair: tuple[str, str]) -> None:
    client, model_job = stack["client"], cifar_pair[0]
    data, names = _images_zip(30)
    dataset = _upload(client, data)
    assert dataset["labeled"] is False and dataset["classes"] is None and dataset["num_images"] == 30
    # A file damaged on the server's disk after the upload decodes no more: its line says so.
    broken = names[7]
    (stack["data_dir"] / "datasets" / dataset["id"] / broken).write_bytes(b"\x89PNG\r\n\x1a\nbroken")

    job = _predict(client, dataset["name"], model_job, top_k=3, batch_size=8)
    assert job["kind"] == "predict" and job["status"] == "queued" and job["dataset"] == dataset["id"]
    assert client.get(f"/jobs/{job['id']}/results").status_code == 409  # not succeeded yet
    done = wait_for_job(client, job["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    summary = done["results"]
    assert summary["images"] == 30 and summary["errors"] == 1 and summary["top_k"] == 3
    assert summary["labeled"] is False and summary["trained_job"] == model_job
    assert done["progress"]["images_done"] == done["progress"]["images_total"] == 30

    lines = _lines(client, job["id"])
    assert [line["file"] for line in lines] == names  # every file once, in the sorted order
    bad = lines[7]
    assert set(bad) == {"file", "error"} and "cannot decode image" in bad["error"]
    for line in lines[:7] + lines[8:]:
        assert set(line) == {"file", "predictions"} and len(line["predictions"]) == 3
        probabilities = [p["probability"] for p in line["predictions"]]
        assert probabilities == sorted(probabilities, reverse=True)

    # The same image through /predict: the same top-k, the same probabilities (to 1e-5).
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for k in (0, 1, 3):  # a JPEG in a folder, a PNG at the top, another folder's image
            name = names[k]
            answer = client.post("/predict", data={"job_id": model_job, "top_k": "3"},
                                 files={"file": (Path(name).name, archive.read(name), "application/octet-stream")})
            assert answer.status_code == 200, answer.text
            expected = answer.json()["results"][0]["predictions"]
            got = lines[k]["predictions"]
            assert [p["index"] for p in got] == [p["index"] for p in expected]
            assert [p["label"] for p in got] == [p["label"] for p in expected]
            for mine, theirs in zip(got, expected, strict=True):
                assert mine["probability"] == pytest.approx(theirs["probability"], abs=1e-5)

    events = _events(client, job["id"])
    progress = [e for kind, e in events if kind == "progress"]
    assert progress and progress[-1]["images_done"] == 30 and progress[-1]["images_per_second"] > 0
    assert ("results", summary) in events

    # Unlabelled images cannot train or be evaluated on: there are no classes.
    refused = client.post("/jobs", json={"model": "cifar_net", "dataset": dataset["id"]})
    assert refused.status_code == 422 and "unlabelled" in refused.json()["detail"]
    refused = client.post(f"/jobs/{model_job}/evaluate", json={"dataset": dataset["id"]})
    assert refused.status_code == 422 and "unlabelled" in refused.json()["detail"]

    # Deleting the job deletes its results.
    results_file = stack["data_dir"] / "checkpoints" / job["id"] / "results.jsonl"
    assert results_file.exists()
    assert client.delete(f"/jobs/{job['id']}").status_code == 204
    assert not results_file.exists() and client.get(f"/jobs/{job['id']}/results").status_code == 404


def test_a_labelled_dataset_by_alias_carries_the_true_labels(stack: dict, cifar_pair: tuple[str, str]) -> None:
    client, model_job = stack["client"], cifar_pair[1]
    dataset = _upload(client, shapes_zip(per_class=4, seed=3), labels=None)
    assert dataset["labeled"] is True
    alias = f"batch-{uuid.uuid4().hex[:6]}"
    assert client.put(f"/aliases/{alias}", json={"job_id": model_job}).status_code in (200, 201)
    answer = client.post("/jobs", json={"kind": "predict", "alias": alias, "dataset": dataset["id"], "top_k": 1})
    assert answer.status_code == 202, answer.text
    done = wait_for_job(client, answer.json()["id"], TERMINAL)
    assert done["status"] == "succeeded", done["error"]
    assert done["params"]["trained_job"] == model_job and done["results"]["alias"] == alias
    lines = _lines(client, done["id"])
    assert len(lines) == 12 and [line["file"] for line in lines] == sorted(line["file"] for line in lines)
    assert all(line["label"] == line["file"].split("/")[0] and len(line["predictions"]) == 1 for line in lines)
    top1 = sum(line["predictions"][0]["label"] == line["label"] for line in lines) / len(lines)
    assert done["results"]["labeled"] is True and done["results"]["accuracy"] == pytest.approx(top1)


def test_refusals_and_cancel(stack: dict, cifar_pair: tuple[str, str]) -> None:
    client, model_job = stack["client"], cifar_pair[0]
    dataset = _upload(client, _images_zip(4)[0])
    base = {"kind": "predict", "job_id": model_job, "dataset": dataset["id"]}
    cases = [
        ({**base, "job_id": "nonexistent0"}, 404),
        ({"kind": "predict", "alias": "no-such-alias", "dataset": dataset["id"]}, 404),
        ({"kind": "predict", "dataset": dataset["id"]}, 422),  # neither job_id nor alias
        ({**base, "alias": "x"}, 422),  # both
        ({**base, "top_k": 11}, 422),  # cifar_net on fake has 10 classes
        ({**base, "top_k": 0}, 422),
        ({**base, "dataset": "no-such-set"}, 422),
        ({**base, "dataset": "fake"}, 422),  # built in: no files to label
        ({**base, "device": "cuda:7"}, 422),
        ({**base, "epochs": 3}, 422),  # a training field
        ({**base, "kind": "evaluate"}, 422),
    ]
    for body, status in cases:
        answer = client.post("/jobs", json=body)
        assert answer.status_code == status, (body, answer.text)
    # Another body under a used Idempotency-Key, a batch prediction's and an evaluation's: 422 naming the first job.
    for path, body, other in (("/jobs", {**base, "top_k": 1}, {**base, "top_k": 2}),
                              (f"/jobs/{model_job}/evaluate", {"dataset": "fake"}, {"dataset": "fake", "batch_size": 64})):
        key = {"Idempotency-Key": f"used-for-{path}"}
        first, again, different = (client.post(path, json=b, headers=key) for b in (body, body, other))
        assert first.status_code == 202 and again.status_code == 200 and again.json()["id"] == first.json()["id"], (
            f"{path}: a retry of the same body under its key did not get the first job: {again.text[:200]}")
        assert different.status_code == 422 and first.json()["id"] in different.json()["detail"], (
            f"{path}: another body under a used Idempotency-Key must be a 422 naming the first job, not "
            f"{different.status_code} {different.text[:200]}")
        client.post(f"/jobs/{first.json()['id']}/cancel")  # queued: it ends at once, the worker stays free
    queued = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()
    client.post(f"/jobs/{queued['id']}/cancel")
    unfinished = client.post("/jobs", json={**base, "job_id": queued["id"]})
    assert unfinished.status_code == 409 and "no checkpoint" in unfinished.json()["detail"]
    evaluation = client.post(f"/jobs/{model_job}/evaluate", json={"dataset": "fake"}).json()
    assert client.post("/jobs", json={**base, "job_id": evaluation["id"]}).status_code == 422
    assert client.get("/jobs/nonexistent0/results").status_code == 404
    assert client.get(f"/jobs/{model_job}/results").status_code == 404  # a training job has none

    # Cancel while it runs: it stops between batches, and there are no results.
    # 6,000 images one at a time: seconds of work even on the fastest host seen, where a quarter of
    # that ended not far past its first recorded progress (docs/benchmarks.md has the figures).
    big = _upload(client, _images_zip(6000, seed=5, size=32)[0])
    job = _predict(client, big["id"], model_job, batch_size=1)
    wait_until(lambda: 0 < (client.get(f"/jobs/{job['id']}").json()["progress"].get("images_done") or 0) < 6000,
               timeout=120, what="the predict job under way")
    assert client.post(f"/jobs/{job['id']}/cancel").status_code == 202
    cancelled = wait_for_job(client, job["id"], TERMINAL)
    assert cancelled["status"] == "cancelled", cancelled
    assert client.get(f"/jobs/{job['id']}/results").status_code == 409
    assert not (stack["data_dir"] / "checkpoints" / job["id"]).joinpath("results.jsonl").exists()


@pytest.fixture
def own(clean_redis_url: str, tmp_path: Path) -> Iterator[dict]:
    """An API of its own with short leases; workers started (and killed) by the test."""
    with own_api(clean_redis_url, tmp_path, TORCHYARD_LEASE_TTL_S="2") as stack:
        yield stack


def test_a_worker_killed_mid_job_is_resumed_and_every_file_is_there_once(own: dict) -> None:
    procs, client = own["procs"], own["client"]
    first = procs.worker("cpu", name="pk1", TORCHYARD_NODE_NAME="pk1")
    trained = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()
    assert wait_for_job(client, trained["id"], TERMINAL, timeout=240)["status"] == "succeeded"
    data, names = _images_zip(6000, seed=9, size=32)  # seconds of work at batch 1, on the fastest host seen
    dataset = _upload(client, data)
    job = _predict(client, dataset["id"], trained["id"], batch_size=1, top_k=2)

    def under_way() -> dict | None:
        record = client.get(f"/jobs/{job['id']}").json()
        done = record["progress"].get("images_done") or 0
        return record if record["status"] == "running" and 0 < done < len(names) else None

    before = wait_until(under_way, timeout=120, interval=0.05, what="a recorded resume point")
    procs.stop(first, signal.SIGKILL)
    procs.worker("cpu", name="pk2", TORCHYARD_NODE_NAME="pk2")
    done = wait_for_job(client, job["id"], TERMINAL, timeout=240)
    assert done["status"] == "succeeded" and done["attempts"] == 2, done
    resumed_from = done["results"]["resumed_from_image"]
    assert resumed_from is not None and resumed_from >= before["progress"]["images_done"]
    lines = _lines(client, job["id"])
    assert [line["file"] for line in lines] == names  # each input exactly once, in order
    assert all(len(line["predictions"]) == 2 for line in lines)
    kinds = [kind for kind, _ in _events(client, job["id"])]
    assert "resumed" in kinds


def test_the_cli_labels_a_local_folder(stack: dict, cifar_pair: tuple[str, str], tmp_path: Path) -> None:
    """`torchyard predict-folder --job J DIR`: zipped and uploaded unlabelled, followed, saved as JSON lines."""
    from tests.e2e.test_cli import cli

    data, names = _images_zip(12, seed=21)
    folder = tmp_path / "photos"
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        archive.extractall(folder)
    out = tmp_path / "labels.jsonl"
    shown = cli(stack, "predict-folder", "--job", cifar_pair[0], str(folder), "--top-k", "2", "-o", str(out))
    assert shown.returncode == 0, shown.stderr
    assert f"saved {out}: 12 images, 0 unreadable" in shown.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["file"] for line in lines] == names and all(len(line["predictions"]) == 2 for line in lines)
    missing = cli(stack, "predict-folder", "--job", "nonexistent0", "--dataset", "fake")
    assert missing.returncode != 0 and "nonexistent0" in missing.stderr
