"""The worker's inference pieces with real torch and a real Redis: the resident-model LRU, and
dynamic batching through the Redis list (decoding is worker/data/image_array.py's, tested beside it)."""

from __future__ import annotations

import io
import json
import os
import time

import numpy as np
import pytest
import redis
import torch
from PIL import Image

from core import keys
from core.storage import CheckpointPaths
from core.wire import PredictReply, PredictRequest
from models.registry import build_model
from worker.checkpoints.format import CheckpointError, ModelMeta, Preprocessing, save_model
from worker.data.image_array import InputSpec, decode_image, image_to_array
from worker.data.normalization import normalize, stats_tensors
from worker.device.pinning import WorkerDevice
from worker.serving.decode import DecodeSplit
from worker.serving.engine import InferenceServer
from worker.serving.model_cache import ModelCache

META = ModelMeta("cifar_net", 10, [f"c{i}" for i in range(10)],
                 Preprocessing(3, 32, 32, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)), "job-a")


def _encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kw)
    return buffer.getvalue()


def _rgb(seed: int = 0, size: tuple[int, int] = (32, 32)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _save(paths: CheckpointPaths, job_id: str, seed: int, arch: str = "cifar_net") -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(arch, 10).eval()
    path = paths.final(job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(path, model, ModelMeta(arch, 10, META.classes, META.preprocessing, job_id))
    return model


def test_cache_is_an_lru_that_reloads_changed_checkpoints(tmp_path) -> None:
    paths = CheckpointPaths(tmp_path)
    _save(paths, "job-a", 1)
    _save(paths, "job-b", 2)
    cache = ModelCache(paths, "cpu", max_count=1, max_bytes=1 << 30)
    first = cache.get("job-a")
    assert not first.model.training and cache.get("job-a") is first  # resident, in eval mode
    cache.get("job-b")
    assert cache.resident() == ["job-b"] and cache.evictions == 1
    cache.get("job-a")
    stats = cache.stats()
    assert (stats["loads"], stats["evictions"], stats["hits"], stats["reloads"]) == (3, 2, 1, 0)

    # A new checkpoint for a resident job is picked up on the next request.
    replacement = _save(paths, "job-a", 3)
    os.utime(paths.final("job-a"), ns=(time.time_ns(), time.time_ns() + 10**9))  # a distinct mtime on coarse clocks
    entry = cache.get("job-a")
    assert cache.stats()["reloads"] == 1
    assert torch.equal(entry.model.state_dict()["fc3.weight"], replacement.state_dict()["fc3.weight"])

    with pytest.raises(CheckpointError):
        cache.get("job-missing")


def test_a_replaced_checkpoint_of_the_same_size_and_mtime_is_reloaded(tmp_path) -> None:
    """A new model.pt of the same size whose mtime is the old one's (a copy that keeps times, two
    writes within a coarse clock's tick) was served stale when the cache keyed on (mtime, size)."""
    paths = CheckpointPaths(tmp_path)
    _save(paths, "job-a", 1)
    final = paths.final("job-a")
    old = final.stat()
    cache = ModelCache(paths, "cpu", max_count=2, max_bytes=1 << 30)
    cache.get("job-a")
    replacement = _save(paths, "job-a", 2)  # written to a temporary name and renamed into place
    os.utime(final, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert (final.stat().st_size, final.stat().st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    entry = cache.get("job-a")
    assert cache.stats()["reloads"] == 1
    assert torch.equal(entry.model.state_dict()["fc3.weight"], replacement.state_dict()["fc3.weight"])


def test_cache_evicts_by_bytes(tmp_path) -> None:
    paths = CheckpointPaths(tmp_path)
    for i, job in enumerate(("a", "b", "c")):
        _save(paths, job, i)
    one = ModelCache(paths, "cpu", max_count=10, max_bytes=1 << 30).get("a").nbytes
    cache = ModelCache(paths, "cpu", max_count=10, max_bytes=2 * one)
    for job in ("a", "b", "c"):
        cache.get(job)
    assert cache.resident() == ["b", "c"] and cache.evictions == 1


def _request(job_id: str, images: list[bytes], reply_to: str, top_k: int = 3, *, now: float | None = None,
             alias: str | None = None) -> bytes:
    """A request as an API process frames it; times on Redis's clock (this host's, in these tests)."""
    now = time.time() if now is None else now
    return PredictRequest.frame([(f"{i}.png", d) for i, d in enumerate(images)], job_id=job_id, alias=alias,
                                top_k=top_k, reply_to=reply_to, request_id=f"id-{reply_to}", queued_at=now,
                                deadline=now + 30)


def test_queued_requests_run_as_one_batch_and_bad_ones_are_answered_alone(clean_redis_url: str, tmp_path) -> None:
    client = redis.Redis.from_url(clean_redis_url)
    paths = CheckpointPaths(tmp_path)
    model = _save(paths, "job-a", 5)
    device = WorkerDevice("cpu", None, "testnode")
    server = InferenceServer(client, device, ModelCache(paths, "cpu", 2, 1 << 30), max_batch=32, max_wait_ms=5,
                             max_pixels=10_000)
    pngs = [_encode(_rgb(10 + i), "PNG") for i in range(7)]
    queue = keys.predict_queue(device.id)
    for i, png in enumerate(pngs[:6]):
        client.rpush(queue, _request("job-a", [png], f"reply:{i}"))
    client.rpush(queue, _request("job-a", [pngs[6], pngs[0]], "reply:two"))  # two files in one request
    client.rpush(queue, _request("job-a", [b"garbage"], "reply:bad"))
    client.rpush(queue, _request("job-missing", [pngs[0]], "reply:missing"))
    client.rpush(queue, "{not json")
    server.start()
    try:
        replies = {key: client.blpop([key], timeout=20) for key in
                   [*(f"reply:{i}" for i in range(6)), "reply:two", "reply:bad", "reply:missing"]}
    finally:
        server.stop()
        server.join()
    assert all(replies.values()), replies
    addressed = {key: PredictReply.decode_addressed(value[1].decode()) for key, value in replies.items()}
    assert all(request_id == f"id-{key}" for key, (request_id, _) in addressed.items())
    status = {key: str(reply.status) for key, (_, reply) in addressed.items()}
    assert status.pop("reply:bad") == "415" and status.pop("reply:missing") == "409"
    assert set(status.values()) == {"200"}
    stats = server.stats.as_dict()
    assert stats["max_batch"] == 8 and stats["batches"] == 1  # 6 + 2 images, one forward

    mean, std = stats_tensors(META.preprocessing, "cpu")
    with torch.inference_mode():
        x = torch.from_numpy(np.stack([image_to_array(Image.open(io.BytesIO(p)), 3, 32, 32) for p in pngs]))
        expected = torch.softmax(model(normalize(x, mean, std)), dim=1)
    body = json.loads(addressed["reply:two"][1].body)
    assert body["job_id"] == "job-a" and body["model"] == "cifar_net" and body["device"] == device.id
    assert [r["filename"] for r in body["results"]] == ["0.png", "1.png"]
    for result, row in zip(body["results"], (expected[6], expected[0]), strict=True):
        top = result["predictions"]
        assert len(top) == 3 and [p["index"] for p in top] == row.topk(3).indices.tolist()
        assert all(abs(p["probability"] - row[p["index"]].item()) <= 1e-6 for p in top)
        assert top[0]["label"] == META.classes[top[0]["index"]]


def test_images_are_decoded_on_one_thread_until_they_cost_enough_for_the_pool() -> None:
    split = DecodeSplit(threads=4, pool_from_s=120e-6)
    assert split.chunks(32) == 1  # nothing measured yet: the intake thread alone
    split.observe(32 * 30e-6, 32)  # 30 µs an image (a 32×32 PNG): threads would only contend for the GIL
    assert split.chunks(32) == 1
    split.observe(16 * 600e-6, 16)  # large images now: the average (144 µs) is past pool_from_s
    assert split.chunks(32) == 4 and split.chunks(3) == 3 and split.chunks(1) == 1
    for _ in range(12):  # small ones again: back to one thread once the average has come down
        split.observe(32 * 20e-6, 32)
    assert split.chunks(32) == 1


def test_the_split_is_in_the_hosts_own_units() -> None:
    """Without a threshold given, it is REFERENCE_DECODES times the reference decode measured here:
    a 32×32 PNG (the reference itself) stays on the intake thread on any host, and an image costing
    ten reference decodes goes to the pool."""
    from worker.serving.decode import reference_decode_s

    split = DecodeSplit(threads=4)
    reference = reference_decode_s()
    assert 0 < split.pool_from_s <= DecodeSplit.REFERENCE_DECODES * reference * 3  # a busy moment only adds
    split.observe(32 * reference, 32)
    assert split.chunks(32) == 1
    for _ in range(20):
        split.observe(32 * 10 * split.pool_from_s / DecodeSplit.REFERENCE_DECODES, 32)
    assert split.chunks(32) == 4


def test_large_images_are_decoded_by_the_pool_with_the_same_answers(clean_redis_url: str, tmp_path) -> None:
    """The first batch is decoded on the intake thread and timed; 256×256 JPEGs cost far more than
    DecodeSplit's threshold each on any CPU (several dozen of its reference decodes), so the second is split over the pool, in order."""
    client = redis.Redis.from_url(clean_redis_url)
    paths = CheckpointPaths(tmp_path)
    model = _save(paths, "job-a", 8)
    device = WorkerDevice("cpu", None, "testnode")
    server = InferenceServer(client, device, ModelCache(paths, "cpu", 2, 1 << 30), max_batch=32, max_wait_ms=5,
                             max_pixels=10**6, decode_processes=3)
    jpegs = [_encode(_rgb(60 + i, (256, 256)), "JPEG", quality=90) for i in range(8)]
    replies = []
    server.start()
    try:
        for n in range(2):
            client.rpush(keys.predict_queue(device.id), _request("job-a", jpegs, f"reply:{n}", top_k=10))
            reply = client.blpop([f"reply:{n}"], timeout=20)
            assert reply is not None
            replies.append(PredictReply.decode_addressed(reply[1].decode())[1])
            if n == 0:
                assert server.decoder.split.chunks(len(jpegs)) == 3  # measured: the next batch goes to the pool
    finally:
        server.stop()
        server.join()
    mean, std = stats_tensors(META.preprocessing, "cpu")
    with torch.inference_mode():
        x = torch.from_numpy(np.stack([decode_image(j, InputSpec.of(META.preprocessing), 10**6) for j in jpegs]))
        expected = torch.softmax(model(normalize(x, mean, std)), dim=1)
    for answer in replies:
        assert answer.status == 200
        for result, row in zip(json.loads(answer.body)["results"], expected, strict=True):
            assert all(abs(p["probability"] - row[p["index"]].item()) <= 1e-5 for p in result["predictions"])


def test_padding_to_a_bucket_as_on_a_gpu_changes_no_answer(clean_redis_url: str, tmp_path) -> None:
    """The GPU path pads a batch of 3 to 4 rows (worker/serving/batching.bucket_size); run it on the CPU."""
    client = redis.Redis.from_url(clean_redis_url)
    paths = CheckpointPaths(tmp_path)
    model = _save(paths, "job-a", 6)
    device = WorkerDevice("cpu", None, "testnode")
    server = InferenceServer(client, device, ModelCache(paths, "cpu", 2, 1 << 30), max_batch=32, max_wait_ms=5,
                             max_pixels=10_000, pad_to_buckets=True)
    pngs = [_encode(_rgb(40 + i), "PNG") for i in range(3)]
    client.rpush(keys.predict_queue(device.id), _request("job-a", pngs, "reply:padded", top_k=10))
    server.start()
    try:
        reply = client.blpop(["reply:padded"], timeout=20)
    finally:
        server.stop()
        server.join()
    assert reply is not None
    _, answer = PredictReply.decode_addressed(reply[1].decode())
    assert answer.status == 200 and server.stats.as_dict()["batch_size_histogram"] == {"3": 1}
    mean, std = stats_tensors(META.preprocessing, "cpu")
    with torch.inference_mode():
        x = torch.from_numpy(np.stack([image_to_array(Image.open(io.BytesIO(p)), 3, 32, 32) for p in pngs]))
        expected = torch.softmax(model(normalize(x, mean, std)), dim=1)
    for result, row in zip(json.loads(answer.body)["results"], expected, strict=True):
        assert all(abs(p["probability"] - row[p["index"]].item()) <= 1e-5 for p in result["predictions"])
