"""The /predict wire protocol between the API and a device's worker, owned here.

Why Redis lists and not Celery: a device that trains holds Celery's only slot, yet it must still
answer predictions; so each worker has an inference thread that BLPOPs its own list, and the
API waits on a one-off reply list. Both directions are encoded and decoded only here:

- Request, API → `ty:predict:<device id>` (RPUSH): a binary frame (`PredictRequest`): the bytes
  the images lie in, then a `PredictHeader` as JSON naming each image's offset and length, then a
  trailer. The API streams the multipart body into one buffer and appends the header to it, so a
  request's images are held once, never base64-encoded, and a request sent again is the same
  bytes. `queued_at` opens the worker's batching window; a request past its `deadline` is not
  computed (its caller has given up). Both are on Redis's clock (core/clock.RedisClock), so a
  worker whose wall clock is off neither drops live requests nor holds batches for the skew.
- Reply, worker → `request.reply_to` (RPUSH, short TTL): ``"<request_id> <status> <json body>"``.
  `reply_to` is the inbox of the API process that sent it, one list per process read by one
  listener there (app/api/serving/replies.py), so a request costs the API one Redis call, not a
  BLPOP of its own, and the worker answers a whole batch's requests to one API in one RPUSH. For
  200 the body is the `PredictResponse` itself, so the API passes it through without re-encoding;
  any other status carries `{"detail": ...}` and maps to the error of the same HTTP status.
- Tensors: a request's `encoding` says what its frame's items are. "image" (the default): encoded
  files the worker decodes through its one image → array transform. "fp32": preprocessed inputs
  (float32 little-endian C×H×W in [0, 1], as exports take them, docs/deploying-models.md), each
  item one row of `shape`, which the worker checks against the model's before the forward. Its
  `reply` says what comes back: "top_k" (a `PredictResponse`, /predict's) or "probabilities" (every
  class's probability per item and the class names: `ProbabilitiesResponse`, the Open Inference
  Protocol's OUTPUT__0, app/api/oip/).
- Preload, API → the same list: ``"preload <json>"`` (`PreloadRequest`), answered on its `reply_to`
  like a prediction once the job's model is resident on the device (200 `PreloadedModel`), or with
  the error of why it cannot be (409: checkpoint unreadable). Sent before an alias moves
  (core/preloading.py; the contract reports it as the move's `warm`); riding the predict list
  keeps it in order with the requests before it.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import orjson
from pydantic import BaseModel, Field, ValidationError

from core.errors import Conflict, InvalidInput, NotFound, TooLarge, TorchyardError, Unavailable, UnsupportedMedia
from core.images import IMAGE_FORMATS

__all__ = ["IMAGE_FORMATS", "REPLY_TTL_S", "Encoding", "MalformedMessage", "PredictHeader", "PredictReply",
           "PredictRequest", "PreloadRequest", "PreloadedModel", "ProbabilitiesResponse", "ReplyKind", "strict_json"]

REPLY_TTL_S = 60

# The statuses a worker may answer with, and the error each becomes in the API.
_ERRORS: dict[int, type[TorchyardError]] = {
    404: NotFound, 409: Conflict, 413: TooLarge, 415: UnsupportedMedia, 422: InvalidInput, 503: Unavailable,
}


def strict_json(document: Any) -> bytes:
    """Compact JSON of plain data as pydantic's `model_dump_json` writes it, byte for byte (floats
    included), with a NaN or an infinity written as null: strict JSON, which most clients need.

    orjson, because it costs a fraction of `json.dumps` (docs/benchmarks.md) and the worker's CPU
    per image is what bounds a fast device's throughput. orjson refuses a str holding lone surrogates (a file name that was not UTF-8, as
    `os.walk` returns it); json escapes those, so such a document goes that way instead."""
    try:
        return orjson.dumps(document)
    except orjson.JSONEncodeError:
        return json.dumps(_finite_or_none(document), separators=(",", ":"), allow_nan=False).encode()


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


class MalformedMessage(ValueError):
    """A message on a predict list that is not one of ours (dropped and logged, never fatal)."""


Encoding = Literal["image", "fp32"]
ReplyKind = Literal["top_k", "probabilities"]


class ProbabilitiesResponse(BaseModel):
    """The 200 body of a request whose `reply` is "probabilities": a row per item, in order."""

    job_id: str
    model: str
    device: str
    alias: str | None = None
    classes: list[str]
    probabilities: list[list[float | None]] = Field(description="Per item, every class's probability "
                                                                "(null where the model gave NaN).")


class PredictErrorBody(BaseModel):
    detail: str


class PredictHeader(BaseModel):
    """What a worker needs to answer a request, besides the image bytes it frames."""

    job_id: str
    alias: str | None = Field(default=None, description="The alias the caller named; the reply names it too.")
    top_k: int = Field(ge=1)
    reply_to: str = Field(description="The sending API process's inbox list.")
    request_id: str = Field(description="Names the reply in that inbox.")
    queued_at: float = Field(description="When the API first queued it, on Redis's clock (epoch s): opens the "
                                         "batching window.")
    deadline: float = Field(description="Redis's clock (epoch s) after which the caller no longer waits.")
    images: list[tuple[str | None, int, int]] = Field(
        min_length=1, description="(filename, offset, length) of each image in the frame, in order.")
    encoding: Encoding = Field(default="image", description='What each item is: an encoded image file, or "fp32", '
                                                            'one preprocessed float32 row of `shape`.')
    shape: tuple[int, int, int] | None = Field(default=None, description='"fp32": each row\'s (C, H, W).')
    reply: ReplyKind = Field(default="top_k", description="What the answer holds: top-k predictions, or every "
                                                          "class's probability (ProbabilitiesResponse).")


def encode_header(*, job_id: str, alias: str | None = None, top_k: int, reply_to: str, request_id: str, queued_at: float,
                  deadline: float, images: list[tuple[str | None, int, int]], encoding: Encoding = "image",
                  shape: tuple[int, int, int] | None = None, reply: ReplyKind = "top_k") -> bytes:
    """A PredictHeader's JSON, written from its fields without building the model: the API frames
    every /predict request, and a model's construction and dump cost ~20 µs of the API's few hundred
    per request (docs/benchmarks.md, "The service's own CPU per request"), where this costs ~2. The
    parameters are the model's fields, typed as the model types them (a test checks both that they
    match and that what this writes validates to the model); the worker validates every header it
    takes (`PredictRequest.decode`)."""
    return strict_json({"job_id": job_id, "alias": alias, "top_k": top_k, "reply_to": reply_to,
                         "request_id": request_id, "queued_at": queued_at, "deadline": deadline, "images": images,
                         "encoding": encoding, "shape": shape, "reply": reply})


# A frame: the bytes the images lie in (for the API, the multipart body as it arrived), then the
# header's JSON, then this trailer: the header's length and a tag. The header comes last so the API
# appends it to the buffer the body streamed into: the images are never copied to be sent.
_TRAILER = struct.Struct("<I4s")
FRAME_TAG = b"TYF1"
MAX_HEADER_BYTES = 1 << 20


class PredictRequest:
    """A prediction request as a worker takes it off its list: the header, and the frame the images
    are read from (no base64, no copy until an image is decoded)."""

    __slots__ = ("header", "raw")

    def __init__(self, header: PredictHeader, raw: bytes) -> None:
        self.header = header
        self.raw = raw

    @property
    def image_count(self) -> int:
        return len(self.header.images)

    def image(self, index: int) -> tuple[str | None, bytes]:
        filename, offset, length = self.header.images[index]
        return filename, self.raw[offset:offset + length]

    @staticmethod
    def frame_in_place(buffer: bytearray, header: PredictHeader | bytes) -> memoryview:
        """`buffer` (holding the images at the header's offsets) with the header (a model, or its
        JSON from `encode_header`) appended: the message to queue. The buffer must not change while
        the message is queued."""
        encoded = header if isinstance(header, bytes) else header.model_dump_json().encode()
        if len(encoded) > MAX_HEADER_BYTES:
            raise ValueError(f"a request header of {len(encoded)} bytes")
        buffer += encoded
        buffer += _TRAILER.pack(len(encoded), FRAME_TAG)
        return memoryview(buffer)

    @classmethod
    def frame(cls, images: Sequence[tuple[str | None, bytes]], **header: Any) -> bytes:
        """A message built from separate images (tests, benchmarks, tools): the images laid end to
        end, then the header (every PredictHeader field but `images`)."""
        buffer, placed = bytearray(), []
        for filename, data in images:
            placed.append((filename, len(buffer), len(data)))
            buffer += data
        return bytes(cls.frame_in_place(buffer, PredictHeader(images=placed, **header)))

    @staticmethod
    def is_frame(raw: bytes) -> bool:
        return raw[-4:] == FRAME_TAG

    @classmethod
    def decode(cls, raw: bytes) -> PredictRequest:
        if len(raw) < _TRAILER.size or not cls.is_frame(raw):
            raise MalformedMessage("not a prediction request: no frame trailer")
        header_length, _ = _TRAILER.unpack_from(raw, len(raw) - _TRAILER.size)
        payload_end = len(raw) - _TRAILER.size - header_length
        if header_length > MAX_HEADER_BYTES or payload_end < 0:
            raise MalformedMessage("not a prediction request: header length out of range")
        try:
            header = PredictHeader.model_validate_json(raw[payload_end:len(raw) - _TRAILER.size])
        except ValidationError as exc:
            raise MalformedMessage(f"not a prediction request: {exc.error_count()} error(s)") from exc
        if any(offset < 0 or length < 0 or offset + length > payload_end for _, offset, length in header.images):
            raise MalformedMessage("not a prediction request: an image lies outside the frame")
        return cls(header, raw)


class PredictReply:
    """A worker's answer: an HTTP status and the JSON body that goes with it."""

    __slots__ = ("body", "status")

    def __init__(self, status: int, body: str) -> None:
        self.status = status
        self.body = body

    @classmethod
    def predictions(cls, job_id: str, model: str, device: str, classes: Sequence[str],
                    images: Sequence[tuple[str | None, Sequence[int], Sequence[float]]],
                    alias: str | None = None) -> PredictReply:
        """A 200 whose body is a `PredictResponse` (core/schemas.py) with the same fields and order as
        pydantic writes, encoded from plain lists: `images` holds (filename, class indices, probabilities),
        best first; `alias` is the name the caller used, if any. The worker answers every image this
        way because building and dumping the pydantic models costs several times the CPU, and the
        worker's CPU per image is what bounds a fast device's throughput (docs/benchmarks.md).
        tests/core/test_wire.py holds the two equal, byte for byte. A model that outputs NaN gets
        null, as pydantic writes it, never invalid JSON."""
        results: list[dict[str, Any]] = [{"filename": filename, "predictions": [
            {"label": classes[index], "index": index, "probability": probability}
            for index, probability in zip(indices, probabilities, strict=True)]}
            for filename, indices, probabilities in images]
        document: dict[str, Any] = {"job_id": job_id, "model": model, "device": device, "results": results,
                                    "alias": alias}
        return cls(200, strict_json(document).decode())

    @classmethod
    def probabilities(cls, job_id: str, model: str, device: str, classes: Sequence[str],
                      rows: Sequence[Sequence[float]], alias: str | None = None) -> PredictReply:
        """A 200 whose body is a `ProbabilitiesResponse`, encoded from plain lists (as `predictions`)."""
        document = {"job_id": job_id, "model": model, "device": device, "alias": alias, "classes": list(classes),
                    "probabilities": rows}
        return cls(200, strict_json(document).decode())

    @classmethod
    def error(cls, status: int, detail: str) -> PredictReply:
        if status not in _ERRORS:
            raise ValueError(f"a worker cannot answer {status}")
        return cls(status, PredictErrorBody(detail=detail).model_dump_json())

    def encode(self) -> str:
        """For a one-off reply list (a warm request's)."""
        return f"{self.status} {self.body}"

    @classmethod
    def decode(cls, raw: str) -> PredictReply:
        code, _, body = raw.partition(" ")
        if not code.isdigit():
            raise MalformedMessage(f"not a prediction reply: {raw[:80]!r}")
        return cls(int(code), body)

    def encode_to(self, request_id: str) -> str:
        """For an API process's inbox: addressed to one of its waiting requests."""
        return f"{request_id} {self.status} {self.body}"

    @classmethod
    def decode_addressed(cls, raw: str) -> tuple[str, PredictReply]:
        request_id, _, rest = raw.partition(" ")
        if not request_id or not rest:
            raise MalformedMessage(f"not an addressed prediction reply: {raw[:80]!r}")
        return request_id, cls.decode(rest)

    def raise_for_status(self) -> None:
        """The error this reply stands for (its `detail` kept), or nothing for a 200."""
        if self.status == 200:
            return
        try:
            detail = PredictErrorBody.model_validate_json(self.body).detail
        except ValidationError:
            detail = f"the worker answered {self.status}"
        raise _ERRORS.get(self.status, Unavailable)(detail)


# --- preloading a model before an alias moves to it ---------------------------------------------
class PreloadRequest(BaseModel):
    """Load `job_id`'s model on the device that takes this message; answer when it is resident."""

    PREFIX: ClassVar[str] = "preload "

    job_id: str
    reply_to: str
    deadline: float = Field(description="Redis's clock (epoch s) after which the caller no longer waits.")

    def encode(self) -> str:
        return self.PREFIX + self.model_dump_json()

    @classmethod
    def is_preload(cls, raw: str | bytes) -> bool:
        return (raw.startswith(cls.PREFIX) if isinstance(raw, str) else raw.startswith(cls.PREFIX.encode()))

    @classmethod
    def decode(cls, raw: str | bytes) -> PreloadRequest:
        text = raw if isinstance(raw, str) else raw.decode("utf-8", "replace")
        try:
            return cls.model_validate_json(text[len(cls.PREFIX):])
        except ValidationError as exc:
            raise MalformedMessage(f"not a preload request: {exc.error_count()} error(s)") from exc


class PreloadedModel(BaseModel):
    """The 200 body of a preload reply."""

    job_id: str
    device: str
    loaded: bool = Field(description="False when it was resident already.")
    seconds: float
