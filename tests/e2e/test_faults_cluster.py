"""Faults on a cluster of our own, with real processes: an embedded Redis the tests may kill, the
API, and CPU workers on two "hosts" (h1, h2: TORCHYARD_NODE_NAME) sharing that Redis and one data
dir, 2 s leases (one cluster for the module: its start is most of a test's time). A frozen worker
whose lease is taken over changes nothing (a training job, a batch prediction job), Redis
SIGKILLed mid-job pauses the job and the API answers 503, what a process SIGKILLed between two
writes leaves half done is completed by the workers, and /predict requests held by a SIGKILLed
worker are answered by the other. (On one host: test_faults.py.)"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from core.config import Settings
from tests.datagen import shapes_zip
from tests.support import (
    TERMINAL,
    assert_ran_once,
    get_job,
    job_events,
    pattern_png,
    pattern_zip,
    submit_cifar,
    two_hosts,
    wait_for_job,
    wait_until,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with two_hosts(tmp_path_factory.mktemp("cluster"), TORCHYARD_LEASE_TTL_S="2", TORCHYARD_MAX_ATTEMPTS="5") as hosts:
        client = hosts["client"]
        uploaded = client.post("/datasets", data={"name": "shapes"},
                               files={"file": ("s.zip", shapes_zip(per_class=24, corrupt=None), "application/zip")})
        assert uploaded.status_code == 201, uploaded.text
        yield {**hosts, "dataset": uploaded.json()["id"]}


def _train(cluster: dict, epochs: int) -> str:
    """A model to predict with: the cluster's small upload, a fraction of a second."""
    return submit_cifar(cluster["client"], epochs, dataset=cluster["dataset"], batch_size=8)


def _train_long(cluster: dict, epochs: int) -> str:
    """A job for a fault to land in: the built-in `fake` set (2,560 images), whose epochs last long
    enough on the fastest host seen (the upload's 72 images trained all its epochs there before the
    test could see the job running), on hosts whose training speed moves severalfold within a day
    (docs/benchmarks.md has the figures)."""
    return submit_cifar(cluster["client"], epochs, batch_size=8)


def _freeze_until_taken_over(cluster: dict, job_id: str, device: str) -> tuple[str, str]:
    """SIGSTOP the worker running `job_id` on `device` until the other host has taken the job over,
    then SIGCONT it while the owner runs: (stale node, owner node)."""
    client, workers = cluster["client"], cluster["workers"]
    stale_node = device.split("/")[0]
    owner_node = "h2" if stale_node == "h1" else "h1"
    workers[stale_node].send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: (j := get_job(client, job_id))["attempts"] == 2 and j["device"] == f"{owner_node}/cpu"
                           and j["status"] == "running" and j, timeout=60, what="the other host to take the job over")
    finally:
        workers[stale_node].send_signal(signal.SIGCONT)
    return stale_node, owner_node


def _wait_stale_settled(cluster: dict, stale_node: str) -> None:
    """The woken worker has noticed it lost the lease and is idle again."""
    client, stale = cluster["client"], cluster["workers"][stale_node]
    wait_until(lambda: "lost its lease" in cluster["procs"].log(stale), timeout=60, what="the stale worker to notice")
    wait_until(lambda: any(d["id"] == f"{stale_node}/cpu" and d["status"] == "idle"
                           for d in client.get("/devices").json()["devices"]), timeout=30, what="the stale one idle")


