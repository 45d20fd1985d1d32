"""Preprocessed float32 inputs (core/wire.py's "fp32" encoding, the Open Inference Protocol's INPUT__0)
through the worker's engine with real torch and a real Redis: beside an image request for the same
model in one window, on the GPU's padded path, with every class's probability in the reply and a
row of the wrong shape refused alone."""

from __future__ import annotations

import json
import time

import numpy as np
import redis
import torch

from core import keys
from core.storage import CheckpointPaths
from core.wire import PredictReply, PredictRequest
from worker.data.normalization import stats_tensors
from worker.device.pinning import WorkerDevice
from worker.serving.engine import InferenceServer
from worker.serving.model_cache import ModelCache

from .test_engine import META, _encode, _rgb, _save


def _frame(items: list[bytes], reply_to: str, **header: object) -> bytes:
    now = time.time()
    return PredictRequest.frame([(f"{i}", d) for i, d in enumerate(items)], job_id="job-a", top_k=3,
                                reply_to=reply_to, request_id=f"id-{reply_to}", queued_at=now, deadline=now + 30,
                                **header)


def test_preprocessed_rows_beside_images_answer_every_probability(clean_redis_url: str, tmp_path) -> None:
    client = redis.Redis.from_url(clean_redis_url)
    paths = CheckpointPaths(tmp_path)
    model = _save(paths, "job-a", 7)
    device = WorkerDevice("cpu", None, "testnode")
    server = InferenceServer(client, device, ModelCache(paths, "cpu", 2, 1 << 30), max_batch=32, max_wait_ms=20,
                             max_pixels=10_000, pad_to_buckets=True)
    rows = np.random.default_rng(3).random((3, 3, 32, 32), dtype=np.float32)
    queue = keys.predict_queue(device.id)
    client.rpush(queue, _frame([r.astype("<f4").tobytes() for r in rows], "reply:rows", encoding="fp32",
                               shape=(3, 32, 32), reply="probabilities"))
    client.rpush(queue, _frame([_encode(_rgb(1), "PNG")], "reply:image"))
    client.rpush(queue, _frame([rows[0, :, :16, :16].tobytes()], "reply:wrong", encoding="fp32",
                               shape=(3, 16, 16), reply="probabilities"))
    server.start()
    try:
        replies = {key: client.blpop([key], timeout=30) for key in ("reply:rows", "reply:image", "reply:wrong")}
    finally:
        server.stop()
        server.join()
    assert all(replies.values()), replies
    answers = {key: PredictReply.decode_addressed(value[1].decode())[1] for key, value in replies.items()}
    assert answers["reply:image"].status == 200 and "results" in json.loads(answers["reply:image"].body)
    assert answers["reply:wrong"].status == 422 and "[3, 32, 32]" in answers["reply:wrong"].body
    assert answers["reply:rows"].status == 200
    body = json.loads(answers["reply:rows"].body)
    assert body["classes"] == META.classes and len(body["probabilities"]) == 3
    mean, std = stats_tensors(META.preprocessing, "cpu")
    with torch.inference_mode():
        expected = torch.softmax(model((torch.from_numpy(rows) - mean) / std), dim=1)  # already in [0, 1]
    assert np.abs(np.array(body["probabilities"]) - expected.numpy()).max() <= 1e-5
