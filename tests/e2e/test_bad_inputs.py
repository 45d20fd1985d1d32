"""Hostile and malformed input against the live stack: every one answered with the contract's 4xx
and a JSON `detail`, no file written outside the data dir, and the service still trains and
predicts normally afterwards. Plus a static check that nothing unpickles user data."""

from __future__ import annotations

import ast
import io
import socket
import stat
import uuid
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.support import REPO, png_bytes, wait_for_job
from worker.data import fake_images

pytestmark = pytest.mark.e2e

ESCAPE_NAME = f"torchyard-escape-{uuid.uuid4().hex}"
ESCAPE_TARGETS = [Path("/tmp") / f"{ESCAPE_NAME}.png", REPO / f"{ESCAPE_NAME}.png"]


def _png(size: tuple[int, int] = (32, 32), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG")
    return buffer.getvalue()


def _zip(entries: list[tuple[str | zipfile.ZipInfo, bytes]], compression: int = zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buffer, "w", compression) as archive:
        warnings.simplefilter("ignore")  # duplicate names are the point of one case
        for name, data in entries:
            archive.writestr(name, data)
    return buffer.getvalue()


def _special(name: str, mode: int, data: bytes = b"") -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.create_system = 3  # unix, so external_attr carries st_mode
    info.external_attr = mode << 16
    return info, data


def _good(name: str) -> tuple[str, bytes]:
    return name, _png()


def _upload(zip_bytes: bytes) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post("/datasets", files={"file": ("d.zip", zip_bytes, "application/zip")})


def _predict(files: list[tuple[str, bytes, str]], **data: str) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post("/predict", data={"job_id": "nosuchjob", **data},
                            files=[("file", f) for f in files])


def _raw(request: bytes) -> Callable[[httpx.Client], httpx.Response]:
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


def _big_json_stream(client: httpx.Client) -> httpx.Response:
    """No Content-Length (chunked): the limit must hold on the bytes actually streamed."""
    def body():
        yield b'{"model": "cifar_net", "dataset": "fake", "device": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    return client.post("/jobs", content=body(), headers={"Content-Type": "application/json"})


BOMB = np.zeros((8000, 8000), dtype=bool)  # 64 M pixels, a few KB as a 1-bit PNG


def _pixel_bomb() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(BOMB).save(buffer, format="PNG")
    return buffer.getvalue()


def _image(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buffer, format=fmt)
    return buffer.getvalue()


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n%%EOF\n"


def _part(name: str, data: bytes, filename: str | None = None, boundary: bytes = b"b") -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return b"--" + boundary + b"\r\nContent-Disposition: " + disposition.encode() + b"\r\n\r\n" + data + b"\r\n"


def _form(path: str, body: bytes, content_type: str = "multipart/form-data; boundary=b"
          ) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post(path, content=body, headers={"Content-Type": content_type})


def _with(method: str, path: str, **headers: str) -> Callable[[httpx.Client], httpx.Response]:
    body = {"json": {"model": "nosuch", "dataset": "fake"}} if method == "POST" and path == JOB else {}
    return lambda c: c.request(method, path, headers=headers, **body)


def _spec(**fields: object) -> Callable[[httpx.Client], httpx.Response]:
    return lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "fake", **fields})


def _chunks(*parts: bytes):
    yield from parts


