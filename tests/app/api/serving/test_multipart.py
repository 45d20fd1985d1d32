"""The /predict body reader (app/api/serving/multipart.py): the parts clients send, found as the body
streams in, whatever the chunking; limits decided before the rest of the body arrives."""

from __future__ import annotations

import asyncio
import io

import httpx
import numpy as np
import pytest
from PIL import Image
from starlette.requests import Request

from app.api.serving.multipart import FormLimits, read_predict_form
from core.errors import InvalidInput, TooLarge, UnsupportedMedia
from tests.app.api.serving.support import form_request

LIMITS = FormLimits(max_images=3, max_image_bytes=4096, max_body_bytes=64 * 1024)


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _read(request: Request, limits: FormLimits = LIMITS, seen: list | None = None):
    def check(filename: str | None, data: memoryview) -> None:
        if seen is not None:
            seen.append((filename, bytes(data)))
        if bytes(data[:4]) == b"evil":
            raise UnsupportedMedia(f"{filename} is not an image")

    return asyncio.run(read_predict_form(request, limits, check))


@pytest.mark.parametrize("chunk", [None, 1, 7, 64, 1000])
def test_the_parts_clients_send_are_found_whatever_the_chunking(chunk: int | None) -> None:
    pngs = [_png(1), _png(2)]
    files = [("file", ("a.png", pngs[0], "image/png")), ("file", ('we"ird name.png', pngs[1], "image/png"))]
    seen: list = []
    form = _read(form_request(files, {"job_id": "abc", "top_k": "3"}, chunk=chunk), seen=seen)
    assert form.fields == {"job_id": "abc", "top_k": "3"}
    images = [(name, bytes(form.buffer[at:at + n])) for name, at, n in form.images]
    assert images == [("a.png", pngs[0]), ("we%22ird name.png", pngs[1])]  # as httpx escapes it
    assert seen == images  # each image checked once, as its part completed


def test_a_part_that_holds_the_boundary_text_but_not_a_delimiter_is_kept_whole() -> None:
    tricky = b"\r\n--x\r\n--" + b"y" * 50
    form = _read(form_request([("file", ("t.png", tricky, "image/png"))], {"job_id": "j"}, chunk=3))
    (_, at, n), = form.images
    assert bytes(form.buffer[at:at + n]) == tricky


def test_limits_are_decided_while_the_body_streams() -> None:
    """An oversized image, one image too many, or a refused file ends the read at the part that
    breaks the rule: the rest of the body is never received."""
    received = []

    def request(files, chunk=256):
        req = form_request(files, {"job_id": "j"}, chunk=chunk)
        original = req._receive

        async def counting():
            message = await original()
            received.append(len(message.get("body", b"")))
            return message

        req._receive = counting
        received.clear()
        return req

    big = [("file", ("big.png", b"\x89PNG" + bytes(10_000), "image/png")), ("file", ("b.png", _png(1), "image/png"))]
    with pytest.raises(TooLarge, match="TORCHYARD_MAX_IMAGE_BYTES"):
        _read(request(big))
    assert sum(received) < 4096 + 1024  # refused once its part passed the limit, not at the end
    many = [("file", (f"{i}.png", _png(i), "image/png")) for i in range(5)]
    with pytest.raises(TooLarge, match="TORCHYARD_MAX_IMAGES_PER_REQUEST"):
        _read(request(many))
    evil = [("file", ("e.png", b"evil" + bytes(3000), "image/png")), ("file", ("b.png", bytes(3000), "image/png"))]
    with pytest.raises(UnsupportedMedia):
        _read(request(evil))
    with pytest.raises(TooLarge, match="TORCHYARD_MAX_PREDICT_REQUEST_BYTES"):
        _read(request([("file", ("a.png", _png(1), "image/png"))]), FormLimits(3, 4096, 200))


