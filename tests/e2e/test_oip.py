"""The Open Inference Protocol (/v2) end to end, driven by Triton's own client
(`tritonclient.http.InferenceServerClient`) against the session's real API and CPU worker: health,
metadata, config, infer with JSON tensors and with the binary extension, FP32 (preprocessed as
docs/deploying-models.md says) and BYTES (a real JPEG), the classification extension, aliases and
their versions, statistics, the repository index, and every refusal in the protocol's shape (never
a 500). The numbers are /predict's for the same image and model."""

from __future__ import annotations

import io
import json
import socket

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from PIL import Image
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.e2e

EXAMPLE = "examples/pattern_3.png"


def _jpeg() -> bytes:
    out = io.BytesIO()
    with Image.open(EXAMPLE) as image:
        image.convert("RGB").save(out, format="JPEG", quality=90)
    return out.getvalue()


def _preprocessed(shape: tuple[int, int, int]) -> np.ndarray:
    """The caller's preprocessing of docs/deploying-models.md: RGB, bilinear resize, /255, C×H×W."""
    channels, height, width = shape
    with Image.open(EXAMPLE) as image:
        image = image.convert("RGB" if channels == 3 else "L")
        if image.size != (width, height):
            image = image.resize((width, height), Image.Resampling.BILINEAR)
        array = np.asarray(image, dtype=np.float32) / 255.0
    return array.reshape(height, width, channels).transpose(2, 0, 1)[None].copy()


def _predict(stack: dict, job_id: str, data: bytes, filename: str) -> dict[int, float]:
    """/predict's probabilities (every class) for one file: index → probability."""
    response = stack["client"].post("/predict", data={"job_id": job_id, "top_k": "10"},
                                    files={"file": (filename, data)})
    assert response.status_code == 200, response.text
    return {p["index"]: p["probability"] for p in response.json()["results"][0]["predictions"]}


@pytest.fixture(scope="module")
def oip(stack: dict) -> triton.InferenceServerClient:
    client = triton.InferenceServerClient(url=f"127.0.0.1:{stack['port']}", network_timeout=120)
    yield client
    client.close()


def test_health_metadata_and_config(oip: triton.InferenceServerClient, cifar_pair: tuple[str, str]) -> None:
    job = cifar_pair[0]
    assert oip.is_server_live() and oip.is_server_ready()
    server = oip.get_server_metadata()
    assert server["name"] == "torchyard" and {"binary_tensor_data", "classification"} <= set(server["extensions"])
    assert oip.is_model_ready(job)
    meta = oip.get_model_metadata(job)
    assert meta["versions"] == ["1"]
    assert {t["name"]: (t["datatype"], t["shape"]) for t in meta["inputs"]} == {
        "INPUT__0": ("FP32", [-1, 3, 32, 32]), "IMAGE": ("BYTES", [-1, 1])}
    assert meta["outputs"][0]["name"] == "OUTPUT__0" and meta["outputs"][0]["shape"] == [-1, 10]
    config = oip.get_model_config(job)
    assert config["max_batch_size"] >= 1
    assert {t["name"]: (t["data_type"], t["dims"]) for t in config["input"]} == {
        "INPUT__0": ("TYPE_FP32", [3, 32, 32]), "IMAGE": ("TYPE_STRING", [1])}
    assert config["output"] == [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [10]}]


