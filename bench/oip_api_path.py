"""The API's own CPU per request, in process: each cell of bench/oip.py through the whole ASGI app
(metrics, front gate, the route), the worker's answer given at once (the engine's `predict` replaced
by a canned reply of the right kind), so what is timed is the API's Python alone, on one core,
without the load client, Redis or a worker sharing it.

    .venv/bin/python bench/oip_api_path.py ["/v2 BYTES-JPEG binary"]   # a cell's name: its cProfile too

Needs a Redis at 127.0.0.1:6379 (database 14; nothing is written to it).
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# after the sys.path entry above
import orjson

from app.api.oip.catalog import ModelInfo, ModelRef
from app.api.services import Services
from app.main import create_app
from bench.oip import requests_for, sample_jpeg
from core.access.projects import EVERYWHERE
from core.config import Settings

CLASSES = [f"c{i}" for i in range(10)]


def build() -> tuple[Any, dict[str, bytes]]:
    settings = Settings(redis_url="redis://127.0.0.1:6379/14")
    app = create_app(settings)
    services = app.state.services = Services.build(settings)
    info = ModelInfo("job1", "cifar_net", tuple(CLASSES), (3, 32, 32), True)
    services.oip.catalog._resolved[(EVERYWHERE, "job1", None)] = (time.monotonic() + 1e9, ModelRef("job1", ("job1",), "1", info, None))
    probabilities = orjson.dumps({"job_id": "job1", "model": "cifar_net", "device": "d", "alias": None,
                                  "classes": CLASSES, "probabilities": [[0.1] * 10]})
    top = orjson.dumps({"job_id": "job1", "model": "cifar_net", "device": "d", "alias": None, "results": [
        {"filename": "x", "predictions": [{"label": "c1", "index": 1, "probability": 0.1}] * 5}]})

    async def answered_at_once(call: Any) -> bytes:
        return probabilities if call.reply == "probabilities" else top

    services.predictions.predict = answered_at_once  # type: ignore[method-assign]
    jpeg, rows = sample_jpeg()
    return app, requests_for(8000, "job1", jpeg, rows)


def scope_of(raw: bytes) -> tuple[dict[str, Any], bytes]:
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    method, path, _ = lines[0].split(b" ")
    headers = [(name.strip().lower(), value.strip()) for name, value in (line.split(b":", 1) for line in lines[1:])]
    return {"type": "http", "method": method.decode(), "path": path.decode(), "raw_path": path, "query_string": b"",
            "headers": headers, "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
            "root_path": "", "http_version": "1.1", "asgi": {"version": "3.0"}}, body


async def once(app: Any, scope: dict[str, Any], body: bytes) -> None:
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(dict(scope), receive, send)
    assert status == [200], status


async def per_request_us(app: Any, raw: bytes, n: int) -> float:
    scope, body = scope_of(raw)
    for _ in range(50):
        await once(app, scope, body)
    started = time.perf_counter()
    for _ in range(n):
        await once(app, scope, body)
    return (time.perf_counter() - started) / n * 1e6


async def main() -> None:
    app, cells = build()
    for name, raw in cells.items():
        print(f"{name}: {await per_request_us(app, raw, 2000):.0f} µs per request")
    if len(sys.argv) > 1:
        profile = cProfile.Profile()
        profile.enable()
        await per_request_us(app, cells[sys.argv[1]], 2000)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    asyncio.run(main())
