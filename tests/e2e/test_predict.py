"""/predict end to end on a stack of our own (real Redis, a real CPU worker, the API as processes):
the service's probabilities equal a user's own forward on the downloaded checkpoint, the
resident-model LRU evicts and reloads, concurrent requests form batches, a training device still
answers, bad input never harms the worker, and a dead worker is a bounded 503.

The worker runs with TORCHYARD_MODEL_CACHE_COUNT=1 so two jobs force evictions, and with a
50 ms batching window so that a burst from a Python client (its requests milliseconds apart) still batches."""

from __future__ import annotations

import io
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from models.registry import build_model
from tests.support import Processes, free_port, wait_for_job, wait_until
from worker.checkpoints.format import ModelMeta, save_model
from worker.data.datasets import fake_images

pytestmark = pytest.mark.e2e

TIMEOUT_S = 4
MAX_IMAGE_BYTES = 300_000


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory, redis_base_url: str) -> Iterator[dict]:
    from tests.support import flush, with_db

    url = with_db(redis_base_url, 14)
    flush(url)
    data_dir = tmp_path_factory.mktemp("predict-data")
    procs = Processes(url, data_dir, data_dir / "logs", TORCHYARD_MODEL_CACHE_COUNT="1",
                      TORCHYARD_PREDICT_TIMEOUT_S=str(TIMEOUT_S), TORCHYARD_PREDICT_MAX_WAIT_MS="50",
                      TORCHYARD_MAX_IMAGE_BYTES=str(MAX_IMAGE_BYTES), TORCHYARD_MAX_IMAGE_PIXELS="1000000")
    port = free_port()
    worker = procs.worker("cpu")
    procs.api(port)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT_S + 30)
    try:
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=90, what="a worker heartbeat")
        jobs = [client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1, "seed": s}).json()
                for s in (1, 2)]
        done = [wait_for_job(client, j["id"], {"succeeded", "failed"}) for j in jobs]
        assert [d["status"] for d in done] == ["succeeded", "succeeded"], [d.get("error") for d in done]
        yield {"client": client, "procs": procs, "worker": worker, "data_dir": Path(data_dir),
               "a": done[0]["id"], "b": done[1]["id"]}
    finally:
        client.close()
        procs.stop_all()
        flush(url)


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kw)
    return buffer.getvalue()


def _pattern(label: int, size: int = 32) -> Image.Image:
    array = fake_images(torch.tensor([label]), 3, size, size, seed=77)[0].permute(1, 2, 0).numpy()
    return Image.fromarray(array)