def test_fp32_and_jpeg_give_predicts_numbers_json_and_binary(oip: triton.InferenceServerClient, stack: dict,
                                                             cifar_pair: tuple[str, str]) -> None:
    job = cifar_pair[0]
    rows = _preprocessed((3, 32, 32))
    with open(EXAMPLE, "rb") as f:
        png = f.read()
    expected_png = _predict(stack, job, png, "pattern_3.png")
    jpeg = _jpeg()
    expected_jpeg = _predict(stack, job, jpeg, "pattern_3.jpg")
    for binary in (True, False):
        tensor = triton.InferInput("INPUT__0", list(rows.shape), "FP32")
        tensor.set_data_from_numpy(rows, binary_data=binary)
        result = oip.infer(job, [tensor], outputs=[triton.InferRequestedOutput("OUTPUT__0", binary_data=binary)])
        probabilities = result.as_numpy("OUTPUT__0")
        assert probabilities.shape == (1, 10) and probabilities.dtype == np.float32
        assert abs(float(probabilities.sum()) - 1.0) < 1e-4
        for index, p in expected_png.items():  # the same image, preprocessed by the caller: /predict's numbers
            assert abs(float(probabilities[0, index]) - p) < 1e-5, (binary, index)
    images = np.array([[jpeg], [jpeg]], dtype=np.object_)
    tensor = triton.InferInput("IMAGE", [2, 1], "BYTES")
    tensor.set_data_from_numpy(images, binary_data=True)
    result = oip.infer(job, [tensor])  # no outputs named: all of them, binary
    probabilities = result.as_numpy("OUTPUT__0")
    assert probabilities.shape == (2, 10)
    for index, p in expected_jpeg.items():  # the same JPEG through the same pipeline: the same numbers
        assert abs(float(probabilities[0, index]) - p) < 1e-6 and abs(float(probabilities[1, index]) - p) < 1e-6
    assert result.get_response()["model_version"] == "1"


def test_classification_extension(oip: triton.InferenceServerClient, stack: dict, cifar_pair: tuple[str, str]) -> None:
    job = cifar_pair[0]
    response = stack["client"].post("/predict", data={"job_id": job, "top_k": "3"},
                                    files={"file": ("p.jpg", _jpeg())})
    top = response.json()["results"][0]["predictions"]
    tensor = triton.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([_jpeg()], dtype=np.object_), binary_data=True)
    for binary in (True, False):
        result = oip.infer(job, [tensor], outputs=[triton.InferRequestedOutput("OUTPUT__0", binary_data=binary,
                                                                               class_count=3)])
        labels = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("OUTPUT__0").reshape(-1)]
        parsed = [label.split(":", 2) for label in labels]
        assert [(int(i), name) for _, i, name in parsed] == [(p["index"], p["label"]) for p in top]
        assert all(abs(float(score) - p["probability"]) < 1e-5 for (score, _, _), p in zip(parsed, top, strict=True))


def test_alias_versions_and_statistics(oip: triton.InferenceServerClient, stack: dict,
                                       cifar_pair: tuple[str, str]) -> None:
    first, second = cifar_pair
    client = stack["client"]
    for job in (first, second):
        assert client.put("/aliases/oip-pets", json={"job_id": job}).status_code in (200, 201)
    meta = oip.get_model_metadata("oip-pets")
    assert meta["versions"] == ["1", "2"] and meta["parameters"]["job_id"] == second
    rows = _preprocessed((3, 32, 32))
    tensor = triton.InferInput("INPUT__0", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows)
    served = {}
    for version in ("", "1", "2"):
        response = oip.infer("oip-pets", [tensor], model_version=version).get_response()
        served[version] = (response["model_version"], response["parameters"]["job_id"])
    assert served == {"": ("2", second), "1": ("1", first), "2": ("2", second)}
    stats = {s["version"]: s for s in oip.get_inference_statistics("oip-pets")["model_stats"]}
    assert stats["1"]["inference_stats"]["success"]["count"] == 1 and stats["2"]["inference_stats"]["success"]["count"] == 2
    counts = {stage: stats["2"]["inference_stats"][stage]["count"]
              for stage in ("success", "queue", "compute_input", "compute_infer", "compute_output")}
    assert set(counts.values()) == {2}, counts
    everything = {(s["name"], s["version"]) for s in oip.get_inference_statistics()["model_stats"]}
    assert {("oip-pets", "1"), ("oip-pets", "2")} <= everything
    index = {(m["name"], m["version"], m["state"]) for m in oip.get_model_repository_index()}
    assert ("oip-pets", "2", "READY") in index and (first, "1", "READY") in index


def _refused(call) -> tuple[int, str]:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return int(caught.value.status()), caught.value.message()


