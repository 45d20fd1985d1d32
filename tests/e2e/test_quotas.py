"""Projects' quotas against a real API process (the bootstrap key, no worker: jobs stay queued)
and a real Redis: a job over `queued_jobs` is a 429 with Retry-After naming the quota, an upload
over `dataset_bytes` a 429 without (waiting does not help); both exact under requests at once
(threads hitting the API together); a project's members read its quotas and use, others get a
404; `torchyard projects show|set-quota`."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import KeyedApi
from tests.e2e.test_cli import CLI, cli_env
from tests.support import REPO, pattern_zip

pytestmark = pytest.mark.e2e

KEY = "bootstrap-admin-key-for-the-quota-tests"
JOB = {"model": "cifar_net", "dataset": "fake", "epochs": 1}
NO_QUOTA = {"queued_jobs": None, "dataset_bytes": None, "predict_per_second": None, "running_jobs": None,
            "devices_held": None, "device_seconds_per_day": None}


KEYED_API_KEYS = [("gamma", "trainer", "gamma"), ("gamma-viewer", "viewer", "gamma"), ("delta", "trainer", "delta")]


@pytest.fixture(scope="module")
def api(keyed_api: KeyedApi) -> Iterator[dict]:
    """The module's keyed API (tests/e2e/conftest.py) and a client per key."""
    clients = {"admin": keyed_api.client(), **{name: keyed_api.client(name) for name in keyed_api.secrets}}
    try:
        yield {"base": keyed_api.base, **clients}
    finally:
        for client in clients.values():
            client.close()


def test_a_job_past_the_queued_jobs_quota_is_a_429_to_retry(api: dict) -> None:
    set_ = api["admin"].put("/projects/gamma", json={"queued_jobs": 2})
    assert set_.status_code == 200 and set_.json()["quota"] == {"queued_jobs": 2, "dataset_bytes": None,
                                                                "predict_per_second": None, "running_jobs": None,
                                                                "devices_held": None, "device_seconds_per_day": None}
    gamma = api["gamma"]
    first = gamma.post("/jobs", json=JOB, headers={"Idempotency-Key": "first"})
    assert first.status_code == 202, first.text
    assert gamma.post("/jobs", json=JOB).status_code == 202
    refused = gamma.post("/jobs", json=JOB)
    assert refused.status_code == 429 and refused.headers["retry-after"].isdigit()
    assert "queued_jobs = 2" in refused.json()["detail"] and "gamma" in refused.json()["detail"]
    again = gamma.post("/jobs", json=JOB, headers={"Idempotency-Key": "first"})  # a retry is not a new job
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    assert api["delta"].post("/jobs", json=JOB).status_code == 202  # another project's quota is its own
    view = api["gamma-viewer"].get("/projects/gamma").json()
    assert view["usage"]["queued_jobs"] == 2 and view["usage"]["running_jobs"] == 0
    assert gamma.post(f"/jobs/{first.json()['id']}/cancel").status_code == 202
    assert gamma.post("/jobs", json=JOB).status_code == 202  # a place freed


def test_an_upload_past_the_dataset_bytes_quota_is_a_429_without_retry_after(api: dict) -> None:
    archive = pattern_zip()
    assert api["admin"].put("/projects/gamma", json={"queued_jobs": 2, "dataset_bytes": len(archive) + 10}
                            ).status_code == 200
    gamma = api["gamma"]

    def upload() -> httpx.Response:
        return gamma.post("/datasets", files={"file": ("d.zip", archive, "application/zip")})

    first = upload()
    assert first.status_code == 201, first.text
    refused = upload()
    assert refused.status_code == 429 and "retry-after" not in refused.headers
    assert f"dataset_bytes = {len(archive) + 10}" in refused.json()["detail"]
    assert api["gamma-viewer"].get("/projects/gamma").json()["usage"]["dataset_bytes"] == len(archive)
    assert gamma.delete(f"/datasets/{first.json()['id']}").status_code == 204
    assert upload().status_code == 201


def _at_once(count: int, base: str, secret: str, request: Callable[[httpx.Client], httpx.Response]) -> list[int]:
    """`count` requests sent together (each thread on its own connection, released by a barrier):
    their statuses."""
    start = threading.Barrier(count)

    def one(_: int) -> int:
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {secret}"}, timeout=120) as client:
            start.wait()
            return request(client).status_code

    with ThreadPoolExecutor(count) as pool:
        return sorted(pool.map(one, range(count)))


def _trainer_of(api: dict, project: str) -> str:
    made = api["admin"].post("/keys", json={"name": f"{project}-trainer", "role": "trainer", "project": project})
    assert made.status_code == 201, made.text
    return str(made.json()["secret"])


def test_jobs_at_once_at_the_queued_jobs_quota_admit_exactly_it(api: dict) -> None:
    secret = _trainer_of(api, "zeta")
    assert api["admin"].put("/projects/zeta", json={"queued_jobs": 2}).status_code == 200
    statuses = _at_once(8, api["base"], secret, lambda client: client.post("/jobs", json=JOB))
    assert statuses == [202] * 2 + [429] * 6
    assert api["admin"].get("/projects/zeta").json()["usage"]["queued_jobs"] == 2