def _gif() -> bytes:
    frames = [_pattern(4), _pattern(7)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    return buffer.getvalue()


def _uploads() -> list[tuple[str, bytes]]:
    return [("a.png", _encode(_pattern(1), "PNG")), ("b.jpg", _encode(_pattern(2), "JPEG", quality=90)),
            ("c.webp", _encode(_pattern(3), "WEBP", lossless=True)), ("d.bmp", _encode(_pattern(5), "BMP")),
            ("e.gif", _gif()), ("f.png", _encode(_pattern(6, 48).resize((48, 40)), "PNG"))]


def _predict(client: httpx.Client, job_id: str, files: list[tuple[str, bytes]], top_k: int = 10) -> httpx.Response:
    return client.post("/predict", data={"job_id": job_id, "top_k": str(top_k)},
                       files=[("file", (name, data, "application/octet-stream")) for name, data in files])


def _local_probabilities(checkpoint: bytes, files: list[tuple[str, bytes]]) -> np.ndarray:
    """What a user writes from the checkpoint's recorded preprocessing: PIL → numpy → normalise → forward."""
    payload = torch.load(io.BytesIO(checkpoint), map_location="cpu", weights_only=True)
    meta, pre = payload["meta"], payload["meta"]["preprocessing"]
    model = build_model(meta["architecture"], meta["num_classes"], pre["channels"])
    model.load_state_dict(payload["state_dict"])
    model.eval()
    batch = []
    for _, data in files:
        image = Image.open(io.BytesIO(data))
        image.seek(0)
        image = image.convert("RGB" if pre["channels"] == 3 else "L")
        if image.size != (pre["width"], pre["height"]):
            image = image.resize((pre["width"], pre["height"]), Image.Resampling.BILINEAR)
        x = np.asarray(image, dtype=np.float32).reshape(pre["height"], pre["width"], -1) / 255.0
        x = (x - np.array(pre["mean"], dtype=np.float32)) / np.array(pre["std"], dtype=np.float32)
        batch.append(x.transpose(2, 0, 1))
    with torch.no_grad():
        return torch.softmax(model(torch.from_numpy(np.stack(batch))), dim=1).numpy()


def _service_probabilities(body: dict) -> np.ndarray:
    out = np.zeros((len(body["results"]), len(body["results"][0]["predictions"])))
    for row, result in enumerate(body["results"]):
        for p in result["predictions"]:
            out[row, p["index"]] = p["probability"]
    return out


def _device(client: httpx.Client) -> dict:
    return next(d for d in client.get("/devices").json()["devices"] if d["status"] != "offline")


def test_probabilities_equal_a_local_forward_on_the_downloaded_checkpoint(own: dict) -> None:
    client, job = own["client"], own["a"]
    files = _uploads()
    response = _predict(client, job, files)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [r["filename"] for r in body["results"]] == [name for name, _ in files]
    for result in body["results"]:
        probs = [p["probability"] for p in result["predictions"]]
        assert probs == sorted(probs, reverse=True) and abs(sum(probs) - 1) < 1e-4
    checkpoint = client.get(f"/jobs/{job}/checkpoint").content
    local = _local_probabilities(checkpoint, files)
    assert np.abs(_service_probabilities(body) - local).max() <= 1e-5
    meta = torch.load(io.BytesIO(checkpoint), map_location="cpu", weights_only=True)["meta"]
    assert "BILINEAR" in meta["preprocessing"]["transform"]  # the recipe above, spelled out for users

    top = _predict(client, job, files[:1], top_k=3).json()["results"][0]["predictions"]
    assert [p["index"] for p in top] == np.argsort(-local[0])[:3].tolist()
    assert top[0]["label"] == meta["classes"][top[0]["index"]]


def test_cache_evicts_reloads_and_picks_up_a_new_checkpoint(own: dict) -> None:
    client, a, b = own["client"], own["a"], own["b"]
    png = [("x.png", _encode(_pattern(2), "PNG"))]
    before = _device(client)["inference"]["cache"]
    for job in (a, b, a, a):
        assert _predict(client, job, png).status_code == 200
    # a (resident from the test before, or loaded now), b evicts a, a evicts b, a is a hit.
    wait_until(lambda: _device(client)["inference"]["cache"]["evictions"] >= before["evictions"] + 2, timeout=10,
               what="the heartbeat to publish the cache counters")
    device = _device(client)
    cache = device["inference"]["cache"]
    assert cache["loads"] >= before["loads"] + 2 and cache["resident"] == 1 and cache["max_count"] == 1
    assert device["loaded_models"] == [a]

    # A new checkpoint for the resident job: the next prediction uses it.
    torch.manual_seed(99)
    path = own["data_dir"] / "checkpoints" / a / "model.pt"
    old_meta = torch.load(path, map_location="cpu", weights_only=True)["meta"]
    save_model(path, build_model("cifar_net", 10), ModelMeta.from_dict(old_meta))
    response = _predict(client, a, png)
    assert response.status_code == 200
    local = _local_probabilities(path.read_bytes(), png)
    assert np.abs(_service_probabilities(response.json()) - local).max() <= 1e-5
    wait_until(lambda: _device(client)["inference"]["cache"]["reloads"] >= cache["reloads"] + 1, timeout=10,
               what="a reload to show in /devices")


def test_concurrent_requests_form_batches(own: dict) -> None:
    client, job = own["client"], own["b"]
    files = [(f"{i}.png", _encode(_pattern(i % 10), "PNG")) for i in range(32)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        responses = list(pool.map(lambda f: _predict(client, job, [f], top_k=10), files))
    assert [r.status_code for r in responses] == [200] * 32
    # Each caller gets its own image's answer, however the batch was assembled.
    local = _local_probabilities(client.get(f"/jobs/{job}/checkpoint").content, files)
    for i, response in enumerate(responses):
        assert response.json()["results"][0]["filename"] == f"{i}.png"
        assert np.abs(_service_probabilities(response.json())[0] - local[i]).max() <= 1e-5

    def batched() -> bool:
        stats = _device(client)["inference"]
        return stats["max_batch"] > 1 and any(int(size) > 1 for size in stats["batch_size_histogram"])

    wait_until(batched, timeout=10, what="a batch of more than one image in /devices")


def test_bad_input_never_harms_the_worker(own: dict) -> None:
    client, job = own["client"], own["a"]
    good = _encode(_pattern(3), "PNG")
    truncated = good[: len(good) - 40]  # header intact, image data cut: only the full decode notices
    pixel_bomb = _encode(Image.new("1", (5000, 5000)), "PNG")  # a few KB that decode to 25 M pixels
    cases = [("garbage.png", b"\x00garbage" * 50, 415), ("truncated.png", truncated, 415), ("empty.png", b"", 415),
             ("text.txt", b"hello", 415), ("bomb.png", pixel_bomb, 413),
             ("huge.bmp", _encode(Image.new("RGB", (400, 400)), "BMP"), 413), ("anim.gif", _gif(), 200)]
    for name, data, status in cases:
        response = _predict(client, job, [(name, data)])
        assert response.status_code == status, (name, response.text)
        assert response.status_code == 200 or isinstance(response.json()["detail"], str)
    mixed = _predict(client, job, [("ok.png", good), ("truncated.png", truncated)])
    assert mixed.status_code == 415 and "truncated.png" in mixed.json()["detail"]
    assert client.post("/predict", data={"job_id": "nosuchjob"}, files={"file": ("a.png", good)}).status_code == 404
    response = _predict(client, job, [("ok.png", good)])
    assert response.status_code == 200
    local = _local_probabilities(client.get(f"/jobs/{job}/checkpoint").content, [("ok.png", good)])
    assert np.abs(_service_probabilities(response.json()) - local).max() <= 1e-5
    assert own["worker"].poll() is None
    assert _device(client)["inference"]["errors"] == 0


def test_a_training_device_still_answers(own: dict) -> None:
    client, job = own["client"], own["a"]
    long = client.post("/jobs", json={"model": "resnet18", "dataset": "fake", "epochs": 200, "patience": 0}).json()
    try:
        wait_for_job(client, long["id"], {"running"}, timeout=60)
        wait_until(lambda: client.get(f"/jobs/{long['id']}").json()["progress"]["step"] > 0, timeout=60,
                   what="the long job to take steps")
        png = [("x.png", _encode(_pattern(8), "PNG"))]
        local = _local_probabilities(client.get(f"/jobs/{job}/checkpoint").content, png)
        for _ in range(3):
            response = _predict(client, job, png)
            assert response.status_code == 200, response.text
            assert np.abs(_service_probabilities(response.json()) - local).max() <= 1e-5
        conflict = _predict(client, long["id"], png)
        assert conflict.status_code == 409 and "running" in conflict.json()["detail"]
        assert client.get(f"/jobs/{long['id']}").json()["status"] == "running"  # it was training all along
    finally:
        client.post(f"/jobs/{long['id']}/cancel")
    wait_for_job(client, long["id"], {"cancelled", "failed", "succeeded"}, timeout=60)


def test_a_dead_worker_is_a_bounded_503(own: dict) -> None:
    client, job = own["client"], own["a"]
    png = [("x.png", _encode(_pattern(1), "PNG"))]
    assert _predict(client, job, png).status_code == 200
    own["procs"].stop(own["worker"], signal.SIGKILL)
    # Whether the API still believes the worker alive (the request then times out after
    # TORCHYARD_PREDICT_TIMEOUT_S) or already knows it is gone, the answer is a 503, not a hang:
    # the client's own timeout would fail this test first.
    response = _predict(client, job, png)
    assert response.status_code == 503 and response.json()["detail"]
    wait_until(lambda: client.get("/readyz").status_code == 503, timeout=30, what="the heartbeat to lapse")
    response = _predict(client, job, png)
    assert response.status_code == 503 and "no live worker" in response.json()["detail"]
