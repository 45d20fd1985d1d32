"""With TORCHYARD_API_KEY set, every route in the app's route table but /healthz needs the bearer
token, docs and the OpenAPI document included; a real API process answers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.main import create_app
from core.config import Settings
from tests.support import Processes, flush, with_db

pytestmark = pytest.mark.e2e

KEY = "s3cret-token-for-tests"
PUBLIC = {("GET", "/healthz"), ("GET", "/")}  # `/` is the dashboard page: it holds no data (its calls send the key)


def route_table() -> list[tuple[str, str]]:
    """(method, path) for every HTTP route the app serves, walking included routers too."""
    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0"))  # nothing connects: no lifespan runs

    def walk(routes) -> Iterator[tuple[str, str]]:
        for route in routes:
            if hasattr(route, "original_router"):  # an included router (FastAPI >= 0.16x)
                prefix = getattr(route.include_context, "prefix", "")
                yield from ((m, prefix + p) for m, p in walk(route.original_router.routes))
            elif getattr(route, "methods", None):
                yield from ((m, route.path) for m in route.methods if m != "HEAD")
            elif hasattr(route, "routes"):  # a Mount: its own routes, under its path
                yield from ((m, route.path + p) for m, p in walk(route.routes))

    table = sorted(set(walk(app.routes)))
    documented = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops}
    assert documented <= set(table), "the walk missed routes the OpenAPI document lists"
    return table


ROUTES = route_table()


@pytest.fixture(scope="module")
def keyed_api(redis_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data_dir: Path = tmp_path_factory.mktemp("auth")
    url = with_db(redis_base_url, 15)  # a database of this module's own; nothing else runs there
    flush(url)
    procs = Processes(url, data_dir, data_dir / "logs")
    try:
        yield procs.ready_api(TORCHYARD_API_KEY=KEY)
    finally:
        procs.stop_all()


def _send(base: str, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    url = base + re.sub(r"\{[^}]+\}", "nosuchid", path)
    return httpx.request(method, url, headers=headers, timeout=30)


def test_route_table_covers_the_contract() -> None:
    paths = {p for _, p in ROUTES}
    assert {"/healthz", "/readyz", "/openapi.json", "/docs", "/jobs", "/jobs/{job_id}", "/predict",
            "/datasets", "/datasets/{dataset}", "/devices", "/models"} <= paths


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_route_needs_the_key(keyed_api: str, method: str, path: str) -> None:
    if (method, path) in PUBLIC:
        assert _send(keyed_api, method, path, {}).status_code == 200
        return
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
                    {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"}):
        refused = _send(keyed_api, method, path, headers)
        assert refused.status_code == 401, (f"{method} {path} was answered {refused.status_code}, not 401, to a wrong or "
                                            f"missing API key ({headers}): {refused.text[:200]}")
        assert refused.json()["detail"] and refused.headers.get("www-authenticate") == "Bearer"
    allowed = _send(keyed_api, method, path, {"Authorization": f"Bearer {KEY}"})
    assert allowed.status_code != 401, allowed.text
    assert allowed.status_code < 500 or (path == "/readyz" and allowed.status_code == 503), allowed.text


def test_docs_and_openapi_are_served_with_the_key(keyed_api: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    spec = httpx.get(f"{keyed_api}/openapi.json", headers=auth).json()
    assert "/jobs" in spec["paths"] and spec["info"]["title"] == "torchyard"
    assert "swagger" in httpx.get(f"{keyed_api}/docs", headers=auth).text.lower()
    assert httpx.get(f"{keyed_api}/redoc", headers=auth).status_code == 404  # no unprotected leftovers


def test_the_open_inference_protocol_needs_the_key_but_for_its_health(keyed_api: str) -> None:
    """/v2 is served by the front gate past FastAPI's routes (app/api/oip/): the same key, its
    refusals in the protocol's shape; its liveness and readiness open, as /healthz."""
    for method, path in (("GET", "/v2"), ("GET", "/v2/models/nosuchid"), ("GET", "/v2/models/nosuchid/config"),
                         ("POST", "/v2/models/nosuchid/infer"), ("POST", "/v2/repository/index")):
        refused = _send(keyed_api, method, path, {})
        assert refused.status_code == 401 and refused.json()["error"], (path, refused.text)
        allowed = _send(keyed_api, method, path, {"Authorization": f"Bearer {KEY}"})
        assert allowed.status_code in (200, 400, 404) and (allowed.status_code == 200 or allowed.json()["error"])
    assert _send(keyed_api, "GET", "/v2/health/live", {}).status_code == 200
    assert _send(keyed_api, "GET", "/v2/health/ready", {}).status_code in (200, 400)  # 400: no worker here
