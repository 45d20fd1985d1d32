"""The front gate's route table (app/api/front.py) agrees with the app's routes: every route that
takes a body has its cap and types; the open paths are the dashboard's and /healthz; the rest need
the key. Checked against the app's own route table, so a new body-taking route without an entry fails."""

from __future__ import annotations

from app.api.front import JSON, MULTIPART, HostCheck, OriginCheck, RouteTable
from app.main import create_app
from core.config import Settings

SETTINGS = Settings(_env_file=None, redis_url="redis://127.0.0.1:1/0")


def test_every_body_taking_route_has_its_types_and_cap() -> None:
    table = RouteTable(SETTINGS)
    spec = create_app(SETTINGS).openapi()
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            concrete = path.replace("{job_id}", "j1").replace("{dataset_id}", "d1")
            policy = table.policy(method.upper(), concrete)
            assert policy.open == (path == "/healthz"), (method, path)
            body = operation.get("requestBody")
            if body is None:
                assert table.body_cap(policy) == SETTINGS.max_json_bytes, (method, path)
                continue
            types = set(body["content"])
            assert types and types <= set(policy.content_types), (method, path, types)
    assert table.policy("POST", "/jobs").content_types == JSON
    assert table.policy("POST", "/datasets").content_types == MULTIPART
    assert table.body_cap(table.policy("POST", "/datasets")) == SETTINGS.request_body_limit
    for open_path in ("/", "/healthz", "/static/js/main.js", "/docs/assets/swagger-ui.css"):
        assert table.policy("GET", open_path).open
    assert not table.policy("POST", "/healthz").open and not table.policy("GET", "/docs").open


def test_host_check_on_loopback_and_other_binds() -> None:
    loopback = HostCheck(SETTINGS)
    assert loopback.allows(b"localhost:8000") and loopback.allows(b"127.0.0.1") and loopback.allows(b"[::1]:8000")
    assert not loopback.allows(b"attacker.example") and not loopback.allows(b"10.0.0.1:8000")
    extra = HostCheck(Settings(_env_file=None, allowed_hosts="gpu-box,ML.example.com"))
    assert extra.allows(b"ml.example.com:8000") and extra.allows(b"gpu-box") and not extra.allows(b"other")
    # Beyond loopback too, whatever served the app: only the names said (`torchyard api` refuses to start
    # without them; an app served another way serves localhost names alone), or any when '*' is said.
    beyond = HostCheck(Settings(_env_file=None, host="0.0.0.0", api_key="k"))
    assert not beyond.allows(b"anything") and not beyond.allows(b"attacker.example:8000")
    assert beyond.allows(b"localhost:8000") and beyond.allows(b"127.0.0.1")
    named = HostCheck(Settings(_env_file=None, host="0.0.0.0", allowed_hosts="gpu-box"))
    assert named.allows(b"gpu-box:8000") and not named.allows(b"anything")
    assert HostCheck(Settings(_env_file=None, host="0.0.0.0", allowed_hosts="*")).allows(b"anything")
    assert HostCheck(Settings(_env_file=None, allowed_hosts="*")).allows(b"anything")


def test_origin_check() -> None:
    check = OriginCheck(Settings(_env_file=None, allowed_origins="https://ui.example/"))
    assert check.allows("GET", b"http://attacker.example", b"127.0.0.1:8000")  # reads: the browser's CORS
    assert check.allows("POST", None, b"127.0.0.1:8000")  # not a browser
    assert check.allows("POST", b"http://127.0.0.1:8000", b"127.0.0.1:8000")
    assert check.allows("POST", b"http://localhost", b"localhost:80")
    assert check.allows("DELETE", b"https://ui.example", b"127.0.0.1:8000")
    assert not check.allows("POST", b"http://attacker.example", b"127.0.0.1:8000")
    assert not check.allows("DELETE", b"null", b"127.0.0.1:8000")
    assert not check.allows("POST", b"http://[::1", b"127.0.0.1:8000")  # no origin at all, not an error


def test_a_failure_in_the_edge_is_a_json_500_as_fastapis_own_would_be() -> None:
    """The metrics and the front gate run before FastAPI's ServerErrorMiddleware (app/main.py): a bug
    there must still answer the contract's JSON 500, once, and not a bare text one."""
    import asyncio

    import httpx

    app = create_app(SETTINGS)

    async def broken(scope, receive, send) -> None:
        raise RuntimeError("a bug in the edge")

    app.edge = broken

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.get("/healthz")

    response = asyncio.run(get())
    assert response.status_code == 500 and "RuntimeError" in response.json()["detail"]


def test_loopback_binds() -> None:
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert Settings(_env_file=None, host=host).binds_loopback, host
    for host in ("0.0.0.0", "::", "192.168.1.10", "gpu-box"):
        assert not Settings(_env_file=None, host=host).binds_loopback, host