PNG = _png()
JOB = "/jobs"
A_ZIP = _zip([_good("cats/a.png")])
# The request head is capped (TORCHYARD_MAX_HEADER_BYTES, 64 KiB); a declared body over a route's cap
# is refused before a byte of it is read; a body of the wrong type likewise (app/api/front.py).
HOSTILE_HEADS = [
    ("head over 64 KiB", _raw(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"), {431}),
    ("jobs: Content-Length not a number", _raw(b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                                b"Content-Length: 12abc\r\nConnection: close\r\n\r\n{}"), {400}),
    ("jobs: declared over the JSON cap", _raw(b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                               b"Content-Length: 2000000\r\nConnection: close\r\n\r\n{"), {413}),
    ("GET with a body over the JSON cap", _raw(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2000000\r\n"
                                                b"Connection: close\r\n\r\nxx"), {413}),
    ("predict: declared over its cap", _raw(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; "
                                             b"boundary=b\r\nContent-Length: 99999999999\r\nConnection: close\r\n\r\n"), {413}),
]
MORE_BATTERY: list[tuple[str, Callable[[httpx.Client], httpx.Response], set[int]]] = [
    # --- content types, on the headers --------------------------------------------------------
    ("jobs: text/plain", _form(JOB, b'{"model": "cifar_net", "dataset": "fake"}', "text/plain"), {415}),
    ("jobs: form-urlencoded", lambda c: c.post(JOB, data={"model": "cifar_net", "dataset": "fake"}), {415}),
    ("jobs: multipart", lambda c: c.post(JOB, files={"file": ("a.json", b"{}", "application/json")}), {415}),
    ("jobs: application/xml", _form(JOB, b"<job/>", "application/xml"), {415}),
    ("jobs: chunked text/plain", lambda c: c.post(JOB, content=_chunks(b"a" * 1000, b"b"),
                                                  headers={"Content-Type": "text/plain"}), {415}),
    ("jobs: +json type, bad spec", _form(JOB, b'{"model": "gpt5", "dataset": "fake"}', "application/vnd.x+json"), {422}),
    ("datasets: application/json", lambda c: c.post("/datasets", json={"file": "x"}), {415}),
    ("datasets: text/plain", _form("/datasets", b"PK", "text/plain"), {415}),
    ("predict: application/json", lambda c: c.post("/predict", json={"job_id": "x"}), {415}),
    ("predict: text/plain", _form("/predict", b"hello", "text/plain"), {415}),
    # --- JSON a parser may choke on ---------------------------------------------------------------
    ("jobs: JSON nested 100 000 deep", _form(JOB, b"[" * 100_000, "application/json"), {400, 422}),
    ("jobs: a 5000-digit integer", _form(JOB, b'{"model":"cifar_net","dataset":"fake","epochs":' + b"9" * 5000 + b"}",
                                         "application/json"), {400, 422}),
    ("jobs: invalid UTF-8", _form(JOB, b'{"model": "\xff\xfe", "dataset": "fake"}', "application/json"), {400, 422}),
    ("jobs: UTF-8 BOM", _form(JOB, b'\xef\xbb\xbf{"model": "nosuch", "dataset": "fake"}', "application/json"), {400, 422}),
    ("jobs: 1e400 epochs", _form(JOB, b'{"model":"cifar_net","dataset":"fake","epochs":1e400}', "application/json"), {422}),
    ("jobs: null model", lambda c: c.post(JOB, json={"model": None, "dataset": "fake"}), {422}),
    ("jobs: model as a list", lambda c: c.post(JOB, json={"model": ["cifar_net"], "dataset": "fake"}), {422}),
    # --- specs that are valid JSON but cannot run ---------------------------------------------------
    ("jobs: seed negative", _spec(seed=-1), {422}),
    ("jobs: seed over 2^31", _spec(seed=2**31), {422}),
    ("jobs: image_size 8", _spec(model="resnet18", image_size=8), {422}),
    ("jobs: image_size for a fixed-size net", _spec(image_size=64), {422}),
    ("jobs: kind export", _spec(kind="export"), {422}),
    ("jobs: epochs 1001", _spec(epochs=1001), {422}),
    ("jobs: batch_size 8193", _spec(batch_size=8193), {422}),
    ("jobs: learning_rate 0", _spec(learning_rate=0), {422}),
    ("jobs: val_fraction 1", _spec(val_fraction=1.0), {422}),
    ("jobs: val_fraction leaving no training image", _spec(val_fraction=0.9999), {422}),
    ("jobs: empty device", _spec(device=""), {422}),
    ("jobs: memory no worker has", _spec(model="resnet18", image_size=512, batch_size=8192), {422}),
    ("jobs: cifar10 files missing", _spec(dataset="cifar10"), {422}),
    ("jobs: mnist files missing", _spec(model="catdog_net", dataset="mnist"), {422}),
    ("jobs: fashion_mnist files missing", _spec(dataset="fashion_mnist"), {422}),
    # --- multipart uploads, streamed ----------------------------------------------------------------
    ("datasets: no boundary", _form("/datasets", _part("file", A_ZIP, "a.zip") + b"--b--\r\n", "multipart/form-data"), {422}),
    ("datasets: no closing boundary", _form("/datasets", _part("file", A_ZIP, "a.zip")), {422}),
    ("datasets: garbage body", _form("/datasets", b"this is not multipart at all"), {422}),
    ("datasets: two file parts", _form("/datasets", _part("file", A_ZIP, "a.zip") + _part("file", A_ZIP, "b.zip")
                                       + b"--b--\r\n"), {422}),
    ("datasets: name field over 4 KiB", _form("/datasets", _part("name", b"n" * 5000) + _part("file", A_ZIP, "a.zip")
                                              + b"--b--\r\n"), {422}),
    ("datasets: 17 parts", _form("/datasets", b"".join(_part(f"f{i}", b"x") for i in range(17)) + b"--b--\r\n"), {422}),
    ("datasets: a part without a name", _form("/datasets", b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--\r\n"),
     {422}),
    ("datasets: part headers over 16 KiB", _form("/datasets", b"--b\r\nX-Pad: " + b"p" * 20_000 + b"\r\n"
                                                 b'Content-Disposition: form-data; name="file"\r\n\r\nx\r\n--b--\r\n'), {422}),
    ("datasets: empty file", _upload(b""), {415}),
    ("datasets: name of 201 characters", lambda c: c.post("/datasets", data={"name": "n" * 201},
                                                          files={"file": ("d.zip", A_ZIP, "application/zip")}), {422}),
    ("datasets: only EPS", _upload(_zip([("cats/a.eps", EPS)])), {422}),
    ("datasets: only TIFF", _upload(_zip([("cats/a.tif", _image("TIFF"))])), {422}),
    ("datasets: only ICO and PSD-like", _upload(_zip([("cats/a.ico", _image("ICO")), ("cats/b.psd", b"8BPS" + bytes(40))])),
     {422}),
    # --- predict: only the allowlisted decoders ----------------------------------------------------------
    ("predict: TIFF", _predict([("a.tif", _image("TIFF"), "image/tiff")]), {415}),
    ("predict: EPS", _predict([("a.eps", EPS, "application/postscript")]), {415}),
    ("predict: ICO", _predict([("a.ico", _image("ICO"), "image/x-icon")]), {415}),
    ("predict: no boundary", _form("/predict", b"x", "multipart/form-data"), {422}),
    # --- DNS rebinding and cross-origin writes ---------------------------------------------------------
    ("Host: another site", _with("GET", JOB, Host="attacker.example"), {400}),
    ("Host: another site with a port", _with("GET", "/devices", Host="attacker.example:8000"), {400}),
    ("Host: another machine's address", _with("GET", JOB, Host="10.1.2.3"), {400}),
    ("Host: another site, POST", _with("POST", JOB, Host="attacker.example"), {400}),
    ("Origin: another site, POST /jobs", _with("POST", JOB, Origin="http://attacker.example"), {403}),
    ("Origin: null, POST /jobs", _with("POST", JOB, Origin="null"), {403}),
    ("Origin: another site, POST /datasets", _with("POST", "/datasets", Origin="https://attacker.example"), {403}),
    ("Origin: another site, POST /predict", _with("POST", "/predict", Origin="http://attacker.example"), {403}),
    ("Origin: another site, cancel", _with("POST", "/jobs/nosuchjob/cancel", Origin="http://attacker.example"), {403}),
    ("Origin: another site, DELETE a job", _with("DELETE", "/jobs/nosuchjob", Origin="http://attacker.example"), {403}),
    ("Origin: another site, DELETE a dataset", _with("DELETE", "/datasets/dsx", Origin="http://a.example"), {403}),
    ("Origin: another port of this host", _with("POST", JOB, Origin="http://127.0.0.1:1"), {403}),
    # --- deleting jobs ------------------------------------------------------------------------------------
    ("jobs: delete unknown", lambda c: c.delete("/jobs/nosuchjob"), {404}),
    ("jobs: delete traversal id", lambda c: c.delete("/jobs/..%2F..%2Fcheckpoints"), {404, 422}),
    ("jobs: delete id with NUL", lambda c: c.delete("/jobs/a%00b"), {404, 422}),
    ("jobs: delete id of 300 characters", lambda c: c.delete("/jobs/" + "a" * 300), {404, 422}),
    # --- methods and odd paths --------------------------------------------------------------------------
    ("metrics: POST", lambda c: c.post("/metrics"), {405}),
    ("healthz: POST", lambda c: c.post("/healthz"), {405}),
    ("datasets: PUT", lambda c: c.put("/datasets", json={}), {405}),
    ("jobs: PATCH a job", lambda c: c.patch("/jobs/nosuchjob", json={}), {405}),
    ("jobs: id of 5000 characters", lambda c: c.get("/jobs/" + "a" * 5000), {404, 422}),
    ("jobs: limit 501", lambda c: c.get(JOB, params={"limit": 501}), {422}),
    ("jobs: cursor of 500 characters", lambda c: c.get(JOB, params={"cursor": "a" * 500}), {422}),
    ("events: Last-Event-ID of 10 000 characters", lambda c: c.get("/jobs/nosuchjob/events",
                                                                   headers={"Last-Event-ID": "1" * 10_000}), {404, 422}),
]
# (name, request, expected status(es))
BATTERY: list[tuple[str, Callable[[httpx.Client], httpx.Response], set[int]]] = [
    # --- POST /jobs --------------------------------------------------------------------------
    ("jobs: not json", lambda c: c.post(JOB, content=b"{nope", headers={"Content-Type": "application/json"}), {422}),
    ("jobs: json array", lambda c: c.post(JOB, json=["cifar_net"]), {422}),
    ("jobs: empty object", lambda c: c.post(JOB, json={}), {422}),
    ("jobs: unknown model", lambda c: c.post(JOB, json={"model": "gpt5", "dataset": "fake"}), {422}),
    ("jobs: unknown dataset", lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "nosuch"}), {404, 422}),
    ("jobs: traversal dataset", lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "../../etc"}), {404, 422}),
    ("jobs: epochs 0", lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "fake", "epochs": 0}), {422}),
    ("jobs: epochs a string", lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "fake", "epochs": "many"}), {422}),
    ("jobs: negative lr", lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "fake", "learning_rate": -1}), {422}),
    ("jobs: NaN lr", lambda c: c.post(JOB, content=b'{"model":"cifar_net","dataset":"fake","learning_rate":NaN}',
                                      headers={"Content-Type": "application/json"}), {422}),
    ("jobs: bad optimizer", lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "fake", "optimizer": "rmsprop"}), {422}),
    ("jobs: unknown device", lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "fake", "device": "tpu:9"}), {404, 422, 503}),
    ("jobs: val_fraction 1.5", lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "fake", "val_fraction": 1.5}), {422}),
    ("jobs: batch_size 0", lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "fake", "batch_size": 0}), {422}),
    ("jobs: unknown field", lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "fake", "rm": "-rf"}), {422}),
    ("jobs: long idempotency key", lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "fake"},
                                                    headers={"Idempotency-Key": "k" * 500}), {422}),
    ("jobs: json over the limit", lambda c: c.post(JOB, json={"model": "cifar_net", "dataset": "x" * (2 << 20)}), {413}),
    ("jobs: streamed json over the limit", _big_json_stream, {413}),
    ("datasets: huge Content-Length", _raw(b"POST /datasets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; "
                                           b"boundary=b\r\nContent-Length: 99999999999999\r\nConnection: close\r\n\r\n--b"), {413}),
    # --- listing and ids in paths ------------------------------------------------------------
    ("jobs: limit 0", lambda c: c.get(JOB, params={"limit": 0}), {422}),
    ("jobs: bogus status", lambda c: c.get(JOB, params={"status": "exploded"}), {422}),
    ("jobs: traversal cursor", lambda c: c.get(JOB, params={"cursor": "../../x"}), {422}),
    ("jobs: unknown id", lambda c: c.get("/jobs/nosuchjob"), {404}),
    ("jobs: encoded traversal id", lambda c: c.get("/jobs/..%2F..%2Fetc%2Fpasswd"), {404, 422}),
    ("jobs: dot-dot checkpoint", lambda c: c.get("/jobs/%2e%2e/checkpoint"), {404, 422}),
    ("jobs: NUL in id", lambda c: c.get("/jobs/a%00b"), {404, 422}),
    ("jobs: cancel unknown", lambda c: c.post("/jobs/nosuchjob/cancel"), {404}),
    ("jobs: events unknown", lambda c: c.get("/jobs/nosuchjob/events"), {404}),
    ("jobs: checkpoint unknown", lambda c: c.get("/jobs/nosuchjob/checkpoint"), {404}),
    ("datasets: traversal id", lambda c: c.get("/datasets/..%2F..%2Fetc"), {404, 422}),
    ("datasets: delete traversal id", lambda c: c.delete("/datasets/..%2Fcheckpoints"), {404, 422}),
    ("datasets: delete built-in", lambda c: c.delete("/datasets/fake"), {409}),
    ("datasets: delete unknown", lambda c: c.delete("/datasets/dsnosuch"), {404}),
    ("unknown path", lambda c: c.get("/etc/passwd"), {404}),
    ("wrong method", lambda c: c.put(JOB, json={}), {405}),
    # --- POST /datasets ----------------------------------------------------------------------
    ("datasets: no file", lambda c: c.post("/datasets", data={"name": "x"}), {415, 422}),  # a form without a file
    ("datasets: not a zip", _upload(b"PK\x03\x04 definitely not a zip"), {415}),
    ("datasets: empty zip", _upload(_zip([])), {422}),
    ("datasets: path traversal", _upload(_zip([_good("cats/a.png"), (f"../../../../../../tmp/{ESCAPE_NAME}.png", PNG)])), {422}),
    ("datasets: absolute path", _upload(_zip([_good("cats/a.png"), (f"/tmp/{ESCAPE_NAME}.png", PNG)])), {422}),
    ("datasets: symlink", _upload(_zip([_good("cats/a.png"), _special("cats/link.png", stat.S_IFLNK | 0o777, b"/etc/passwd")])), {422}),
    ("datasets: device file", _upload(_zip([_good("cats/a.png"), _special("cats/dev.png", stat.S_IFCHR | 0o644)])), {422}),
    ("datasets: duplicate names", _upload(_zip([_good("cats/a.png"), _good("cats/a.png")])), {422}),
    ("datasets: zip bomb ratio", _upload(_zip([_good("cats/a.png"), ("cats/bomb.png", bytes(20 << 20))], zipfile.ZIP_DEFLATED)), {413}),
    ("datasets: name too long", lambda c: c.post("/datasets", data={"name": "n" * 500},
                                                 files={"file": ("d.zip", _zip([_good("cats/a.png")]), "application/zip")}), {422}),
    # --- POST /predict -----------------------------------------------------------------------
    ("predict: no file", lambda c: c.post("/predict", data={"job_id": "nosuchjob"}), {415, 422}),
    ("predict: no job_id", lambda c: c.post("/predict", files={"file": ("a.png", PNG, "image/png")}), {422}),
    ("predict: unknown job", _predict([("a.png", PNG, "image/png")]), {404}),
    ("predict: traversal job id", _predict([("a.png", PNG, "image/png")], job_id="../../etc"), {404, 422}),
    ("predict: not an image", _predict([("a.txt", b"hello", "text/plain")]), {415}),
    ("predict: truncated png", _predict([("a.png", PNG[:20], "image/png")]), {415}),
    ("predict: pixel bomb", _predict([("bomb.png", _pixel_bomb(), "image/png")]), {413}),
    ("predict: top_k 0", _predict([("a.png", PNG, "image/png")], top_k="0"), {422}),
    ("predict: top_k text", _predict([("a.png", PNG, "image/png")], top_k="all"), {422}),
    ("predict: too many files", _predict([(f"{i}.png", PNG, "image/png") for i in range(65)]), {413, 422}),
    ("events: bad Last-Event-ID", lambda c: c.get("/jobs/nosuchjob/events", headers={"Last-Event-ID": "x"}), {404, 422}),
    *HOSTILE_HEADS,
    *MORE_BATTERY,
]


