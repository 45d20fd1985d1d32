"""One OpenMP team at a time in a worker process (worker/device/cpu_threads.py), on the CPU CI has.

The outcomes asserted are the ones the policy exists for: a job's team is gone once the job is
(the process has no more threads than before it), a pinned thread never makes a team, and the
/predict forward leaves the cores to a job and takes them back after it."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import redis
import torch

from core import keys
from core.storage import CheckpointPaths
from core.wire import PredictReply
from models.registry import build_model
from tests.worker.serving.test_engine import _encode, _request, _rgb, _save
from worker.checkpoints.format import ModelMeta, Preprocessing, save_model
from worker.device.cpu_threads import HEAVY_FORWARD_S, ForwardThreads, pin_to_one_thread, run_in_own_thread
from worker.device.pinning import WorkerDevice
from worker.serving.engine import InferenceServer
from worker.serving.model_cache import ModelCache


def _parallel_work() -> None:
    """Big enough for torch to split it over its threads (grain size 32,768 elements)."""
    x = torch.ones(4_000_000)
    for _ in range(3):
        x.mul_(1.0000001)


def _os_threads() -> set[int]:
    """The OS threads of this process, by id."""
    return {thread.id for thread in psutil.Process().threads()}


def _new_threads(before: set[int]) -> int:
    """Threads started since `before` was taken (threads of earlier tests ending meanwhile don't count)."""
    return len(_os_threads() - before)


def test_the_policy_gives_the_cores_to_a_job_and_hands_over_a_thread_that_holds_a_team() -> None:
    policy = ForwardThreads(8)
    assert policy.wanted(job_running=False) == 8 and policy.wanted(job_running=True) == 1
    assert ForwardThreads.must_hand_over(1, most_used=8)
    assert not ForwardThreads.must_hand_over(1, most_used=1)
    assert not ForwardThreads.must_hand_over(8, most_used=8)
    assert ForwardThreads(0).cores == 1


def test_a_light_model_keeps_to_one_thread_unless_the_operator_set_a_count() -> None:
    by_weight, configured = ForwardThreads(8), ForwardThreads(8, every_model=True)
    assert by_weight.wanted(job_running=False, heavy=True) == 8
    assert by_weight.wanted(job_running=False, heavy=False) == 1
    assert configured.wanted(job_running=False, heavy=False) == 8
    assert by_weight.wanted(job_running=True, heavy=True) == configured.wanted(job_running=True, heavy=False) == 1


def test_a_job_thread_runs_on_its_threads_and_its_team_ends_with_it() -> None:
    run_in_own_thread(_parallel_work, 2, "warm-up")  # torch starts a helper thread of its own once
    time.sleep(0.2)
    before = _os_threads()

    def job() -> int:
        _parallel_work()
        assert _new_threads(before) > 0  # the team (and this thread) exist while the job runs
        return torch.get_num_threads()

    assert run_in_own_thread(job, 2, "test-job") == 2
    deadline = time.monotonic() + 5
    while _new_threads(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _new_threads(before) == 0


def test_a_job_threads_failure_is_raised_in_the_caller() -> None:
    failure = RuntimeError("the job failed")

    def job() -> None:
        raise failure

    with pytest.raises(RuntimeError) as info:
        run_in_own_thread(job, 1, "test-job")
    assert info.value is failure


def test_a_pinned_thread_makes_no_team_even_after_another_thread_asked_for_more() -> None:
    seen: dict[str, int] = {}

    def helper() -> None:
        pin_to_one_thread()
        other = threading.Thread(target=lambda: (torch.get_num_threads(), torch.set_num_threads(2)))
        other.start()
        other.join()
        before = _os_threads()
        _parallel_work()
        seen["threads"], seen["created"] = torch.get_num_threads(), _new_threads(before)

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    assert seen == {"threads": 1, "created": 0}


def _answer(client: redis.Redis, queue: str, png: bytes, key: str) -> PredictReply:
    client.rpush(queue, _request("job-a", [png], key))
    reply = client.blpop([key], timeout=20)
    assert reply is not None
    return PredictReply.decode_addressed(reply[1].decode())[1]


def test_the_forward_leaves_the_cores_to_a_job_and_takes_them_back(clean_redis_url: str, tmp_path) -> None:
    client = redis.Redis.from_url(clean_redis_url)
    paths = CheckpointPaths(tmp_path)
    _save(paths, "job-a", 5)
    job = threading.Event()
    device = WorkerDevice("cpu", None, "testnode")
    server = InferenceServer(client, device, ModelCache(paths, "cpu", 2, 1 << 30), max_batch=8, max_wait_ms=1,
                             max_pixels=10_000, cpu_threads=2, job_running=job.is_set)
    queue = keys.predict_queue(device.id)
    png = _encode(_rgb(1), "PNG")
    server.start()
    try:
        assert _answer(client, queue, png, "reply:idle").status == 200
        assert server.stats.as_dict()["forward_threads"] == 2
        serving_thread = server.device_loop.thread

        job.set()  # what JobRunner does: state.begin, then release_cores, then the job's thread
        started = time.monotonic()
        server.release_cores(timeout_s=10)
        assert time.monotonic() - started < 5
        serving_thread.join(5)
        assert server.device_loop.thread is not serving_thread and not serving_thread.is_alive()
        assert server.stats.as_dict()["forward_threads"] == 1
        assert _answer(client, queue, png, "reply:during-job").status == 200  # still served, on one thread

        job.clear()
        assert _answer(client, queue, png, "reply:after").status == 200
        deadline = time.monotonic() + 5
        while server.stats.as_dict()["forward_threads"] != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.stats.as_dict()["forward_threads"] == 2
    finally:
        server.stop()
        server.join()
    assert not server.device_loop.thread.is_alive()


@pytest.mark.skipif((psutil.cpu_count() or 1) < 2, reason="a team needs two cores")
def test_a_light_models_forward_makes_no_team_and_a_heavy_ones_does(clean_redis_url: str, tmp_path) -> None:
    """cifar_net's one-image forward takes a fraction of a millisecond, far under HEAVY_FORWARD_S:
    with no count configured its batches run on one thread and no OpenMP thread appears in the
    process; with TORCHYARD_PREDICT_CPU_THREADS=2 the same batches start one, and so does a heavy
    model's forward (resnet18 at 64×64, far over HEAVY_FORWARD_S on one thread) with no count configured."""
    client = redis.Redis.from_url(clean_redis_url)
    paths = CheckpointPaths(tmp_path)
    _save(paths, "job-a", 5)
    torch.manual_seed(0)
    heavy_path = paths.final("job-heavy")
    heavy_path.parent.mkdir(parents=True, exist_ok=True)
    save_model(heavy_path, build_model("resnet18", 10).eval(),
               ModelMeta("resnet18", 10, [f"c{i}" for i in range(10)],
                         Preprocessing(3, 64, 64, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)), "job-heavy"))
    png = _encode(_rgb(1), "PNG")
    created: dict[str, int] = {}
    for label, job_id, cpu_threads in (("light", "job-a", None), ("light-configured", "job-a", 2),
                                       ("heavy", "job-heavy", None)):
        device = WorkerDevice("cpu", None, "testnode")
        cache = ModelCache(paths, "cpu", 2, 1 << 30)
        server = InferenceServer(client, device, cache, max_batch=8, max_wait_ms=1, max_pixels=10_000,
                                 cpu_threads=cpu_threads, decode_processes=1)
        server.start()
        try:
            before = _os_threads()
            for i in range(4):  # one image each: decoded on the intake, answered by the device thread
                client.rpush(keys.predict_queue(device.id), _request(job_id, [png], f"reply:{label}:{i}"))
                reply = client.blpop([f"reply:{label}:{i}"], timeout=30)
                assert reply is not None and PredictReply.decode_addressed(reply[1].decode())[1].status == 200
            created[label] = _new_threads(before)
            one_image_s = cache.get(job_id).one_image_s
            assert one_image_s is not None and (one_image_s >= HEAVY_FORWARD_S) == (label == "heavy")
        finally:
            server.stop()
            server.join()
    assert created == {"light": 0, "light-configured": 1, "heavy": 1}


def test_a_light_model_stays_light_when_loaded_beside_busy_threads(tmp_path) -> None:
    """A model is timed as it loads, at its first request, often on a busy worker: here another
    thread holds the GIL in 20 ms slices (as the worker's other Python threads do, on a loaded
    host, for a scheduler's slice). Waiting for the GIL or a core is not the forward's cost: a
    wall-clock timing took cifar_net for a heavy model, and its forward ran with an OpenMP team
    that spun a core away at every request."""
    import sys

    paths = CheckpointPaths(tmp_path)
    _save(paths, "job-a", 5)
    stop = threading.Event()

    def hold_the_gil() -> None:
        while not stop.is_set():
            pass

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.02)
    busy = threading.Thread(target=hold_the_gil, daemon=True)
    busy.start()
    try:
        one_image_s = run_in_own_thread(lambda: ModelCache(paths, "cpu", 2, 1 << 30).get("job-a").one_image_s, 1,
                                        "loader")
    finally:
        stop.set()
        busy.join()
        sys.setswitchinterval(interval)
    assert one_image_s is not None and one_image_s < HEAVY_FORWARD_S
