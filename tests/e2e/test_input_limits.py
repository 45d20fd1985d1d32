"""Every input limit follows its setting, to the byte: an API (no worker needed) whose limits are
all set small through TORCHYARD_ settings refuses what is over each one with 413 and a detail
naming the limit, and takes what is within them, a body at exactly a size limit included."""

from __future__ import annotations

import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.e2e.bad_requests import JOB, blank_png, good_entry, predict, upload, zip_of
from tests.support import png_bytes

pytestmark = pytest.mark.e2e


@pytest.fixture
def tight_api(redis_base_url: str, tmp_path: Path):
    """An API (no worker needed) whose every input limit is set small through its settings (the
    zip-ratio check only looks at archives over 1 MiB, hence the MB-sized ones)."""
    from tests.support import Processes, flush, free_port, wait_until, with_db

    url = with_db(redis_base_url, 15)
    flush(url)
    limits = {"TORCHYARD_MAX_REQUEST_BYTES": "3000000", "TORCHYARD_MAX_JSON_BYTES": "300",
              "TORCHYARD_MAX_UPLOAD_BYTES": "2500000", "TORCHYARD_MAX_ZIP_ENTRIES": "3",
              "TORCHYARD_MAX_ZIP_UNCOMPRESSED_BYTES": "2000000", "TORCHYARD_MAX_ZIP_RATIO": "5",
              "TORCHYARD_MAX_IMAGE_BYTES": "3000", "TORCHYARD_MAX_IMAGE_PIXELS": "1000",
              "TORCHYARD_MAX_IMAGES_PER_REQUEST": "2"}
    procs = Processes(url, tmp_path / "data", tmp_path / "logs", **limits)
    port = free_port()
    procs.api(port)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        wait_until(lambda: client.get("/healthz").status_code == 200, timeout=60, what="the API")
        yield client
    finally:
        client.close()
        procs.stop_all()
        flush(url)


def test_every_limit_follows_its_setting(tight_api: httpx.Client) -> None:
    c = tight_api
    small = blank_png((8, 8))
    noise = png_bytes(np.random.default_rng(1).integers(0, 255, (40, 40, 3), dtype=np.uint8))  # > 3000 bytes
    cases = [
        ("json over MAX_JSON_BYTES", c.post(JOB, json={"model": "m" * 400, "dataset": "fake"}), 413, "limit of 300 bytes"),
        ("json under it", c.post(JOB, json={"model": "nosuch", "dataset": "fake"}), 422, "unknown model"),
        ("body over MAX_REQUEST_BYTES", c.post("/datasets", files={"file": ("d.zip", bytes(3_100_000), "application/zip")}), 413, "limit of 3000000"),
        ("upload over MAX_UPLOAD_BYTES", c.post("/datasets", files={"file": ("d.zip", zip_of([("a/x.png", bytes(2_600_000))]),
                                                                             "application/zip")}), 413, "limit is 2500000"),
        ("zip over MAX_ZIP_ENTRIES", upload(zip_of([good_entry(f"a/{k}.png") for k in range(4)]))(c), 413, "entries"),
        ("zip over MAX_ZIP_UNCOMPRESSED_BYTES", upload(zip_of([("a/1.png", np.random.bytes(1_100_000)),
                                                                    ("a/2.png", np.random.bytes(1_100_000))]))(c), 413, "expands to"),
        ("zip over MAX_ZIP_RATIO", upload(zip_of([("a/1.png", bytes(1_500_000))], zipfile.ZIP_DEFLATED))(c), 413, "zip bomb"),
        ("image over MAX_IMAGE_BYTES", predict([("n.png", noise, "image/png")])(c), 413, "limit of 3000 bytes"),
        ("image over MAX_IMAGE_PIXELS", predict([("p.png", blank_png((40, 40)), "image/png")])(c), 413, "pixels"),
        ("over MAX_IMAGES_PER_REQUEST", predict([(f"{k}.png", small, "image/png") for k in range(3)])(c), 413, "images in one request"),
        ("within every limit", predict([("ok.png", small, "image/png")])(c), 404, "not found"),  # then: unknown job
    ]
    cases += _edges(c)
    wrong = [f"{name}: {r.status_code} {r.text[:200]}" for name, r, status, says in cases
             if r.status_code != status or says not in r.json().get("detail", "")]
    assert not wrong, "\n".join(wrong)


def _json_of(size: int) -> bytes:
    """A job request for an unknown model, padded with JSON whitespace to exactly `size` bytes."""
    body = b'{"model": "nosuch", "dataset": "fake"}'
    return body + b" " * (size - len(body))


def _dataset_body(size: int) -> tuple[bytes, str]:
    """A multipart /datasets body of exactly `size` bytes (its file part: zeros, not a zip)."""
    def build(file_bytes: int) -> httpx.Request:
        return httpx.Request("POST", "http://x/datasets", files={"file": ("d.zip", bytes(file_bytes), "application/zip")})

    framing = len(build(0).read())
    request = build(size - framing)
    return request.read(), request.headers["content-type"]


def _edges(c: httpx.Client) -> list[tuple[str, httpx.Response, int, str]]:
    """Each size limit at exactly its setting (taken: the request goes on to what comes next) and
    one byte over (413 naming the limit), declared and streamed (chunked)."""
    json_type = {"content-type": "application/json"}
    png = blank_png((8, 8))
    edge_png, over_png = png + bytes(3000 - len(png)), png + bytes(3001 - len(png))
    request_at, request_type = _dataset_body(3_000_000)
    request_over, _ = _dataset_body(3_000_001)
    return [
        ("json of exactly MAX_JSON_BYTES", c.post(JOB, content=_json_of(300), headers=json_type), 422, "unknown model"),
        ("json one byte over MAX_JSON_BYTES", c.post(JOB, content=_json_of(301), headers=json_type), 413,
         "limit of 300 bytes"),
        ("json of exactly MAX_JSON_BYTES, chunked", c.post(JOB, content=iter([_json_of(300)]), headers=json_type), 422,
         "unknown model"),
        ("json one byte over MAX_JSON_BYTES, chunked", c.post(JOB, content=iter([_json_of(301)]), headers=json_type),
         413, "limit of 300 bytes"),
        ("image of exactly MAX_IMAGE_BYTES", predict([("edge.png", edge_png, "image/png")])(c), 404, "not found"),
        ("image one byte over MAX_IMAGE_BYTES", predict([("over.png", over_png, "image/png")])(c), 413,
         "limit of 3000 bytes"),
        # The body at the request cap passes it and meets the upload cap, smaller; one byte more meets the request cap.
        ("body of exactly MAX_REQUEST_BYTES", c.post("/datasets", content=request_at,
                                                     headers={"content-type": request_type}), 413, "limit is 2500000"),
        ("body one byte over MAX_REQUEST_BYTES", c.post("/datasets", content=request_over,
                                                        headers={"content-type": request_type}), 413, "limit of 3000000"),
        ("upload of exactly MAX_UPLOAD_BYTES", c.post("/datasets", files={"file": ("d.zip", bytes(2_500_000),
                                                                                   "application/zip")}), 415, "not a zip"),
        ("upload one byte over MAX_UPLOAD_BYTES", c.post("/datasets", files={"file": ("d.zip", bytes(2_500_001),
                                                                                      "application/zip")}), 413,
         "limit is 2500000"),
    ]
