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


PNG = _png()
JOB = "/jobs"
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
    ("datasets: huge Content-Length", _raw(b"POST /datasets HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
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
    ("datasets: no file", lambda c: c.post("/datasets", data={"name": "x"}), {422}),
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
    ("predict: no file", lambda c: c.post("/predict", data={"job_id": "nosuchjob"}), {422}),
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
]


def _pattern_png(label: int) -> bytes:
    image = fake_images(torch.tensor([label]), 3, 32, 32, seed=4242)[0]
    return png_bytes(image.permute(1, 2, 0).numpy())


def test_battery_of_bad_inputs_then_normal_service(stack: dict) -> None:
    client = stack["client"]
    assert len(BATTERY) >= 25
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
    sources = [p for folder in ("app", "worker", "models", "bench", "scripts", "tests")
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
        service = path.is_relative_to(REPO / "app") or path.is_relative_to(REPO / "worker") \
            or path.is_relative_to(REPO / "models")
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
