"""Hostile and malformed input against the live stack: every one answered with the contract's 4xx
and a JSON `detail`, no file written outside the data dir, and the service still trains and
predicts normally afterwards. (The requests are built by bad_requests.py; each input limit
following its setting: test_input_limits.py; nothing unpickles user data: tests/test_unpickling.py.)"""

from __future__ import annotations

import stat
import zipfile
from collections.abc import Callable

import httpx
import numpy as np
import pytest

from tests.e2e.bad_requests import (
    A_ZIP,
    EPS,
    ESCAPE_NAME,
    ESCAPE_TARGETS,
    JOB,
    PNG,
    big_json_stream,
    chunked,
    form_part,
    form_post,
    good_entry,
    image_as,
    job_spec,
    pixel_bomb,
    predict,
    raw_request,
    special_entry,
    upload,
    with_headers,
    zip_of,
)
from tests.support import pattern_png, png_bytes, wait_for_job

pytestmark = pytest.mark.e2e


# The request head is capped (TORCHYARD_MAX_HEADER_BYTES, 64 KiB); a declared body over a route's cap
# is refused before a byte of it is read; a body of the wrong type likewise (app/api/front.py).
HOSTILE_HEADS = [
    ("head over 64 KiB", raw_request(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"), {431}),
    ("jobs: Content-Length not a number", raw_request(b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                                       b"Content-Length: 12abc\r\nConnection: close\r\n\r\n{}"), {400}),
    ("jobs: declared over the JSON cap", raw_request(b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                                      b"Content-Length: 2000000\r\nConnection: close\r\n\r\n{"), {413}),
    ("GET with a body over the JSON cap", raw_request(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2000000\r\n"
                                                       b"Connection: close\r\n\r\nxx"), {413}),
    ("predict: declared over its cap", raw_request(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; "
                                                    b"boundary=b\r\nContent-Length: 99999999999\r\nConnection: close\r\n\r\n"), {413}),
]


MORE_BATTERY: list[tuple[str, Callable[[httpx.Client], httpx.Response], set[int]]] = [
    # --- content types, on the headers --------------------------------------------------------
    ("jobs: text/plain", form_post(JOB, b'{"model": "cifar_net", "dataset": "fake"}', "text/plain"), {415}),
    ("jobs: form-urlencoded", lambda c: c.post(JOB, data={"model": "cifar_net", "dataset": "fake"}), {415}),
    ("jobs: multipart", lambda c: c.post(JOB, files={"file": ("a.json", b"{}", "application/json")}), {415}),
    ("jobs: application/xml", form_post(JOB, b"<job/>", "application/xml"), {415}),
    ("jobs: chunked text/plain", lambda c: c.post(JOB, content=chunked(b"a" * 1000, b"b"),
                                                  headers={"Content-Type": "text/plain"}), {415}),
    ("jobs: +json type, bad spec", form_post(JOB, b'{"model": "gpt5", "dataset": "fake"}', "application/vnd.x+json"), {422}),
    ("datasets: application/json", lambda c: c.post("/datasets", json={"file": "x"}), {415}),
    ("datasets: text/plain", form_post("/datasets", b"PK", "text/plain"), {415}),
    ("predict: application/json", lambda c: c.post("/predict", json={"job_id": "x"}), {415}),
    ("predict: text/plain", form_post("/predict", b"hello", "text/plain"), {415}),
    # --- JSON a parser may choke on ---------------------------------------------------------------
    ("jobs: JSON nested 100 000 deep", form_post(JOB, b"[" * 100_000, "application/json"), {400, 422}),
    ("jobs: a 5000-digit integer", form_post(JOB, b'{"model":"cifar_net","dataset":"fake","epochs":' + b"9" * 5000 + b"}",
                                             "application/json"), {400, 422}),
    ("jobs: invalid UTF-8", form_post(JOB, b'{"model": "\xff\xfe", "dataset": "fake"}', "application/json"), {400, 422}),
    ("jobs: UTF-8 BOM", form_post(JOB, b'\xef\xbb\xbf{"model": "nosuch", "dataset": "fake"}', "application/json"), {400, 422}),
    ("jobs: 1e400 epochs", form_post(JOB, b'{"model":"cifar_net","dataset":"fake","epochs":1e400}', "application/json"), {422}),
    ("jobs: null model", lambda c: c.post(JOB, json={"model": None, "dataset": "fake"}), {422}),
    ("jobs: model as a list", lambda c: c.post(JOB, json={"model": ["cifar_net"], "dataset": "fake"}), {422}),
    # --- specs that are valid JSON but cannot run ---------------------------------------------------
    ("jobs: seed negative", job_spec(seed=-1), {422}),
    ("jobs: seed over 2^31", job_spec(seed=2**31), {422}),
    ("jobs: image_size 8", job_spec(model="resnet18", image_size=8), {422}),
    ("jobs: image_size for a fixed-size net", job_spec(image_size=64), {422}),
    ("jobs: kind export", job_spec(kind="export"), {422}),
    ("jobs: epochs 1001", job_spec(epochs=1001), {422}),
    ("jobs: batch_size 8193", job_spec(batch_size=8193), {422}),
    ("jobs: learning_rate 0", job_spec(learning_rate=0), {422}),
    ("jobs: val_fraction 1", job_spec(val_fraction=1.0), {422}),
    ("jobs: val_fraction leaving no training image", job_spec(val_fraction=0.9999), {422}),
    ("jobs: empty device", job_spec(device=""), {422}),
    ("jobs: memory no worker has", job_spec(model="resnet18", image_size=512, batch_size=8192), {422}),
    ("jobs: cifar10 files missing", job_spec(dataset="cifar10"), {422}),
    ("jobs: mnist files missing", job_spec(model="catdog_net", dataset="mnist"), {422}),
    ("jobs: fashion_mnist files missing", job_spec(dataset="fashion_mnist"), {422}),
    # --- multipart uploads, streamed ----------------------------------------------------------------
    ("datasets: no boundary", form_post("/datasets", form_part("file", A_ZIP, "a.zip") + b"--b--\r\n", "multipart/form-data"), {422}),
    ("datasets: no closing boundary", form_post("/datasets", form_part("file", A_ZIP, "a.zip")), {422}),
    ("datasets: garbage body", form_post("/datasets", b"this is not multipart at all"), {422}),
    ("datasets: two file parts", form_post("/datasets", form_part("file", A_ZIP, "a.zip") + form_part("file", A_ZIP, "b.zip")
                                           + b"--b--\r\n"), {422}),
    ("datasets: name field over 4 KiB", form_post("/datasets", form_part("name", b"n" * 5000) + form_part("file", A_ZIP, "a.zip")
                                                  + b"--b--\r\n"), {422}),
    ("datasets: 17 parts", form_post("/datasets", b"".join(form_part(f"f{i}", b"x") for i in range(17)) + b"--b--\r\n"), {422}),
    ("datasets: a part without a name", form_post("/datasets", b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--\r\n"),
     {422}),
    ("datasets: part headers over 16 KiB", form_post("/datasets", b"--b\r\nX-Pad: " + b"p" * 20_000 + b"\r\n"
                                                     b'Content-Disposition: form-data; name="file"\r\n\r\nx\r\n--b--\r\n'), {422}),
    ("datasets: empty file", upload(b""), {415}),
    ("datasets: name of 201 characters", lambda c: c.post("/datasets", data={"name": "n" * 201},
                                                          files={"file": ("d.zip", A_ZIP, "application/zip")}), {422}),
    ("datasets: only EPS", upload(zip_of([("cats/a.eps", EPS)])), {422}),
    ("datasets: only TIFF", upload(zip_of([("cats/a.tif", image_as("TIFF"))])), {422}),
    ("datasets: only ICO and PSD-like", upload(zip_of([("cats/a.ico", image_as("ICO")), ("cats/b.psd", b"8BPS" + bytes(40))])),
     {422}),
    # --- predict: only the allowlisted decoders ----------------------------------------------------------
    ("predict: TIFF", predict([("a.tif", image_as("TIFF"), "image/tiff")]), {415}),
    ("predict: EPS", predict([("a.eps", EPS, "application/postscript")]), {415}),
    ("predict: ICO", predict([("a.ico", image_as("ICO"), "image/x-icon")]), {415}),
    ("predict: no boundary", form_post("/predict", b"x", "multipart/form-data"), {422}),
    # --- DNS rebinding and cross-origin writes ---------------------------------------------------------
    ("Host: another site", with_headers("GET", JOB, Host="attacker.example"), {400}),
    ("Host: another site with a port", with_headers("GET", "/devices", Host="attacker.example:8000"), {400}),
    ("Host: another machine's address", with_headers("GET", JOB, Host="10.1.2.3"), {400}),
    ("Host: another site, POST", with_headers("POST", JOB, Host="attacker.example"), {400}),
    ("Origin: another site, POST /jobs", with_headers("POST", JOB, Origin="http://attacker.example"), {403}),
    ("Origin: null, POST /jobs", with_headers("POST", JOB, Origin="null"), {403}),
    ("Origin: another site, POST /datasets", with_headers("POST", "/datasets", Origin="https://attacker.example"), {403}),
    ("Origin: another site, POST /predict", with_headers("POST", "/predict", Origin="http://attacker.example"), {403}),
    ("Origin: another site, cancel", with_headers("POST", "/jobs/nosuchjob/cancel", Origin="http://attacker.example"), {403}),
    ("Origin: another site, DELETE a job", with_headers("DELETE", "/jobs/nosuchjob", Origin="http://attacker.example"), {403}),
    ("Origin: another site, DELETE a dataset", with_headers("DELETE", "/datasets/dsx", Origin="http://a.example"), {403}),
    ("Origin: another port of this host", with_headers("POST", JOB, Origin="http://127.0.0.1:1"), {403}),
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
    ("jobs: streamed json over the limit", big_json_stream, {413}),
    ("datasets: huge Content-Length", raw_request(b"POST /datasets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; "
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
    ("datasets: not a zip", upload(b"PK\x03\x04 definitely not a zip"), {415}),
    ("datasets: empty zip", upload(zip_of([])), {422}),
    ("datasets: path traversal", upload(zip_of([good_entry("cats/a.png"), (f"../../../../../../tmp/{ESCAPE_NAME}.png", PNG)])), {422}),
    ("datasets: absolute path", upload(zip_of([good_entry("cats/a.png"), (f"/tmp/{ESCAPE_NAME}.png", PNG)])), {422}),
    ("datasets: symlink", upload(zip_of([good_entry("cats/a.png"), special_entry("cats/link.png", stat.S_IFLNK | 0o777, b"/etc/passwd")])), {422}),
    ("datasets: device file", upload(zip_of([good_entry("cats/a.png"), special_entry("cats/dev.png", stat.S_IFCHR | 0o644)])), {422}),
    ("datasets: duplicate names", upload(zip_of([good_entry("cats/a.png"), good_entry("cats/a.png")])), {422}),
    ("datasets: zip bomb ratio", upload(zip_of([good_entry("cats/a.png"), ("cats/bomb.png", bytes(20 << 20))], zipfile.ZIP_DEFLATED)), {413}),
    ("datasets: name too long", lambda c: c.post("/datasets", data={"name": "n" * 500},
                                                 files={"file": ("d.zip", zip_of([good_entry("cats/a.png")]), "application/zip")}), {422}),
    # --- POST /predict -----------------------------------------------------------------------
    ("predict: no file", lambda c: c.post("/predict", data={"job_id": "nosuchjob"}), {415, 422}),
    ("predict: no job_id", lambda c: c.post("/predict", files={"file": ("a.png", PNG, "image/png")}), {422}),
    ("predict: unknown job", predict([("a.png", PNG, "image/png")]), {404}),
    ("predict: traversal job id", predict([("a.png", PNG, "image/png")], job_id="../../etc"), {404, 422}),
    ("predict: not an image", predict([("a.txt", b"hello", "text/plain")]), {415}),
    ("predict: truncated png", predict([("a.png", PNG[:20], "image/png")]), {415}),
    ("predict: pixel bomb", predict([("bomb.png", pixel_bomb(), "image/png")]), {413}),
    ("predict: top_k 0", predict([("a.png", PNG, "image/png")], top_k="0"), {422}),
    ("predict: top_k text", predict([("a.png", PNG, "image/png")], top_k="all"), {422}),
    ("predict: too many files", predict([(f"{i}.png", PNG, "image/png") for i in range(65)]), {413, 422}),
    ("events: bad Last-Event-ID", lambda c: c.get("/jobs/nosuchjob/events", headers={"Last-Event-ID": "x"}), {404, 422}),
    *HOSTILE_HEADS,
    *MORE_BATTERY,
]


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
    answer = client.post("/predict", data={"job_id": job["id"]}, files={"file": ("t.png", pattern_png(2), "image/png")})
    assert answer.status_code == 200, answer.text
    assert answer.json()["results"][0]["predictions"][0]["index"] == 2
    # An image whose header passes the API's check but whose data is damaged: the worker refuses it
    # (415) and goes on serving.
    noisy = png_bytes(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    damaged = client.post("/predict", data={"job_id": job["id"]},
                          files={"file": ("cut.png", noisy[: len(noisy) // 2], "image/png")})
    assert damaged.status_code == 415 and damaged.json()["detail"], damaged.text
    again = client.post("/predict", data={"job_id": job["id"]}, files={"file": ("t.png", pattern_png(4), "image/png")})
    assert again.status_code == 200 and again.json()["results"][0]["predictions"][0]["index"] == 4
    assert stack["worker"].poll() is None and stack["api"].poll() is None
