"""Projects against real processes (an API with the bootstrap key, a CPU worker) and a real Redis:
two teams' trainers, alpha and beta, on one service. The isolation matrix is generated from the
OpenAPI document: every route that takes an id, called by beta with alpha's object, answers 404
and changes nothing. Then the lists, the event streams, /predict (an alias name in each project),
/v2, /devices and /metrics, and the admin's view of all and `?project=`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.main import create_app
from core.config import Settings
from tests.support import Processes, flush, pattern_png, pattern_zip, wait_for_job, wait_until, with_db

pytestmark = pytest.mark.e2e

KEY = "bootstrap-admin-key-for-the-projects-tests"
TRAIN = {"model": "cifar_net", "dataset": "fake", "epochs": 1, "patience": 0, "seed": 1}


def _id_routes() -> list[tuple[str, str]]:
    spec = create_app(Settings(redis_url="redis://127.0.0.1:1/0")).openapi()
    return sorted((m.upper(), p) for p, ops in spec["paths"].items() for m in ops if "{" in p)


ID_ROUTES = _id_routes()


def _client(base: str, secret: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {secret}"}, timeout=120)


@pytest.fixture(scope="module")
def teams(redis_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """alpha: a dataset, a trained job with an evaluation, the alias `pets`, a (cancelled) sweep;
    beta: a trained job and its own alias `pets`."""
    data_dir: Path = tmp_path_factory.mktemp("projects")
    url = with_db(redis_base_url, 15)
    flush(url)
    procs = Processes(url, data_dir, data_dir / "logs", TORCHYARD_API_KEY=KEY)
    procs.worker("cpu")
    base = procs.ready_api()
    admin = _client(base, KEY)
    try:
        wait_until(lambda: admin.get("/readyz").status_code == 200, timeout=120, what="a worker")
        secrets = {team: admin.post("/keys", json={"name": f"{team}-trainer", "role": "trainer", "project": team})
                   .json()["secret"] for team in ("alpha", "beta")}
        alpha, beta = _client(base, secrets["alpha"]), _client(base, secrets["beta"])
        dataset = alpha.post("/datasets", files={"file": ("d.zip", pattern_zip(), "application/zip")},
                             data={"name": "shared-name"})
        assert dataset.status_code == 201, dataset.text
        jobs = {}
        for team, client in (("alpha", alpha), ("beta", beta)):
            created = client.post("/jobs", json=TRAIN)
            assert created.status_code == 202, created.text
            jobs[team] = created.json()["id"]
        for team, client in (("alpha", alpha), ("beta", beta)):
            assert wait_for_job(client, jobs[team], {"succeeded", "failed"}, timeout=300)["status"] == "succeeded"
            assert client.put("/aliases/pets", json={"job_id": jobs[team]}).status_code == 201
        evaluation = alpha.post(f"/jobs/{jobs['alpha']}/evaluate", json={"dataset": "fake"})
        assert evaluation.status_code == 202, evaluation.text
        sweep = alpha.post("/sweeps", json={"base": TRAIN, "space": {"learning_rate": {
            "type": "float", "low": 1e-3, "high": 1e-1, "log": True}}, "trials": 1, "parallel": 1})
        assert sweep.status_code == 201, sweep.text
        alpha.post(f"/sweeps/{sweep.json()['id']}/cancel")
        yield {"base": base, "admin": admin, "alpha": alpha, "beta": beta, "jobs": jobs,
               "dataset": dataset.json()["id"], "evaluation": evaluation.json()["id"], "sweep": sweep.json()["id"]}
        alpha.close()
        beta.close()
    finally:
        admin.close()
        procs.stop_all()
        flush(url)


def _alpha_state(teams: dict) -> dict:
    alpha = teams["alpha"]
    job = alpha.get(f"/jobs/{teams['jobs']['alpha']}").json()
    return {"job": (job["status"], job["checkpoint"]["sha256"], job["project"]),
            "dataset": alpha.get(f"/datasets/{teams['dataset']}").json(),
            "alias": alpha.get("/aliases/pets").json(),
            "history": alpha.get("/aliases/pets/history").json(),
            "sweep": alpha.get(f"/sweeps/{teams['sweep']}").json()["status"],
            "jobs": sorted(j["id"] for j in alpha.get("/jobs", params={"limit": 500}).json()["jobs"])}


def test_another_projects_objects_do_not_exist_for_a_key(teams: dict) -> None:
    """The isolation matrix: every route of the OpenAPI document with an id, beta's trainer asking
    for alpha's object: 404 each time, and alpha's objects as they were."""
    ids = {"job_id": teams["jobs"]["alpha"], "evaluation_id": teams["evaluation"], "dataset": teams["dataset"],
           "name": "alpha-only", "sweep_id": teams["sweep"]}
    bodies = {"/jobs/{job_id}/evaluate": {"dataset": "fake"}, "/aliases/{name}": {"job_id": teams["jobs"]["alpha"]}}
    alpha = teams["alpha"]
    assert alpha.put("/aliases/alpha-only", json={"job_id": teams["jobs"]["alpha"]}).status_code == 201
    before = _alpha_state(teams)
    wrong = []
    for method, path in ID_ROUTES:
        if "{key_id}" in path or (method, path) == ("PUT", "/projects/{name}"):
            continue  # the admin's alone (a trainer's 403: tests/e2e/test_keys.py)
        where = {**ids, "name": "alpha"} if path.startswith("/projects/") else ids  # the project itself
        concrete = re.sub(r"\{([^}]+)\}", lambda m, where=where: where[m[1]], path)
        params = {"format": "onnx"} if path.endswith("/export") else None
        body = bodies.get(path) if method in ("POST", "PUT") else None
        answer = teams["beta"].request(method, concrete, params=params, json=body)
        if answer.status_code != 404:
            wrong.append(f"{method} {path}: {answer.status_code} {answer.text[:150]}")
    assert not wrong, "\n".join(wrong)
    assert _alpha_state(teams) == before
    assert teams["beta"].get("/aliases/alpha-only").status_code == 404


def test_lists_and_streams_show_a_projects_own_objects(teams: dict) -> None:
    alpha, beta, jobs = teams["alpha"], teams["beta"], teams["jobs"]
    beta_jobs = {j["id"] for j in beta.get("/jobs").json()["jobs"]}
    assert jobs["beta"] in beta_jobs and jobs["alpha"] not in beta_jobs and teams["evaluation"] not in beta_jobs
    assert all(j["project"] == "beta" for j in beta.get("/jobs").json()["jobs"])
    datasets = {d["id"]: d for d in beta.get("/datasets").json()["datasets"]}
    assert teams["dataset"] not in datasets and {"fake", "cifar10"} <= set(datasets)  # built-ins are shared
    assert beta.delete("/datasets/fake").status_code == 409  # ... read-only
    assert [(a["name"], a["job_id"], a["project"]) for a in beta.get("/aliases").json()["aliases"]] == [
        ("pets", jobs["beta"], "beta")]
    assert beta.get("/sweeps").json()["sweeps"] == []
    assert [s["id"] for s in alpha.get("/sweeps").json()["sweeps"]] == [teams["sweep"]]
    assert beta.get(f"/jobs/{jobs['alpha']}/events").status_code == 404
    assert beta.post("/jobs", json={**TRAIN, "dataset": teams["dataset"]}).status_code == 422  # unknown to it
    assert beta.post("/jobs", json={**TRAIN, "init_from": jobs["alpha"]}).status_code in (404, 422)
    assert teams["dataset"] in alpha.get("/datasets").text
    # A name is a project's: beta may upload a set under a name alpha uses.
    assert beta.post("/datasets", files={"file": ("d.zip", pattern_zip(), "application/zip")},
                     data={"name": "shared-name"}).status_code == 201


def test_an_alias_name_means_each_projects_own_model(teams: dict) -> None:
    png = pattern_png(3)
    for team in ("alpha", "beta"):
        answer = teams[team].post("/predict", data={"alias": "pets"}, files=[("file", ("x.png", png, "image/png"))])
        assert answer.status_code == 200, answer.text
        assert answer.json()["job_id"] == teams["jobs"][team] and answer.json()["alias"] == "pets"
    refused = teams["beta"].post("/predict", data={"job_id": teams["jobs"]["alpha"]},
                                 files=[("file", ("x.png", png, "image/png"))])
    assert refused.status_code == 404, refused.text
    assert teams["beta"].get(f"/v2/models/{teams['jobs']['alpha']}").status_code == 404
    assert teams["beta"].get("/v2/models/pets").json()["name"] == "pets"
    index = teams["beta"].post("/v2/repository/index", json={}).json()
    assert teams["jobs"]["alpha"] not in {m["name"] for m in index} and teams["jobs"]["beta"] in {m["name"] for m in index}


def test_devices_show_another_projects_work_only_as_busy(teams: dict) -> None:
    alpha_job, beta_job = teams["jobs"]["alpha"], teams["jobs"]["beta"]
    # Both models are resident once the worker's next heartbeat says so (both teams predicted above).
    wait_until(lambda: all(any(job in d["loaded_models"] for d in teams["admin"].get("/devices").json()["devices"])
                           for job in (alpha_job, beta_job)), timeout=60, what="both models resident")
    seen = {d["id"]: d for d in teams["beta"].get("/devices").json()["devices"]}
    admin = {d["id"]: d for d in teams["admin"].get("/devices").json()["devices"]}
    assert set(seen) == set(admin)  # every device, whoever's work it does
    assert not any(alpha_job in d["loaded_models"] or d["current_job"] == alpha_job for d in seen.values())
    assert any(beta_job in d["loaded_models"] for d in seen.values())
    metrics = teams["beta"].get("/metrics").text
    assert alpha_job not in metrics


def test_the_admin_sees_every_project_and_filters_by_one(teams: dict) -> None:
    admin, jobs = teams["admin"], teams["jobs"]
    everything = {j["id"]: j["project"] for j in admin.get("/jobs", params={"limit": 500}).json()["jobs"]}
    assert everything[jobs["alpha"]] == "alpha" and everything[jobs["beta"]] == "beta"
    only_beta = {j["id"] for j in admin.get("/jobs", params={"project": "beta"}).json()["jobs"]}
    assert jobs["beta"] in only_beta and jobs["alpha"] not in only_beta
    assert admin.get(f"/jobs/{jobs['alpha']}", params={"project": "beta"}).status_code == 404
    projects = {(a["project"], a["name"]) for a in admin.get("/aliases").json()["aliases"]}
    assert {("alpha", "pets"), ("beta", "pets")} <= projects
    assert admin.get("/aliases/pets", params={"project": "alpha"}).json()["job_id"] == jobs["alpha"]
    assert teams["beta"].get("/jobs", params={"project": "alpha"}).status_code == 403
    assert teams["beta"].get("/jobs", params={"project": "beta"}).status_code == 200
