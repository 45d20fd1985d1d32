"""Property-based fuzzing of the whole HTTP API from its own OpenAPI document (schemathesis):
valid and invalid requests for every operation, against a real API process on real Redis.
The property: no 5xx, ever (503 from /readyz is its documented answer with no worker).

Bounded for CI by TORCHYARD_FUZZ_EXAMPLES per operation (default 10); `make fuzz` runs a
longer, randomised pass."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.support import Processes, flush, with_db

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("TORCHYARD_FUZZ_EXAMPLES", "10"))
RANDOM = os.environ.get("TORCHYARD_FUZZ_RANDOM", "") not in ("", "0")


@pytest.fixture(scope="module")
def fuzz_api(redis_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An API with no worker: fuzzed jobs stay queued instead of training for hours on the shared CPU."""
    data_dir: Path = tmp_path_factory.mktemp("fuzz")
    url = with_db(redis_base_url, 15)
    flush(url)
    procs = Processes(url, data_dir, data_dir / "logs", TORCHYARD_MAX_UPLOAD_BYTES=str(8 << 20))
    try:
        yield procs.ready_api()
    finally:
        procs.stop_all()
        flush(url)


def _schema():
    """The app's own OpenAPI document, built in-process (no Redis touched) so operations are known at collection."""
    from app.main import create_app
    from core.config import Settings

    return schemathesis.openapi.from_dict(create_app(Settings(redis_url="redis://127.0.0.1:1/0")).openapi())


SCHEMA = _schema()
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_no_server_errors(operation, mode: GenerationMode, fuzz_api: str) -> None:
    seen: list[str] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    def fuzz(case) -> None:
        response = case.call(base_url=fuzz_api, timeout=30)
        seen.append(str(response.status_code))
        if operation.path == "/readyz" and response.status_code == 503:
            assert response.json()["detail"]
            return
        assert response.status_code < 500, (f"{case.method} {case.formatted_path} -> {response.status_code}: "
                                            f"{response.text[:500]}\nreproduce: {case.as_curl_command()}")
        if response.status_code >= 400 and response.status_code != 405:
            assert isinstance(response.json().get("detail"), str), response.text[:500]

    try:
        fuzz()
    except Unsatisfiable:  # an operation with no parameters has no invalid form
        assert mode is GenerationMode.NEGATIVE
        return
    assert seen


# ---------------------------------------------------------------------------------------------
# The same property with several keys (#38): a trainer, a predictor and a viewer of a project other
# than "default", so the role table's refusals and the projects' reads meet generated input too.
KEYED_ROLES = ("trainer", "predictor", "viewer")
KEYED_EXAMPLES = max(1, EXAMPLES // 2)


@pytest.fixture(scope="module")
def keyed_fuzz_api(redis_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict]]:
    """An API with the bootstrap key and a key of each role in project `fuzz`, no worker (database 11:
    the unkeyed API of this module is alive at the same time on 15)."""
    import httpx

    data_dir: Path = tmp_path_factory.mktemp("fuzz-keyed")
    url = with_db(redis_base_url, 11)
    flush(url)
    key = "fuzz-bootstrap-admin-key"
    procs = Processes(url, data_dir, data_dir / "logs", TORCHYARD_API_KEY=key,
                      TORCHYARD_MAX_UPLOAD_BYTES=str(8 << 20))
    try:
        base = procs.ready_api()
        secrets = {role: httpx.post(f"{base}/keys", headers={"Authorization": f"Bearer {key}"},
                                    json={"name": f"fuzz-{role}", "role": role, "project": "fuzz"}).json()["secret"]
                   for role in KEYED_ROLES}
        yield base, secrets
    finally:
        procs.stop_all()
        flush(url)


@pytest.mark.parametrize("role", KEYED_ROLES)
@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_no_server_errors_with_keys(operation, role: str, keyed_fuzz_api: tuple[str, dict]) -> None:
    base, secrets = keyed_fuzz_api
    seen: list[str] = []

    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    @settings(max_examples=KEYED_EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    def fuzz(case) -> None:
        response = case.call(base_url=base, timeout=30, headers={"Authorization": f"Bearer {secrets[role]}"})
        seen.append(str(response.status_code))
        if operation.path == "/readyz" and response.status_code == 503:
            return
        assert response.status_code < 500, (f"{role}: {case.method} {case.formatted_path} -> {response.status_code}: "
                                            f"{response.text[:500]}\nreproduce: {case.as_curl_command()}")
        assert response.status_code != 401, response.text[:300]  # a valid key is never refused as unknown

    fuzz()
    assert seen
