"""Keys with roles against real API processes (two, on one port) and a real Redis: the role matrix
generated from the OpenAPI document (every route × role: allowed or 403, never a 500), a key
revoked while requests are in flight, expiry, the audit log, `torchyard keys`, and a server
without a key (access control off, as before keys existed)."""

from __future__ import annotations

import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.main import create_app
from core.config import Settings
from tests.e2e.test_cli import CLI, cli_env
from tests.support import REPO, Processes, flush, wait_until, with_db

pytestmark = pytest.mark.e2e

KEY = "bootstrap-admin-key-for-the-keys-tests"
ROLES = ("admin", "trainer", "predictor", "viewer")


def _operations() -> list[tuple[str, str]]:
    spec = create_app(Settings(redis_url="redis://127.0.0.1:1/0")).openapi()
    found = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops} - {("GET", "/healthz")}
    # The Open Inference Protocol's subtree, served by the gate past the OpenAPI document.
    found |= {("GET", "/v2"), ("GET", "/v2/models/{name}"), ("POST", "/v2/models/{name}/infer"),
              ("POST", "/v2/repository/index")}
    return sorted(found)


OPERATIONS = _operations()


def forbidden(role: str, method: str, path: str) -> bool:
    """What docs/security.md promises each role, written apart from core/access/roles.py's table."""
    if role == "admin":
        return False
    if path.startswith("/keys") or path == "/audit" or (method == "PUT" and path.startswith("/projects")):
        return True
    if role == "trainer":
        return False
    catalog = method == "GET" and (path in {"/readyz", "/devices", "/models", "/whoami"}
                                   or path.startswith(("/aliases", "/v2", "/projects")))
    if role == "predictor":
        return not (catalog or (method == "POST" and (path == "/predict" or path.startswith("/v2"))))
    return method != "GET" or path.endswith("/export")  # a viewer reads; an export's GET builds one