def test_uploads_at_once_at_the_dataset_bytes_quota_admit_exactly_it(api: dict) -> None:
    archive = pattern_zip()
    secret = _trainer_of(api, "eta")
    assert api["admin"].put("/projects/eta", json={"dataset_bytes": 2 * len(archive) + 10}).status_code == 200
    statuses = _at_once(6, api["base"], secret,
                        lambda client: client.post("/datasets", files={"file": ("d.zip", archive, "application/zip")}))
    assert statuses == [201] * 2 + [429] * 4
    assert api["admin"].get("/projects/eta").json()["usage"]["dataset_bytes"] == 2 * len(archive)


def test_a_project_is_read_by_its_members_and_set_by_an_admin(api: dict) -> None:
    assert api["delta"].get("/projects/gamma").status_code == 404
    assert api["gamma"].put("/projects/gamma", json={"queued_jobs": 100}).status_code == 403
    assert api["gamma"].get("/projects/gamma").status_code == 200
    assert api["admin"].put("/projects/gamma", json={"queued_jobs": -1}).status_code == 422
    assert api["admin"].put("/projects/Not_A_Name", json={}).status_code == 422


def test_the_projects_commands(api: dict) -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, "projects", *args, "--url", api["base"], "--api-key", KEY, "--json"],
                              cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)

    import json

    changed = run("set-quota", "epsilon", "--queued-jobs", "7", "--running-jobs", "2", "--devices-held", "3",
                  "--device-seconds-per-day", "3600")
    assert changed.returncode == 0, changed.stderr
    assert json.loads(changed.stdout)["quota"] == {**NO_QUOTA, "queued_jobs": 7, "running_jobs": 2, "devices_held": 3,
                                                   "device_seconds_per_day": 3600}
    cleared = run("set-quota", "epsilon", "--queued-jobs", "-1", "--dataset-bytes", "1000", "--running-jobs", "-1",
                  "--devices-held", "-1", "--device-seconds-per-day", "-1")
    assert json.loads(cleared.stdout)["quota"] == {**NO_QUOTA, "dataset_bytes": 1000}
    shown = run("show", "epsilon")
    assert shown.returncode == 0 and json.loads(shown.stdout)["usage"]["queued_jobs"] == 0


def test_predictions_past_the_predict_per_second_quota_are_a_429_before_the_body(api: dict) -> None:
    """No worker here: an admitted prediction gets its 503; one past the quota, a 429 saying which."""
    form = {"files": [("file", ("x.png", b"\x89PNG not really", "image/png"))], "data": {"job_id": "nosuchjob"}}
    assert api["gamma"].post("/predict", **form).status_code != 429
    assert api["admin"].put("/projects/gamma", json={"predict_per_second": 0}).status_code == 200

    def refused() -> bool:  # each API process reads the quota again within a second
        answer = api["gamma"].post("/predict", **form)
        return answer.status_code == 429 and answer.headers["retry-after"] == "1" and \
            "predict_per_second = 0" in answer.json()["detail"]

    from tests.support import wait_until

    wait_until(refused, timeout=30, what="the quota applied")
    assert api["gamma"].post("/v2/models/nosuchjob/infer", json={"inputs": []}).status_code == 429
    assert api["delta"].post("/predict", **form).status_code != 429  # another project's quota is its own
    assert api["admin"].put("/projects/gamma", json={"predict_per_second": None}).status_code == 200


def test_the_sdk_manages_keys_and_quotas_with_typed_answers(api: dict) -> None:
    """What `torchyard keys` and `torchyard projects` do, through the SDK's public calls (client/teams.py)."""
    from client.sdk import ApiError, TorchyardClient
    from core.access.models import KeyCreated, ProjectView
    from core.access.roles import Role

    with TorchyardClient(api["base"], api_key=KEY) as ty:
        made = ty.create_key("theta-bot", "viewer", project="theta", expires_in_days=1)
        assert isinstance(made, KeyCreated) and made.role is Role.viewer and made.secret.startswith("tyk_")
        listed = {k.id: k for k in ty.api_keys()}
        assert listed[made.id].active and not hasattr(listed[made.id], "secret")
        changed = ty.update_quota("theta", queued_jobs=3, devices_held=2)
        assert isinstance(changed, ProjectView) and changed.quota.queued_jobs == 3
        kept = ty.update_quota("theta", queued_jobs=None)  # the others stay as they were
        assert kept.quota.queued_jobs is None and kept.quota.devices_held == 2
        assert ty.project("theta").usage.queued_jobs == 0
        with pytest.raises(ApiError) as invalid:  # the server checks the body, as for any call
            ty.update_quota("theta", queued_jobs=-1)
        assert invalid.value.status == 422 and ty.project("theta").quota.devices_held == 2
        ty.revoke_key(made.id)
        assert not {k.id: k for k in ty.api_keys()}[made.id].active
    with TorchyardClient(api["base"], api_key=made.secret) as revoked, pytest.raises(ApiError) as refused:
        revoked.project("theta")
    assert refused.value.status == 401