def test_a_frozen_worker_whose_lease_was_taken_over_changes_nothing(cluster: dict) -> None:
    """SIGSTOP the worker running a job after its first recorded epoch: the other host sweeps the
    lease and resumes the job from the state the frozen one recorded. SIGCONT the frozen one while
    the new owner runs: it must notice, and change nothing a user sees, then or later."""
    client, workers = cluster["client"], cluster["workers"]
    epochs = 8
    job_id = _train_long(cluster, epochs)
    first = wait_until(lambda: (j := get_job(client, job_id))["status"] == "running" and len(j["metrics"]) >= 1 and j,
                       timeout=120, what="a first recorded epoch")
    stale_node, owner_node = _freeze_until_taken_over(cluster, job_id, first["device"])
    stale = workers[stale_node]
    done = wait_for_job(client, job_id, TERMINAL, timeout=180)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 2 and done["device"] == f"{owner_node}/cpu" and done["resumed_from_epoch"] >= 1
    assert_ran_once(client, done, epochs)
    events_when_done = job_events(client, job_id)
    _wait_stale_settled(cluster, stale_node)

    job_dir = cluster["data_dir"] / "checkpoints" / job_id
    body = client.get(f"/jobs/{job_id}/checkpoint").content
    assert hashlib.sha256(body).hexdigest() == done["checkpoint"]["sha256"]
    assert hashlib.sha256((job_dir / "model.pt").read_bytes()).hexdigest() == done["checkpoint"]["sha256"]
    # Status, progress, metrics, params, classes, the checkpoint and its recorded sha256, the events:
    # all as the owner left them; no file of the stale delivery was promoted or left behind.
    assert get_job(client, job_id) == done
    assert job_events(client, job_id) == events_when_done
    assert sorted(p.name for p in job_dir.iterdir()) == ["model.pt"]
    assert stale.poll() is None and workers[owner_node].poll() is None


def test_a_frozen_worker_mid_batch_prediction_changes_nothing_once_taken_over(cluster: dict) -> None:
    """The same for a `predict` job (batch predictions): SIGSTOP the worker labelling a folder once
    it has recorded a resume point; the other host takes the job over and goes on after that point.
    SIGCONT the frozen one while the owner runs: it goes on writing its own working file until it
    notices, yet the results hold every file exactly once, in order, and nothing it did reaches
    the job, its events or its directory."""
    from tests.e2e.test_batch_predict import _images_zip, _lines, _predict, _upload

    client, workers = cluster["client"], cluster["workers"]
    trained = _train(cluster, 1)
    assert wait_for_job(client, trained, TERMINAL, timeout=180)["status"] == "succeeded"
    data, names = _images_zip(6000, seed=21, size=32)
    dataset = _upload(client, data)
    job_id = _predict(client, dataset["id"], trained, batch_size=1, top_k=3)["id"]

    def under_way() -> dict | None:
        job = get_job(client, job_id)
        done = job["progress"].get("images_done") or 0
        return job if job["status"] == "running" and 0 < done < len(names) // 2 else None

    first = wait_until(under_way, timeout=120, interval=0.02, what="a first recorded resume point")
    stale_node, owner_node = _freeze_until_taken_over(cluster, job_id, first["device"])
    stale = workers[stale_node]
    woke = get_job(client, job_id)
    assert woke["status"] == "running", "the owner had finished before the stale one woke: a longer folder"
    done = wait_for_job(client, job_id, TERMINAL, timeout=180)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 2 and done["device"] == f"{owner_node}/cpu", done
    assert done["results"]["resumed_from_image"] >= first["progress"]["images_done"]
    lines = _lines(client, job_id)
    assert [line["file"] for line in lines] == names  # each file exactly once, in the job's order
    assert all(len(line["predictions"]) == 3 for line in lines)

    body = client.get(f"/jobs/{job_id}/results").content
    events_when_done = job_events(client, job_id)
    _wait_stale_settled(cluster, stale_node)
    assert hashlib.sha256(body).hexdigest() == done["checkpoint"]["sha256"]
    assert client.get(f"/jobs/{job_id}/results").content == body
    assert get_job(client, job_id) == done
    assert job_events(client, job_id) == events_when_done
    job_dir = cluster["data_dir"] / "checkpoints" / job_id
    assert sorted(p.name for p in job_dir.iterdir()) == ["results.jsonl"]
    assert stale.poll() is None and workers[owner_node].poll() is None


