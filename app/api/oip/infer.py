"""POST /v2/models/{name}[/versions/{v}]/infer: a protocol request → /predict's engine → the answer.

One input per request, either of:
- INPUT__0, FP32 [n, C, H, W]: rows preprocessed as exports take them (docs/deploying-models.md);
  sent to the worker as core/wire.py's "fp32" items, which go straight to the forward.
- IMAGE, BYTES [n] or [n, 1]: encoded image files, each header checked here as /predict checks its
  files (format, pixels, size: 413/415 before anything is queued), decoded by the worker through
  the same pipeline as /predict.
The answer is OUTPUT__0, FP32 [n, classes] (softmax probabilities), or with the classification
extension (`parameters.classification: k` on the output) BYTES [n, k] of "score:index:label".

The request goes through app/api/serving/engine.PredictionClient.predict as a `PredictCall` whose
form's buffer is the body itself (binary tensors are not copied; JSON tensors are appended to it
as float32), so it has /predict's batching, devices, aliases, budget, resends and timeouts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request

from app.api.oip.catalog import ModelCatalog, ModelInfo, ModelRef
from app.api.oip.codec import BadRequest, Body, encode_bytes_elements, encode_response, parse, read_body, split_elements
from app.api.oip.protocol import (
    BYTES,
    FP32,
    INPUT_IMAGE,
    INPUT_TENSOR,
    OUTPUT_PROBABILITIES,
    RequestInput,
)
from app.api.oip.stats import InferenceStats
from app.api.serving.engine import PredictionClient
from app.api.serving.intake import PredictCall, check_image
from app.api.serving.multipart import PredictForm
from core.errors import InvalidInput, TooLarge
from core.wire import Encoding


class Inference:
    def __init__(self, engine: PredictionClient, catalog: ModelCatalog, stats: InferenceStats, *,
                 max_items: int, max_image_bytes: int, max_pixels: int, max_body_bytes: int,
                 max_json_bytes: int) -> None:
        self.engine, self.catalog, self.stats = engine, catalog, stats
        self.max_items, self.max_image_bytes, self.max_pixels = max_items, max_image_bytes, max_pixels
        self.max_body_bytes, self.max_json_bytes = max_body_bytes, max_json_bytes

    async def answer(self, request: Request, name: str, version: str | None) -> tuple[bytes, int | None]:
        """The answer's body and, with binary outputs, its JSON's length (Inference-Header-Content-Length)."""
        started = time.perf_counter_ns()
        ref = await self.catalog.resolve(name, version)
        reservation = self.engine.intake.reservation(request)
        try:
            try:
                buffer = await read_body(request, self.max_body_bytes, reservation.reserve)
                body = parse(buffer, request.headers.get("inference-header-content-length"), self.max_json_bytes)
                call, items = self._call(body, ref)
                outputs = self._outputs(body)
                read_ns = time.perf_counter_ns()
                try:
                    reply = _Reply.read(await self.engine.predict(call))
                except InvalidInput as exc:  # the worker's 422: the input does not fit the model
                    raise BadRequest(exc.detail) from None
                replied_ns = time.perf_counter_ns()
                answer = self._response(body, ref, reply, outputs)
            except Exception:
                self.stats.failed(ref.name, ref.version, time.perf_counter_ns() - started)
                raise
        finally:
            reservation.release()
        self.stats.succeeded(ref.name, ref.version_of(reply.job_id), items, input_ns=read_ns - started,
                             queue_ns=replied_ns - read_ns, output_ns=time.perf_counter_ns() - replied_ns)
        return answer

    # ------------------------------------------------------------------ the request
    def _call(self, body: Body, ref: ModelRef) -> tuple[PredictCall, int]:
        inputs = body.request.inputs
        if len(inputs) != 1:
            raise BadRequest(f"send exactly one input, {INPUT_TENSOR} ({FP32}) or {INPUT_IMAGE} ({BYTES}); "
                             f"got {len(inputs)}")
        tensor = inputs[0]
        encoding: Encoding
        if tensor.name == INPUT_TENSOR:
            form, shape, encoding = self._tensor_rows(body, tensor, ref.info), ref.info.shape, "fp32"
        elif tensor.name == INPUT_IMAGE:
            form, shape, encoding = self._images(body, tensor), None, "image"
        else:
            raise BadRequest(f"unknown input {tensor.name[:80]!r}: this model takes {INPUT_TENSOR} or {INPUT_IMAGE}")
        job_id = None if ref.alias is not None else ref.info.job_id
        call = PredictCall(job_id, ref.alias, 1, form, encoding=encoding, shape=shape, reply="probabilities")
        return call, len(form.images)

    def _batch(self, tensor: RequestInput) -> int:
        if not tensor.shape or tensor.shape[0] < 1:
            raise BadRequest(f"input {tensor.name!r}: shape {tensor.shape} has no batch of at least 1")
        if tensor.shape[0] > self.max_items:
            raise TooLarge(f"{tensor.shape[0]} items in one request; the limit is {self.max_items} "
                           f"(TORCHYARD_MAX_IMAGES_PER_REQUEST)")
        return tensor.shape[0]

    def _tensor_rows(self, body: Body, tensor: RequestInput, info: ModelInfo) -> PredictForm:
        if tensor.datatype != FP32:
            raise BadRequest(f"input {INPUT_TENSOR} is {FP32}, not {tensor.datatype[:16]!r}")
        n = self._batch(tensor)
        if list(tensor.shape[1:]) != list(info.shape) or len(tensor.shape) != 4:
            raise BadRequest(f"input {INPUT_TENSOR} has shape {tensor.shape}; this model takes [-1, "
                             f"{', '.join(map(str, info.shape))}] (N×C×H×W, float32 in [0, 1])")
        row = 4 * math.prod(info.shape)
        buffer = body.buffer
        if tensor.name in body.binary:
            offset, length = body.binary[tensor.name]
            if length != n * row:
                raise BadRequest(f"input {INPUT_TENSOR}: {length} bytes of data for shape {tensor.shape} "
                                 f"({n * row} expected)")
        else:
            import numpy as np  # at the first JSON tensor, not at the API's start (it holds no numpy otherwise)

            try:
                values = np.asarray(tensor.data, dtype="<f4").reshape(-1)
            except (ValueError, TypeError):
                raise BadRequest(f"input {INPUT_TENSOR}: data is not a list of numbers") from None
            if values.size != n * row // 4:
                raise BadRequest(f"input {INPUT_TENSOR}: {values.size} values for shape {tensor.shape} "
                                 f"({n * row // 4} expected)")
            offset = len(buffer)
            buffer += values.tobytes()
            tensor.data = None  # the parsed numbers (several times their text) are not held while the worker computes
        items: list[tuple[str | None, int, int]] = [(f"{INPUT_TENSOR}[{i}]", offset + i * row, row) for i in range(n)]
        return PredictForm(buffer, images=items)

    def _images(self, body: Body, tensor: RequestInput) -> PredictForm:
        if tensor.datatype != BYTES:
            raise BadRequest(f"input {INPUT_IMAGE} is {BYTES} (encoded image files), not {tensor.datatype[:16]!r}")
        n = self._batch(tensor)
        if len(tensor.shape) > 2 or (len(tensor.shape) == 2 and tensor.shape[1] != 1):
            raise BadRequest(f"input {INPUT_IMAGE} has shape {tensor.shape}; send [-1] or [-1, 1]: one file per item")
        buffer = body.buffer
        if tensor.name in body.binary:
            elements = split_elements(buffer, *body.binary[tensor.name], tensor.name)
        else:
            data = tensor.data if isinstance(tensor.data, list) else None
            flat = [e for row in data for e in (row if isinstance(row, list) else [row])] if data is not None else []
            if not all(isinstance(e, str) for e in flat) or data is None:
                raise BadRequest(f"input {INPUT_IMAGE}: JSON data must be a list of strings (send image files "
                                 f"with the binary extension)")
            elements = []
            for element in flat:
                encoded = element.encode("utf-8", "surrogatepass")  # a lone surrogate is bytes too (415 below)
                elements.append((len(buffer), len(encoded)))
                buffer += encoded
        if len(elements) != n:
            raise BadRequest(f"input {INPUT_IMAGE}: {len(elements)} elements for shape {tensor.shape}")
        images: list[tuple[str | None, int, int]] = []
        for i, (offset, length) in enumerate(elements):
            name = f"{INPUT_IMAGE}[{i}]"
            if length > self.max_image_bytes:
                raise TooLarge(f"{name} is {length} bytes; the limit is {self.max_image_bytes} "
                               f"(TORCHYARD_MAX_IMAGE_BYTES)")
            check_image(name, memoryview(buffer)[offset:offset + length], self.max_pixels)
            images.append((name, offset, length))
        return PredictForm(buffer, images=images)

    # ------------------------------------------------------------------ the answer
    @staticmethod
    def _outputs(body: Body) -> list[tuple[str, bool, int]]:
        """(name, binary, classification k or 0) of each output asked for; all of them when none is named."""
        request = body.request
        binary_default = (request.parameters or {}).get("binary_data_output", False) is True
        if not request.outputs:
            return [(OUTPUT_PROBABILITIES, binary_default, 0)]
        specs = []
        for output in request.outputs:
            if output.name != OUTPUT_PROBABILITIES:
                raise BadRequest(f"unknown output {output.name[:80]!r}: this model gives {OUTPUT_PROBABILITIES}")
            parameters = output.parameters or {}
            k = parameters.get("classification", 0)
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise BadRequest(f"output {output.name}: classification must be a count of classes, not {k!r}")
            specs.append((output.name, parameters.get("binary_data", binary_default) is True, k))
        return specs

    def _response(self, body: Body, ref: ModelRef, reply: _Reply,
                  wanted: list[tuple[str, bool, int]]) -> tuple[bytes, int | None]:
        """The `InferenceResponse`, written as plain data (its pydantic model's fields and order:
        tests/app/api/oip/test_codec.py holds them equal), since building the models cost a fifth of
        the API's own time per request."""
        import numpy as np  # at the first answer, not at the API's start

        request = body.request
        rows = np.array([[math.nan if p is None else p for p in row] for row in reply.probabilities], dtype="<f4")
        outputs: list[dict[str, Any]] = []
        binary: list[bytes] = []
        for name, as_binary, asked_k in wanted:
            k = min(asked_k, len(reply.classes))
            if k:
                order = np.argsort(-rows, axis=1, kind="stable")[:, :k]
                labels = [f"{rows[i, j]:f}:{j}:{reply.classes[j]}" for i in range(len(rows)) for j in order[i]]
                shape, datatype = [len(rows), k], BYTES
                raw = encode_bytes_elements([label.encode() for label in labels]) if as_binary else None
                data: list[Any] | None = None if as_binary else list(labels)
            else:
                shape, datatype = [len(rows), len(reply.classes)], FP32
                raw = rows.tobytes() if as_binary else None
                data = None if as_binary else [None if math.isnan(v) else v for v in rows.reshape(-1).tolist()]
            if raw is not None:
                outputs.append({"name": name, "shape": shape, "datatype": datatype,
                                "parameters": {"binary_data_size": len(raw)}})
                binary.append(raw)
            else:
                outputs.append({"name": name, "shape": shape, "datatype": datatype, "data": data})
        document: dict[str, Any] = {"model_name": ref.name, "model_version": ref.version_of(reply.job_id)}
        if request.id is not None:
            document["id"] = request.id
        document["parameters"] = {"job_id": reply.job_id, "device": reply.device}
        document["outputs"] = outputs
        return encode_response(document, binary)


@dataclass(frozen=True, slots=True)
class _Reply:
    """The worker's answer (core/wire.ProbabilitiesResponse), read without building the model."""

    job_id: str
    device: str
    classes: list[str]
    probabilities: list[list[float | None]]

    @classmethod
    def read(cls, raw: bytes) -> _Reply:
        document = orjson.loads(raw)
        return cls(document["job_id"], document["device"], document["classes"], document["probabilities"])
