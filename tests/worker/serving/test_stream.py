"""The serving engine's stream (worker/serving/stream.py): a model's load, trace and probe run on it,
as its batches do, so on a GPU they never queue behind a training job's kernels on the default
stream. On a CPU the stream is a null context through the same calls (the CPU twin); on a GPU
(`pytest -m gpu`) the same test checks the thread's current CUDA stream."""

from __future__ import annotations

import io
import threading
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
from worker.checkpoints.format import ModelMeta, Preprocessing, save_model
from worker.device.pinning import WorkerDevice
from worker.serving.engine import InferenceServer
from worker.serving.model_cache import ModelCache

PRE = Preprocessing(3, 32, 32, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3))


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_model_is_loaded_traced_and_probed_on_the_engines_stream(clean_redis_url: str, tmp_path, kind: str) -> None:
    paths = CheckpointPaths(tmp_path)
    path = paths.final("job-a")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(path, build_model("cifar_net", 10).eval(), ModelMeta("cifar_net", 10, [f"c{i}" for i in range(10)], PRE,
                                                                    "job-a"))
    client = redis.Redis.from_url(clean_redis_url)
    device = WorkerDevice(kind, 0 if kind == "cuda" else None, "testnode")
    server = InferenceServer(client, device, ModelCache(paths, device.torch_device, 2, 1 << 30), max_batch=8,
                             max_wait_ms=1, max_pixels=10_000)
    stream = server.device_loop.stream
    seen: list[tuple[str, str, bool]] = []  # (what, thread, on the engine's stream)

    def record(what: str) -> None:
        seen.append((what, threading.current_thread().name, stream.inside()))

    # Global hooks, in every thread: a parameter is registered as load_model builds the network, and
    # the eager module's forward runs in the trace and in its probe.
    hooks = [torch.nn.modules.module.register_module_parameter_registration_hook(lambda *_: record("built")),
             torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: record("forward"))]
    now = time.time()
    client.rpush(keys.predict_queue(device.id), PredictRequest.frame(
        [("a.png", _png(1)), ("b.png", _png(2))], job_id="job-a", alias=None, top_k=3, reply_to="reply:a",
        request_id="id-a", queued_at=now, deadline=now + 30))
    try:
        server.start()
        reply = client.blpop(["reply:a"], timeout=60)
    finally:
        for hook in hooks:
            hook.remove()
        server.stop()
        server.join()
    assert reply is not None
    assert PredictReply.decode_addressed(reply[1].decode())[1].status == 200
    loading = [(what, inside) for what, thread, inside in seen if thread == "torchyard-intake"]
    assert {what for what, _ in loading} == {"built", "forward"}, seen  # the load, the trace and the probe
    assert all(inside for _, inside in loading), seen
    assert not stream.inside()  # the test's own thread never entered it