def test_redis_killed_mid_job_pauses_it_and_the_api_answers_503(cluster: dict) -> None:
    """SIGKILL redis-server while a job trains, keep it down for three lease TTLs, start it again on
    the same files: meanwhile every route answers 503 with a detail (never a 500); afterwards the
    job goes on from where it paused, on the same delivery (no lease was swept: attempts stays 1)."""
    client, server = cluster["client"], cluster["server"]
    epochs = 6
    job_id = _train_long(cluster, epochs)
    wait_until(lambda: (j := get_job(client, job_id))["status"] == "running" and j["progress"]["step"] > 0,
               timeout=120, what="the job to train")
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    down_at = time.monotonic()
    spec = {"model": "cifar_net", "dataset": cluster["dataset"], "epochs": 1, "batch_size": 8}
    calls = [("GET", "/jobs", {}), ("GET", f"/jobs/{job_id}", {}), ("POST", f"/jobs/{job_id}/cancel", {}),
             ("GET", f"/jobs/{job_id}/events", {}), ("GET", f"/jobs/{job_id}/checkpoint", {}),
             ("POST", "/jobs", {"json": spec, "headers": {"Idempotency-Key": "during-outage"}}),
             ("GET", "/devices", {}), ("GET", "/datasets", {}), ("GET", f"/datasets/{cluster['dataset']}", {}),
             ("POST", "/datasets", {"files": {"file": ("t.zip", pattern_zip(), "application/zip")}}),
             ("POST", "/predict", {"data": {"job_id": job_id}, "files": {"file": ("p.png", pattern_png(1), "image/png")}}),
             ("GET", "/readyz", {})]
    for method, path, kwargs in calls:
        answer = client.request(method, path, **kwargs)
        assert answer.status_code == 503 and answer.json()["detail"], (method, path, answer.status_code, answer.text)
    for path in ("/healthz", "/models", "/"):
        assert client.get(path).status_code == 200, path
    scrape = client.get("/metrics")
    assert scrape.status_code == 200 and "torchyard_redis_up 0.0" in scrape.text

    # Three lease TTLs without a renewal (TEST_REDIS_OUTAGE_S=60 for the full minute; docs/reliability.md).
    time.sleep(max(0.0, float(os.environ.get("TEST_REDIS_OUTAGE_S", "6")) - (time.monotonic() - down_at)))
    server.start()
    done = wait_for_job(client, job_id, TERMINAL, timeout=180)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 1, "a lease was swept after the outage: the job was redelivered"
    assert_ran_once(client, done, epochs)
    running = [e for kind, e in job_events(client, job_id) if kind == "status" and e["status"] == "running"]
    assert len(running) == 1

    # The client retrying its POST with the same key gets one job; the workers' consumers reconnected.
    retried = client.post("/jobs", json=spec, headers={"Idempotency-Key": "during-outage"})
    again = client.post("/jobs", json=spec, headers={"Idempotency-Key": "during-outage"})
    assert retried.status_code == 202 and again.status_code == 200 and again.json()["id"] == retried.json()["id"]
    other = client.post("/jobs", json={**spec, "epochs": 2}, headers={"Idempotency-Key": "during-outage"})
    assert other.status_code == 422 and "different request" in other.json()["detail"]
    assert wait_for_job(client, retried.json()["id"], TERMINAL, timeout=120)["status"] == "succeeded"


def test_what_a_dying_process_leaves_half_done_is_completed_by_the_workers(cluster: dict) -> None:
    """Two crash points, left exactly as a process SIGKILLed there leaves them (the moments are
    microseconds wide, so the state is made with the job store itself, on the cluster's Redis):
    (1) the accepting process committed a job and could not send its message (its broker was
    gone): the workers' dispatch reconciler sends it within about a lease TTL; (2) a worker
    recorded `succeeded` and died before moving its model.pt out of its delivery's directory:
    a sweep promotes it, so the download matches the recorded sha256."""
    from core.jobs import JobStore
    from core.kinds.train import JobSpec, resolve_params
    from core.queue import create_celery, dispatcher
    from core.redis import connect
    from core.schemas import JobStatus
    from core.storage import CheckpointPaths

    dead_broker = create_celery(Settings(redis_url=f"unix://{cluster['data_dir']}/no-such-redis.sock?db=0"))
    store = JobStore(connect(cluster["url"]), dispatcher(dead_broker), lease_ttl_s=2)
    spec = JobSpec(model="cifar_net", dataset=cluster["dataset"], epochs=1, batch_size=8)
    params = resolve_params(spec)
    never_sent, created = store.create(model=spec.model, dataset=spec.dataset, params=params, requested_device="auto")
    assert created and never_sent.status.value == "queued"

    orphan, _ = store.create(model=spec.model, dataset=spec.dataset, params=params, requested_device="h9/cpu")
    token = store.raw_field(orphan.id, "delivery")
    assert store.claim(orphan.id, token, worker="cpu@h9", device_id="h9/cpu", instance="dies").run
    paths = CheckpointPaths(cluster["data_dir"] / "checkpoints")
    staged = paths.staged(orphan.id, token, "model.pt")
    staged.parent.mkdir(parents=True)
    staged.write_bytes(b"the weights of the delivery that finished")
    digest = hashlib.sha256(staged.read_bytes()).hexdigest()
    assert store.finish(orphan.id, token, JobStatus.succeeded, promote=["model.pt"],
                        checkpoint={"url": f"/jobs/{orphan.id}/checkpoint", "sha256": digest, "bytes": 41})

    client = cluster["client"]
    done = wait_for_job(client, never_sent.id, TERMINAL, timeout=90)
    assert done["status"] == "succeeded" and done["attempts"] == 1, done
    body = wait_until(lambda: (r := client.get(f"/jobs/{orphan.id}/checkpoint")).status_code == 200 and r.content,
                      timeout=60, what="a sweep to promote the dead owner's model.pt")
    assert hashlib.sha256(body).hexdigest() == digest
    assert sorted(p.name for p in paths.job_dir(orphan.id).iterdir()) == ["model.pt"]


