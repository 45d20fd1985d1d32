"""The API's side of /predict as its tests drive it: requests built as clients send them, a
PredictionClient on a real Redis, and the worker's side played by hand (its list, its device record)."""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import redis
from PIL import Image
from starlette.requests import Request

from app.api.serving.engine import PredictionClient
from core import keys
from core.config import Settings
from core.redis import connect_async


def image(fmt: str = "PNG", size: tuple[int, int] = (8, 8), name: str | None = None) -> tuple[str, bytes]:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((size[1], size[0], 3), dtype=np.uint8)).save(buffer, format=fmt)
    return name or f"x.{fmt.lower()}", buffer.getvalue()


def prediction_client(url: str, timeout_s: float = 1.0) -> PredictionClient:
    settings = Settings(predict_timeout_s=timeout_s, max_image_bytes=1 << 20, max_image_pixels=10_000,
                        max_images_per_request=4)
    return PredictionClient(connect_async(url), settings)


def worker_redis(url: str) -> redis.Redis:
    """A client as the worker's: prediction requests are binary frames."""
    return redis.Redis.from_url(url)


async def predict(client: PredictionClient, job_id: str | None, images: list[tuple[str, bytes]], top_k: int,
                  alias: str | None = None) -> bytes:
    """POST /predict's body as httpx sends it, through PredictionClient.answer."""
    fields = {"top_k": str(top_k), **({"job_id": job_id} if job_id else {}), **({"alias": alias} if alias else {})}
    return await client.answer(form_request([("file", (name, data, "image/png")) for name, data in images], fields))


def register_device(sync: redis.Redis, device_id: str, loaded: list[str], status: str = "idle",
                    instance: str = "instance") -> None:
    state = {"id": device_id, "type": "cpu", "index": None, "name": "cpu", "memory_total_bytes": 1,
             "memory_used_bytes": 0, "utilization_percent": None, "worker": f"cpu@{device_id}", "status": status,
             "current_job": None, "loaded_models": loaded, "last_heartbeat": "2026-01-01T00:00:00+00:00"}
    sync.set(keys.device_state(device_id), json.dumps(state))
    sync.set(keys.device_alive(device_id), instance, px=60_000)
    sync.sadd(keys.DEVICES_INDEX, device_id)


def form_request(files: list[tuple[str, tuple]], data: dict[str, str], chunk: int | None = None) -> Request:
    """A Starlette request carrying exactly the multipart body httpx would send (in chunks of
    `chunk` bytes, as a slow client's body arrives, when given)."""
    built = httpx.Request("POST", "http://x/predict", files=files, data=data)
    body = built.read()
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
    pieces = pieces or [b""]

    async def receive() -> dict:
        piece = pieces.pop(0) if pieces else b""
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

    headers = [(k.lower().encode(), v.encode()) for k, v in built.headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/predict", "headers": headers, "query_string": b""},
                   receive)