def test_every_refusal_in_the_protocols_shape(oip: triton.InferenceServerClient, stack: dict,
                                              cifar_pair: tuple[str, str]) -> None:
    job = cifar_pair[0]
    rows = _preprocessed((3, 32, 32))

    def infer(name: str, shape: list[int], datatype: str, data: np.ndarray, model: str = job, **kw: object):
        tensor = triton.InferInput(name, shape, datatype)
        tensor.set_data_from_numpy(data, binary_data=True)
        return lambda: oip.infer(model, [tensor], **kw)

    status, message = _refused(infer("INPUT__0", [1, 3, 16, 16], "FP32", np.zeros((1, 3, 16, 16), np.float32)))
    assert status == 400 and "[-1, 3, 32, 32]" in message
    assert _refused(infer("INPUT__0", [1, 3, 32, 32], "FP16", rows.astype(np.float16)))[0] == 400
    assert _refused(infer("PIXELS", [1, 3, 32, 32], "FP32", rows))[0] == 400
    assert _refused(infer("IMAGE", [1], "BYTES", np.array([b"not an image"], dtype=np.object_)))[0] == 415
    status, message = _refused(infer("INPUT__0", [1, 3, 32, 32], "FP32", rows, model="no-such-model"))
    assert status == 404 and "no-such-model" in message
    assert _refused(infer("INPUT__0", [1, 3, 32, 32], "FP32", rows, model_version="7"))[0] == 404
    evaluation = stack["client"].post(f"/jobs/{job}/evaluate", json={"dataset": "fake"})
    assert evaluation.status_code in (201, 202), evaluation.text
    status, message = _refused(lambda: oip.get_model_metadata(evaluation.json()["id"]))
    assert status == 404 and "not a model" in message
    many = np.zeros((65, 3, 32, 32), np.float32)  # TORCHYARD_MAX_IMAGES_PER_REQUEST is 64
    assert _refused(infer("INPUT__0", list(many.shape), "FP32", many))[0] == 413
    # What tritonclient cannot be made to send: a header length past the body, bytes of no input,
    # a BYTES element's length past its tensor, JSON that is not a request. Never a 500.
    url = f"http://127.0.0.1:{stack['port']}/v2/models/{job}/infer"
    header = json.dumps({"inputs": [{"name": "IMAGE", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 8}}]}).encode()
    for body, length in ((header + b"\x10\0\0\0abcd", len(header)), (header + b"\x04\0\0\0abcd", len(header) + 99),
                         (header + b"\x04\0\0\0abcdEXTRA", len(header)), (b"{not json", None)):
        headers = {"Inference-Header-Content-Length": str(length)} if length is not None else {}
        response = httpx.post(url, content=body, headers=headers)
        assert response.status_code == 400 and "error" in response.json(), (body, response.text)
    # Hostile JSON requests: each refused with its reason, none reaches a worker, never a 500.
    row = {"name": "INPUT__0", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.5] * 3072}
    for document, status in (
            ({"inputs": [{**row, "data": [[0.5, 0.5], [0.5]]}]}, 400),  # ragged
            ({"inputs": [{**row, "data": [{"a": 1}] * 3072}]}, 400),  # not numbers
            ({"inputs": [{**row, "shape": [0, 3, 32, 32]}]}, 400),
            ({"inputs": [row, row]}, 400),
            ({"inputs": [row], "outputs": [{"name": "LOGITS"}]}, 400),
            ({"inputs": [row], "outputs": [{"name": "OUTPUT__0", "parameters": {"classification": "x"}}]}, 400),
            ({"inputs": [{"name": "IMAGE", "shape": [1], "datatype": "BYTES", "data": ["\ud800"]}]}, 400),  # JSON refuses it
            ({"inputs": [{"name": "IMAGE", "shape": [1], "datatype": "BYTES", "data": [7]}]}, 400),
            ({"inputs": [{"name": "IMAGE", "shape": [1], "datatype": "BYTES", "data": ["not an image"]}]}, 415)):
        response = httpx.post(url, content=json.dumps(document).encode())
        assert response.status_code == status and response.json()["error"], (document.get("outputs"), response.text)
    # A declared body over the cap is refused on its headers, in the protocol's shape too.
    with socket.create_connection(("127.0.0.1", stack["port"]), timeout=30) as conn:
        conn.sendall(f"POST /v2/models/{job}/infer HTTP/1.1\r\nHost: localhost\r\n"
                     f"Content-Length: {1 << 40}\r\n\r\n".encode())
        received = b""
        while chunk := conn.recv(65536):  # the refusal closes the connection: read to its end (head and
            received += chunk              # body may come in separate segments)
        answer = received.decode()
    assert answer.startswith("HTTP/1.1 413") and '"error"' in answer, answer