def test_predictions_held_by_a_killed_worker_are_answered_by_the_other(cluster: dict) -> None:
    """Clients keep predicting; the worker that answered the first request (it holds the model, so
    the API prefers it) is SIGKILLed mid-stream, holding requests it had taken and with more still
    queued on its list (until its heartbeat lapses, the API goes on sending there). Every request is
    answered 200 with its own file, those sent after the kill by the other host, none waits out the
    timeout, and nothing is left on the dead one's list."""
    import redis

    from core import keys

    client, procs, workers = cluster["client"], cluster["procs"], cluster["workers"]
    trained = _train(cluster, 1)
    assert wait_for_job(client, trained, TERMINAL, timeout=180)["status"] == "succeeded"
    warm = client.post("/predict", data={"job_id": trained}, files={"file": ("w.png", pattern_png(1), "image/png")})
    assert warm.status_code == 200, warm.text
    holder = warm.json()["device"]  # it holds the model now: the API prefers it
    other = "h2/cpu" if holder == "h1/cpu" else "h1/cpu"
    answers: list[tuple[int, str, str, float, float]] = []  # status, device, file, sent, answered
    stop_at = [float("inf")]

    def predict_until_stopped(n: int) -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=60) as own:
            k = 0
            while time.monotonic() < stop_at[0]:
                name = f"c{n}-{k}.png"
                sent = time.monotonic()
                answer = own.post("/predict", data={"job_id": trained},
                                  files={"file": (name, pattern_png(k % 4), "image/png")})
                body = answer.json()
                answers.append((answer.status_code, body.get("device", ""),
                                body["results"][0]["filename"] if answer.status_code == 200 else body["detail"],
                                sent, time.monotonic()))
                assert body.get("results", [{}])[0].get("filename", name) == name
                k += 1

    with concurrent.futures.ThreadPoolExecutor(8) as load:
        running = [load.submit(predict_until_stopped, n) for n in range(4)]
        wait_until(lambda: len(answers) >= 20, timeout=60, what="predictions under way")
        node = holder.split("/")[0]
        workers[node].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        stop_at[0] = killed_at + 1.0
        time.sleep(0.5)  # its heartbeat has not lapsed yet: these go to its list, for nobody
        running += [load.submit(predict_until_stopped, n) for n in range(4, 8)]
        for done in running:
            done.result()
    try:
        assert not [a for a in answers if a[0] != 200], [a for a in answers if a[0] != 200][:5]
        # Those in flight when the worker died were answered by it just before (their replies on their
        # way) or by the other host; some sent after it died went to its list (its heartbeat had not
        # lapsed yet) and waited to be sent again.
        after = [a for a in answers if a[3] > killed_at]
        assert after and all(a[1] == other for a in after), after
        assert any(a[4] - a[3] > 1.0 for a in after), after
        heartbeat_ttl_s = 3  # tests/support.Processes
        assert max(a[4] - a[3] for a in answers) < heartbeat_ttl_s + 15  # not the 30 s timeout
        assert redis.Redis.from_url(cluster["url"]).llen(keys.predict_queue(holder)) == 0
        scrape = client.get("/metrics").text
        orphaned = float(re.search(r"^torchyard_predict_orphaned_total (\S+)$", scrape, re.M).group(1))
        assert orphaned >= 1
    finally:
        workers[node].wait(10)
        workers[node] = procs.worker("cpu", name=node, TORCHYARD_NODE_NAME=node)
