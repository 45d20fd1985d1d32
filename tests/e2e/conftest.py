"""Fixtures of the end-to-end tests that several modules share (on the session's `stack`, or an
API of a module's own: `keyed_api`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support import Processes, flush, wait_for_job, with_db

# The Redis database of each module that uses `keyed_api`: one each, named nowhere else in tests/
# (tests/test_guards.py checks), so one module's flush never empties another's data. The session's
# are tests/support.TEST_DB (13) and clean_redis_url's (14); 11, 12, 14 and 15 are other modules'.
KEYED_API_DBS = {"test_quotas": 9, "test_dashboard_roles": 10}


@dataclass(frozen=True)
class KeyedApi:
    base: str
    admin_key: str  # the bootstrap admin key (the module's KEY)
    secrets: dict[str, str]  # a created key's secret by its name (the module's KEYED_API_KEYS)

    def client(self, name: str | None = None) -> httpx.Client:
        """A client with the key `name` (None: the bootstrap admin's); the caller closes it."""
        secret = self.admin_key if name is None else self.secrets[name]
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {secret}"}, timeout=60)


@pytest.fixture(scope="module")
def keyed_api(request: pytest.FixtureRequest, redis_base_url: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedApi]:
    """An API process of the module's own with its bootstrap admin key (the module's `KEY`), no
    worker (jobs stay queued), on the module's own Redis database (KEYED_API_DBS, flushed before and
    after), and a key made for each (name, role, project) of the module's `KEYED_API_KEYS`."""
    module = request.module.__name__.rpartition(".")[2]
    key: str = request.module.KEY
    url = with_db(redis_base_url, KEYED_API_DBS[module])
    flush(url)
    data_dir = tmp_path_factory.mktemp(module)
    procs = Processes(url, data_dir, data_dir / "logs", TORCHYARD_API_KEY=key)
    try:
        api = KeyedApi(procs.ready_api(), key, {})
        with api.client() as admin:
            for name, role, project in getattr(request.module, "KEYED_API_KEYS", ()):
                made = admin.post("/keys", json={"name": name, "role": role, "project": project})
                assert made.status_code == 201, made.text
                api.secrets[name] = made.json()["secret"]
        yield api
    finally:
        procs.stop_all()
        flush(url)


@pytest.fixture(scope="session")
def cifar_pair(stack: dict) -> tuple[str, str]:
    """Two succeeded cifar_net jobs on `fake` (1 epoch, seeds 11 and 12): two models told apart."""
    client = stack["client"]
    jobs = [client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1, "seed": s}).json()
            for s in (11, 12)]
    done = [wait_for_job(client, j["id"], {"succeeded", "failed"}, timeout=240) for j in jobs]
    assert [d["status"] for d in done] == ["succeeded", "succeeded"], [d.get("error") for d in done]
    return done[0]["id"], done[1]["id"]


@pytest.fixture(scope="session")
def grid_sweep(stack: dict) -> dict:
    """The small grid sweep (tests/e2e/sweeps_support.GRID_BODY) run to its end once, as it ended."""
    from tests.e2e.sweeps_support import run_grid_sweep

    return run_grid_sweep(stack["client"])