def _pattern_png(label: int) -> bytes:
    image = fake_images(torch.tensor([label]), 3, 32, 32, seed=4242)[0]
    return png_bytes(image.permute(1, 2, 0).numpy())


def test_battery_of_bad_inputs_then_normal_service(stack: dict) -> None:
    client = stack["client"]
    assert len(BATTERY) >= 100
    datasets_before = {d["id"] for d in client.get("/datasets").json()["datasets"]}
    failures = []
    for name, request, expected in BATTERY:
        response = request(client)
        try:
            detail = response.json().get("detail")
        except ValueError:
            detail = None
        if response.status_code not in expected or not detail or not isinstance(detail, str):
            failures.append(f"{name}: {response.status_code} {response.text[:200]}")
    assert not failures, "\n".join(failures)

    # Nothing escaped the data dir, nothing was recorded for a refused zip.
    assert not any(target.exists() for target in ESCAPE_TARGETS)
    assert {d["id"] for d in client.get("/datasets").json()["datasets"]} == datasets_before

    # A job with a bad Last-Event-ID for a real job id: refused before the stream starts.
    job = client.post(JOB, json={"model": "cifar_net", "dataset": "fake", "epochs": 1}).json()
    assert client.get(f"/jobs/{job['id']}/events", headers={"Last-Event-ID": "0-0; DROP"}).status_code == 422

    # The service still serves normally: the job trains, and predicts.
    done = wait_for_job(client, job["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done["error"]
    answer = client.post("/predict", data={"job_id": job["id"]}, files={"file": ("t.png", _pattern_png(2), "image/png")})
    assert answer.status_code == 200, answer.text
    assert answer.json()["results"][0]["predictions"][0]["index"] == 2
    # An image whose header passes the API's check but whose data is damaged: the worker refuses it
    # (415) and goes on serving.
    noisy = png_bytes(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    damaged = client.post("/predict", data={"job_id": job["id"]},
                          files={"file": ("cut.png", noisy[: len(noisy) // 2], "image/png")})
    assert damaged.status_code == 415 and damaged.json()["detail"], damaged.text
    again = client.post("/predict", data={"job_id": job["id"]}, files={"file": ("t.png", _pattern_png(4), "image/png")})
    assert again.status_code == 200 and again.json()["results"][0]["predictions"][0]["index"] == 4
    assert stack["worker"].poll() is None and stack["api"].poll() is None


def _torch_load_calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"]


def test_every_torch_load_is_weights_only_and_nothing_unpickles() -> None:
    sources = [p for folder in ("app", "core", "client", "worker", "models", "bench", "scripts", "tests")
               for p in (REPO / folder).rglob("*.py")]
    assert sources
    unsafe, calls = [], 0
    for path in sources:
        text = path.read_text()
        tree = ast.parse(text)
        for call in _torch_load_calls(tree):
            calls += 1
            flag = next((k.value for k in call.keywords if k.arg == "weights_only"), None)
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                unsafe.append(f"{path.relative_to(REPO)}:{call.lineno}")
        service = any(path.is_relative_to(REPO / package) for package in ("app", "core", "client", "worker", "models"))
        for node in ast.walk(tree):
            if service and isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in ("pickle", "dill", "cloudpickle", "marshal", "shelve") for n in names):
                    unsafe.append(f"{path.relative_to(REPO)}:{node.lineno} imports a pickle module")
            if (isinstance(node, ast.Attribute) and node.attr in ("load", "loads", "Unpickler")
                    and isinstance(node.value, ast.Name) and node.value.id in ("pickle", "dill", "cloudpickle")):
                unsafe.append(f"{path.relative_to(REPO)}:{node.lineno} unpickles")
    assert calls >= 2  # the checkpoint loader and the dataset cache at least
    assert not unsafe, unsafe


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
    small = _png((8, 8))
    noise = png_bytes(np.random.default_rng(1).integers(0, 255, (40, 40, 3), dtype=np.uint8))  # > 3000 bytes
    cases = [
        ("json over MAX_JSON_BYTES", c.post(JOB, json={"model": "m" * 400, "dataset": "fake"}), 413, "limit of 300 bytes"),
        ("json under it", c.post(JOB, json={"model": "nosuch", "dataset": "fake"}), 422, "unknown model"),
        ("body over MAX_REQUEST_BYTES", c.post("/datasets", files={"file": ("d.zip", bytes(3_100_000), "application/zip")}), 413, "limit of 3000000"),
        ("upload over MAX_UPLOAD_BYTES", c.post("/datasets", files={"file": ("d.zip", _zip([("a/x.png", bytes(2_600_000))]),
                                                                             "application/zip")}), 413, "limit is 2500000"),
        ("zip over MAX_ZIP_ENTRIES", _upload(_zip([_good(f"a/{k}.png") for k in range(4)]))(c), 413, "entries"),
        ("zip over MAX_ZIP_UNCOMPRESSED_BYTES", _upload(_zip([("a/1.png", np.random.bytes(1_100_000)),
                                                                   ("a/2.png", np.random.bytes(1_100_000))]))(c), 413, "expands to"),
        ("zip over MAX_ZIP_RATIO", _upload(_zip([("a/1.png", bytes(1_500_000))], zipfile.ZIP_DEFLATED))(c), 413, "zip bomb"),
        ("image over MAX_IMAGE_BYTES", _predict([("n.png", noise, "image/png")])(c), 413, "limit of 3000 bytes"),
        ("image over MAX_IMAGE_PIXELS", _predict([("p.png", _png((40, 40)), "image/png")])(c), 413, "pixels"),
        ("over MAX_IMAGES_PER_REQUEST", _predict([(f"{k}.png", small, "image/png") for k in range(3)])(c), 413, "images in one request"),
        ("within every limit", _predict([("ok.png", small, "image/png")])(c), 404, "not found"),  # then: unknown job
    ]
    wrong = [f"{name}: {r.status_code} {r.text[:200]}" for name, r, status, says in cases
             if r.status_code != status or says not in r.json().get("detail", "")]
    assert not wrong, "\n".join(wrong)