@pytest.mark.parametrize("content_type,body,message", [
    ("application/json", b'{"job_id": "x"}', "multipart/form-data"),
    ("multipart/form-data", b"--x\r\n", "multipart/form-data"),  # no boundary parameter
    ("multipart/form-data; boundary=x", b"", "no image|empty"),
    ("multipart/form-data; boundary=x", b"garbage", "boundary"),
    ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\n1\r\n', "closing"),
    ("multipart/form-data; boundary=x", b"--x\r\nno headers end\r\n--x--\r\n", "closing"),
    ("multipart/form-data; boundary=x", b"--x\r\nContent-Type: text/plain\r\n\r\n1\r\n--x--\r\n", "Disposition"),
    ("multipart/form-data; boundary=x",
     b'--x\r\nContent-Disposition: form-data; name="other"; filename="a.png"\r\n\r\n1\r\n--x--\r\n', "unexpected file"),
])
def test_malformed_bodies_are_refused_with_what_is_wrong(content_type: str, body: bytes, message: str) -> None:
    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/predict", "query_string": b"",
                       "headers": [(b"content-type", content_type.encode())]}, receive)
    with pytest.raises(InvalidInput, match=message):
        _read(request)


def _refusal(request: Request, limits: FormLimits = LIMITS) -> str | None:
    """None when the body is read, else the detail of the TooLarge it was refused with."""
    try:
        _read(request, limits)
    except TooLarge as exc:
        return exc.detail
    return None


@pytest.mark.parametrize("chunk", [None, 1, 7, 1000])
def test_each_limit_takes_a_body_at_its_edge_and_refuses_one_byte_or_image_more(chunk: int | None) -> None:
    """At exactly TORCHYARD_MAX_IMAGE_BYTES, TORCHYARD_MAX_IMAGES_PER_REQUEST and
    TORCHYARD_MAX_PREDICT_REQUEST_BYTES a body is read; one byte (or image) more is refused, whatever
    the chunking: an off-by-one in either direction fails here."""
    def image(size: int) -> list:
        return [("file", ("edge.png", b"\x89PNG" + bytes(size - 4), "image/png"))]

    at = _refusal(form_request(image(LIMITS.max_image_bytes), {"job_id": "j"}, chunk=chunk))
    assert at is None, f"an image of exactly max_image_bytes ({LIMITS.max_image_bytes}) was refused: {at}"
    over = _refusal(form_request(image(LIMITS.max_image_bytes + 1), {"job_id": "j"}, chunk=chunk))
    assert over is not None and "TORCHYARD_MAX_IMAGE_BYTES" in over, (
        f"an image one byte over max_image_bytes was not refused for its size: {over}")

    def images(n: int) -> list:
        return [("file", (f"{k}.png", _png(k), "image/png")) for k in range(n)]

    at = _refusal(form_request(images(LIMITS.max_images), {"job_id": "j"}, chunk=chunk))
    assert at is None, f"exactly max_images ({LIMITS.max_images}) images were refused: {at}"
    over = _refusal(form_request(images(LIMITS.max_images + 1), {"job_id": "j"}, chunk=chunk))
    assert over is not None and "TORCHYARD_MAX_IMAGES_PER_REQUEST" in over, (
        f"one image more than max_images was not refused for their number: {over}")

    body = len(httpx.Request("POST", "http://x/predict", files=images(1), data={"job_id": "j"}).read())
    exact = FormLimits(LIMITS.max_images, LIMITS.max_image_bytes, max_body_bytes=body)
    at = _refusal(form_request(images(1), {"job_id": "j"}, chunk=chunk), exact)
    assert at is None, f"a body of exactly max_body_bytes ({body}) was refused: {at}"
    short = FormLimits(LIMITS.max_images, LIMITS.max_image_bytes, max_body_bytes=body - 1)
    over = _refusal(form_request(images(1), {"job_id": "j"}, chunk=chunk), short)
    assert over is not None and "TORCHYARD_MAX_PREDICT_REQUEST_BYTES" in over, (
        f"a body one byte over max_body_bytes was not refused for its size: {over}")
