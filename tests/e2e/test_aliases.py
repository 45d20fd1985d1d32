"""Aliases end to end on the shared stack (real Redis, a real CPU worker, the API as processes):
the records, history and rollback; the refusals; /predict through an alias while it moves (every
answer names one job and matches that job's own output, none fails); and the warm-up that loads the
new target on the device that holds the old one before the move."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
import torch

from tests.support import png_bytes, wait_for_job, wait_until
from worker.data.datasets import fake_images

pytestmark = pytest.mark.e2e

IMAGES = [(f"pattern_{k}.png", png_bytes(fake_images(torch.tensor([k]), 3, 32, 32, seed=5)[0].permute(1, 2, 0).numpy()))
          for k in (1, 4, 7)]


def _train(client: httpx.Client, *seeds: int) -> list[str]:
    jobs = [client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1, "seed": s}).json()
            for s in seeds]
    done = [wait_for_job(client, j["id"], {"succeeded", "failed"}, timeout=240) for j in jobs]
    assert [d["status"] for d in done] == ["succeeded"] * len(seeds), [d.get("error") for d in done]
    return [d["id"] for d in done]


@pytest.fixture(scope="module")
def jobs(cifar_pair: tuple[str, str]) -> tuple[str, str]:
    return cifar_pair


def _predict(client: httpx.Client, **target: str) -> httpx.Response:
    return client.post("/predict", data={**target, "top_k": "10"},
                       files=[("file", (name, data, "image/png")) for name, data in IMAGES])


def _probabilities(body: dict) -> np.ndarray:
    out = np.zeros((len(body["results"]), 10))
    for row, result in enumerate(body["results"]):
        for p in result["predictions"]:
            out[row, p["index"]] = p["probability"]
    return out


def _device(client: httpx.Client) -> dict:
    return next(d for d in client.get("/devices").json()["devices"] if d["status"] != "offline")


def _resident(client: httpx.Client, job_id: str) -> dict | None:
    """The device record once its heartbeat says `job_id` is resident (the warm-up reads the same)."""
    device = _device(client)
    return device if job_id in device["loaded_models"] else None


def test_set_move_rollback_history_delete(stack: dict, jobs: tuple[str, str]) -> None:
    client = stack["client"]
    a, b = jobs
    who = {"User-Agent": "release-bot/1.0"}
    created = client.put("/aliases/pets-lifecycle", json={"job_id": a, "note": "first model"}, headers=who)
    assert created.status_code == 201, created.text
    assert created.json()["job_id"] == a and created.json()["previous_job_id"] is None
    assert created.json()["model"] == "cifar_net" and created.json()["moves"] == 1
    moved = client.put("/aliases/pets-lifecycle", json={"job_id": b}, headers=who)
    assert moved.status_code == 200, moved.text
    assert (moved.json()["job_id"], moved.json()["previous_job_id"], moved.json()["moves"]) == (b, a, 2)
    assert {"name": "pets-lifecycle", "job_id": b} .items() <= next(
        x for x in client.get("/aliases").json()["aliases"] if x["name"] == "pets-lifecycle").items()

    back = client.post("/aliases/pets-lifecycle/rollback", json={"note": "b regressed"})
    assert back.status_code == 200, back.text
    assert (back.json()["job_id"], back.json()["previous_job_id"]) == (a, b)
    assert client.get("/aliases/pets-lifecycle").json()["job_id"] == a

    history = client.get("/aliases/pets-lifecycle/history").json()["moves"]
    assert [(m["action"], m["from_job_id"], m["to_job_id"]) for m in history] == [
        ("rollback", b, a), ("set", a, b), ("set", None, a)]
    assert history[0]["note"] == "b regressed" and history[2]["note"] == "first model"
    assert history[2]["user_agent"] == "release-bot/1.0" and history[2]["by"] == "127.0.0.1"
    assert history[0]["at"] >= history[1]["at"] >= history[2]["at"]

    assert client.delete("/aliases/pets-lifecycle", params={"note": "retired"}).status_code == 204
    assert client.get("/aliases/pets-lifecycle").status_code == 404
    assert "pets-lifecycle" not in [x["name"] for x in client.get("/aliases").json()["aliases"]]
    kept = client.get("/aliases/pets-lifecycle/history").json()["moves"]
    assert (kept[0]["action"], kept[0]["from_job_id"], kept[0]["note"]) == ("delete", a, "retired")
    assert len(kept) == 4
    assert client.post("/aliases/pets-lifecycle/rollback").status_code == 404
    assert _predict(client, alias="pets-lifecycle").status_code == 404


def test_refusals(stack: dict, jobs: tuple[str, str]) -> None:
    client = stack["client"]
    a, _ = jobs
    for bad in ("Pets", "-pets", "pets-", "a..b", "x" * 65, "pets%20x", "pét"):
        answer = client.put(f"/aliases/{bad}", json={"job_id": a})
        assert answer.status_code == 422, (bad, answer.text)
    assert client.put("/aliases/pets-refused", json={"job_id": "00000000000000nosuchjob"}).status_code == 404
    assert client.put("/aliases/pets-refused", json={"job_id": a, "extra": 1}).status_code == 422
    long_running = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 200}).json()
    try:
        refused = client.put("/aliases/pets-refused", json={"job_id": long_running["id"]})
        assert refused.status_code == 409 and "succeeded" in refused.json()["detail"]
    finally:
        client.post(f"/jobs/{long_running['id']}/cancel")
    assert client.get("/aliases/pets-refused").status_code == 404  # nothing was created
    assert client.put("/aliases/pets-once", json={"job_id": a}).status_code == 201
    no_way_back = client.post("/aliases/pets-once/rollback")
    assert no_way_back.status_code == 409 and "previous" in no_way_back.json()["detail"]
    # /predict: exactly one of job_id and alias
    assert _predict(client, job_id=a, alias="pets-once").status_code == 422
    assert _predict(client).status_code == 422
    assert _predict(client, alias="Not/An/Alias").status_code == 422
    assert _predict(client, alias="pets-nobody").status_code == 404
    wait_for_job(client, long_running["id"], {"cancelled", "failed", "succeeded"})


def test_predict_through_an_alias_while_it_moves(stack: dict, jobs: tuple[str, str]) -> None:
    """Clients predict through the alias continuously while it moves a→b→a→b: every answer is a 200
    that names the alias and one job, and its probabilities are that job's own."""
    client = stack["client"]
    a, b = jobs
    expected = {}
    for job_id in (a, b):
        answer = _predict(client, job_id=job_id)
        assert answer.status_code == 200, answer.text
        expected[job_id] = _probabilities(answer.json())
    assert not np.allclose(expected[a], expected[b], atol=1e-3)  # the two models are told apart
    assert client.put("/aliases/pets-live", json={"job_id": a}).status_code == 201

    answers: list[tuple[int, dict]] = []
    stop = threading.Event()

    def predict_until_stopped() -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=60) as own:
            while not stop.is_set():
                response = _predict(own, alias="pets-live")
                answers.append((response.status_code, response.json()))

    threads = [threading.Thread(target=predict_until_stopped) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        moves = []
        for step in ("put-b", "rollback", "put-b", "rollback"):
            time.sleep(0.4)
            if step == "put-b":
                moves.append(client.put("/aliases/pets-live", json={"job_id": b}))
            else:
                moves.append(client.post("/aliases/pets-live/rollback"))
        time.sleep(0.4)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert [m.status_code for m in moves] == [200] * 4, [m.text for m in moves]
    assert [m.json()["job_id"] for m in moves] == [b, a, b, a]
    failed = [(status, body) for status, body in answers if status != 200]
    assert not failed, failed[:3]
    assert len(answers) >= 10
    seen = set()
    for _, body in answers:
        assert body["alias"] == "pets-live" and body["job_id"] in (a, b)
        seen.add(body["job_id"])
        np.testing.assert_allclose(_probabilities(body), expected[body["job_id"]], atol=1e-4)
    assert seen == {a, b}


def test_a_move_loads_the_new_model_where_the_old_one_is_resident(stack: dict, jobs: tuple[str, str]) -> None:
    client = stack["client"]
    a, _ = jobs
    (fresh,) = _train(client, 13)
    assert client.put("/aliases/pets-warm", json={"job_id": a}).status_code == 201
    assert _predict(client, alias="pets-warm").status_code == 200
    device = wait_until(lambda: _resident(client, a), timeout=10, what=f"job {a} resident on the device")
    assert fresh not in device["loaded_models"]

    moved = client.put("/aliases/pets-warm", json={"job_id": fresh}).json()
    assert moved["job_id"] == fresh
    assert [(w["device"], w["status"]) for w in moved["warm"]] == [(device["id"], "loaded")]
    loads = wait_until(lambda: _resident(client, fresh), timeout=10, what="the warmed model in the heartbeat")[
        "inference"]["cache"]["loads"]
    for _ in range(3):
        answer = _predict(client, alias="pets-warm")
        assert answer.status_code == 200 and answer.json()["job_id"] == fresh
    time.sleep(1.5)  # a heartbeat or two
    assert _device(client)["inference"]["cache"]["loads"] == loads  # served from the warmed model: no load

    back = client.post("/aliases/pets-warm/rollback").json()
    assert [w["status"] for w in back["warm"]] == ["resident"]  # a is still in the cache (LRU of 8)


def test_a_model_that_cannot_load_where_the_old_one_serves_is_not_promoted(stack: dict, jobs: tuple[str, str]) -> None:
    """The warm-up is also a check: a target whose checkpoint the worker cannot read is refused (409)
    before any request could fail on it, and the alias stays where it was."""
    client = stack["client"]
    a, _ = jobs
    (damaged,) = _train(client, 14)
    checkpoint = stack["data_dir"] / "checkpoints" / damaged / "model.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:2000])  # truncated on the shared storage
    assert client.put("/aliases/pets-guarded", json={"job_id": a}).status_code == 201
    assert _predict(client, alias="pets-guarded").status_code == 200
    wait_until(lambda: _resident(client, a), timeout=10, what=f"job {a} resident on the device")
    refused = client.put("/aliases/pets-guarded", json={"job_id": damaged})
    assert refused.status_code == 409, refused.text
    assert "cannot be loaded" in refused.json()["detail"] and "not moved" in refused.json()["detail"]
    assert client.get("/aliases/pets-guarded").json()["job_id"] == a
    assert _predict(client, alias="pets-guarded").json()["job_id"] == a