@pytest.fixture(scope="module")
def server(redis_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Two API processes on one port with the bootstrap key, no worker; a key of each role."""
    data_dir: Path = tmp_path_factory.mktemp("keys")
    url = with_db(redis_base_url, 15)
    flush(url)
    procs = Processes(url, data_dir, data_dir / "logs")
    try:
        base = procs.ready_api(TORCHYARD_API_KEY=KEY, TORCHYARD_API_WORKERS="2")
        admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        secrets = {"admin": KEY}
        for role in ROLES[1:]:
            made = admin.post("/keys", json={"name": f"{role}-key", "role": role, "project": "vision"})
            assert made.status_code == 201, made.text
            secrets[role] = made.json()["secret"]
        yield {"base": base, "admin": admin, "secrets": secrets, "procs": procs}
        admin.close()
    finally:
        procs.stop_all()
        flush(url)


def _as(server: dict, role: str) -> httpx.Client:
    return httpx.Client(base_url=server["base"], headers={"Authorization": f"Bearer {server['secrets'][role]}"},
                        timeout=60)


@pytest.mark.parametrize("role", ROLES)
def test_every_route_answers_each_role_allowed_or_403_never_500(server: dict, role: str) -> None:
    wrong: list[str] = []
    with _as(server, role) as client:
        for method, path in OPERATIONS:
            concrete = re.sub(r"\{[^}]+\}", "nosuch", path)
            json_body = method in ("POST", "PUT") and path != "/datasets"  # that one takes a form (415 first)
            answer = client.request(method, concrete, json={} if json_body else None)
            refused = answer.status_code == 403
            if answer.status_code >= 500 and not (answer.status_code == 503 and path in ("/readyz", "/predict")):
                wrong.append(f"{method} {path}: {answer.status_code} {answer.text[:120]}")
            elif refused != forbidden(role, method, path):
                wrong.append(f"{method} {path}: {answer.status_code}, expected {'403' if not refused else 'not 403'}")
            elif refused:
                detail = answer.json().get("detail") or answer.json().get("error")
                assert f"role {role}" in detail, detail
    assert not wrong, "\n".join(wrong)


def test_a_predictor_is_refused_a_training_job_before_its_body_is_read(server: dict) -> None:
    """/predict's 403 is the gate's (it serves /predict itself): decided on the headers."""
    with _as(server, "viewer") as viewer:
        refused = viewer.post("/predict", content=b"x" * 1000, headers={"Content-Type": "multipart/form-data; b=1"})
    assert refused.status_code == 403 and refused.headers.get("connection") == "close"
    with _as(server, "predictor") as predictor:
        assert predictor.post("/jobs", json={"model": "cifar_net", "dataset": "fake"}).status_code == 403
        assert server["admin"].get("/jobs").json()["jobs"] == []  # nothing was made
        me = predictor.get("/whoami").json()
    assert me["role"] == "predictor" and me["project"] == "vision" and me["name"] == "predictor-key"


def test_keys_are_listed_without_secrets(server: dict) -> None:
    listed = server["admin"].get("/keys")
    assert listed.status_code == 200
    names = {k["name"]: k for k in listed.json()["keys"]}
    assert {"trainer-key", "predictor-key", "viewer-key"} <= set(names)
    for role in ROLES[1:]:  # a secret is tyk_<id>_<random part>; the random part may hold '_' itself
        assert server["secrets"][role].split("_", 2)[2] not in listed.text
    assert all("secret" not in k and "digest" not in k and "salt" not in k for k in names.values())
    bad = server["admin"].post("/keys", json={"name": "x", "role": "root"})
    assert bad.status_code == 422 and "role" in bad.text


def test_a_key_revoked_while_requests_are_in_flight_is_refused_by_every_api_process(server: dict) -> None:
    made = server["admin"].post("/keys", json={"name": "doomed", "role": "viewer", "project": "vision"}).json()
    statuses: list[int] = []
    stop = threading.Event()

    def hammer() -> None:
        # A fresh connection per request: uvicorn's processes share the port, so both answer.
        while not stop.is_set():
            statuses.append(httpx.get(f"{server['base']}/jobs", headers={"Authorization": f"Bearer {made['secret']}"},
                                      timeout=30).status_code)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        wait_until(lambda: statuses.count(200) >= 5, timeout=60, what="the key's first answers")
        assert server["admin"].delete(f"/keys/{made['id']}").status_code == 204
        mark = len(statuses)
        wait_until(lambda: len(statuses) > mark + 30 and set(statuses[-30:]) == {401}, timeout=60,
                   what="only 401s after the revocation")
    finally:
        stop.set()
        thread.join()
    assert set(statuses) <= {200, 401}, set(statuses)
    listed = {k["id"]: k for k in server["admin"].get("/keys").json()["keys"]}
    assert listed[made["id"]]["active"] is False and listed[made["id"]]["revoked_at"]


def test_an_expired_key_is_refused(server: dict) -> None:
    made = server["admin"].post("/keys", json={"name": "brief", "role": "viewer", "expires_in_days": 5 / 86_400})
    assert made.status_code == 201 and made.json()["expires_at"]
    auth = {"Authorization": f"Bearer {made.json()['secret']}"}
    wait_until(lambda: httpx.get(f"{server['base']}/jobs", headers=auth).status_code == 401, timeout=60,
               what="the key's expiry")
    assert httpx.get(f"{server['base']}/jobs", headers=auth).headers["www-authenticate"] == "Bearer"


def test_the_audit_log_names_who_did_what(server: dict) -> None:
    with _as(server, "trainer") as trainer:
        assert trainer.delete("/aliases/nosuch").status_code == 404
        assert trainer.get("/audit").status_code == 403
    with _as(server, "viewer") as viewer:
        assert viewer.delete("/jobs/nosuch").status_code == 403
        assert viewer.post("/predict", data={"job_id": "nosuch"}).status_code == 403  # the gate's own 403
    entries = server["admin"].get("/audit", params={"limit": 50}).json()["entries"]
    seen = {(e["key_name"], e["method"], e["route"], e["status"]) for e in entries}
    assert ("trainer-key", "DELETE", "/aliases/{name}", 404) in seen
    assert ("trainer-key", "GET", "/audit", 403) in seen and ("viewer-key", "DELETE", "/jobs/{job_id}", 403) in seen
    assert ("viewer-key", "POST", "/predict", 403) in seen
    created = [e for e in entries if e["route"] == "/keys" and e["method"] == "POST" and e["status"] == 201]
    assert created and all(e["key_id"] == "bootstrap" and e["role"] == "admin" for e in created)
    assert not [e for e in entries if e["method"] == "GET" and e["status"] != 403]  # reads are not audited
    assert next(e for e in entries if e["route"] == "/aliases/{name}")["object"] == "name=nosuch"
    page = server["admin"].get("/audit", params={"limit": 1, "before": entries[0]["id"]}).json()["entries"]
    assert page == entries[1:2]


def test_the_keys_commands(server: dict) -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, "keys", *args, "--url", server["base"], "--api-key", KEY], cwd=REPO,
                              env=cli_env(), capture_output=True, text=True, timeout=120)

    created = run("create", "--name", "cli-bot", "--role", "predictor", "--project", "vision")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip().splitlines()[-1]
    assert secret.startswith("tyk_")
    assert httpx.get(f"{server['base']}/whoami", headers={"Authorization": f"Bearer {secret}"}).json()["name"] == "cli-bot"
    listed = run("list")
    assert listed.returncode == 0 and "cli-bot" in listed.stdout and secret not in listed.stdout
    key_id = secret.split("_", 2)[1]
    assert run("revoke", key_id).returncode == 0
    wait_until(lambda: httpx.get(f"{server['base']}/whoami",
                                 headers={"Authorization": f"Bearer {secret}"}).status_code == 401,
               timeout=30, what="the revoked key refused")
    missing = run("revoke", "000000000000")
    assert missing.returncode == 1 and "(404)" in missing.stderr
    with_viewer = subprocess.run([*CLI, "keys", "--url", server["base"], "--api-key", server["secrets"]["viewer"]],
                                 cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert with_viewer.returncode == 1 and "(403)" in with_viewer.stderr and "role viewer" in with_viewer.stderr


def test_without_a_key_set_there_are_no_keys_to_make(stack: dict) -> None:
    client = stack["client"]
    refused = client.post("/keys", json={"name": "x", "role": "viewer"})
    assert refused.status_code == 409 and "TORCHYARD_API_KEY" in refused.json()["detail"]
    me = client.get("/whoami").json()
    assert me["key_id"] is None and me["role"] == "admin" and me["project"] == "default"
