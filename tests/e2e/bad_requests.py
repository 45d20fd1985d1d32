"""Malformed and hostile requests, built: what the end-to-end input tests send (test_bad_inputs.py's
battery against the live stack, test_input_limits.py's against an API with small limits). Each
builder returns a function of an httpx client that sends the request, so a table of cases can name
a request next to the answer it must get; `raw_request` writes HTTP/1.1 by hand for what httpx
refuses to send (bad or lying lengths)."""

from __future__ import annotations

import io
import socket
import uuid
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from tests.support import REPO

ESCAPE_NAME = f"torchyard-escape-{uuid.uuid4().hex}"
ESCAPE_TARGETS = [Path("/tmp") / f"{ESCAPE_NAME}.png", REPO / f"{ESCAPE_NAME}.png"]
JOB = "/jobs"


def blank_png(size: tuple[int, int] = (32, 32), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG")
    return buffer.getvalue()


def zip_of(entries: list[tuple[str | zipfile.ZipInfo, bytes]], compression: int = zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buffer, "w", compression) as archive:
        warnings.simplefilter("ignore")  # duplicate names are the point of one case
        for name, data in entries:
            archive.writestr(name, data)
    return buffer.getvalue()


def special_entry(name: str, mode: int, data: bytes = b"") -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.create_system = 3  # unix, so external_attr carries st_mode
    info.external_attr = mode << 16
    return info, data


def good_entry(name: str) -> tuple[str, bytes]:
    return name, blank_png()


def upload(zip_bytes: bytes) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post("/datasets", files={"file": ("d.zip", zip_bytes, "application/zip")})


def predict(files: list[tuple[str, bytes, str]], **data: str) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post("/predict", data={"job_id": "nosuchjob", **data},
                            files=[("file", f) for f in files])


def raw_request(request: bytes) -> Callable[[httpx.Client], httpx.Response]:
    """A hand-written HTTP/1.1 request for what httpx refuses to send (bad or lying lengths)."""

    def send(client: httpx.Client) -> httpx.Response:
        url = client.base_url
        with socket.create_connection((url.host, url.port), timeout=30) as sock:
            sock.sendall(request)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        headers = dict(line.decode().split(": ", 1) for line in head.split(b"\r\n")[1:])
        return httpx.Response(status, headers=headers, content=body)

    return send


def big_json_stream(client: httpx.Client) -> httpx.Response:
    """No Content-Length (chunked): the limit must hold on the bytes actually streamed."""
    def body():
        yield b'{"model": "cifar_net", "dataset": "fake", "device": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    return client.post("/jobs", content=body(), headers={"Content-Type": "application/json"})


BOMB = np.zeros((8000, 8000), dtype=bool)  # 64 M pixels, a few KB as a 1-bit PNG


def pixel_bomb() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(BOMB).save(buffer, format="PNG")
    return buffer.getvalue()


def image_as(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buffer, format=fmt)
    return buffer.getvalue()


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n%%EOF\n"


def form_part(name: str, data: bytes, filename: str | None = None, boundary: bytes = b"b") -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return b"--" + boundary + b"\r\nContent-Disposition: " + disposition.encode() + b"\r\n\r\n" + data + b"\r\n"


def form_post(path: str, body: bytes, content_type: str = "multipart/form-data; boundary=b"
              ) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post(path, content=body, headers={"Content-Type": content_type})


def with_headers(method: str, path: str, **headers: str) -> Callable[[httpx.Client], httpx.Response]:
    body = {"json": {"model": "nosuch", "dataset": "fake"}} if method == "POST" and path == JOB else {}
    return lambda c: c.request(method, path, headers=headers, **body)


def job_spec(**fields: object) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "fake", **fields})


def chunked(*parts: bytes):
    yield from parts


PNG = blank_png()
A_ZIP = zip_of([good_entry("cats/a.png")])
