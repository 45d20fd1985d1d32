"""The /predict wire protocol between the API and a device's worker, owned here.

Why Redis lists and not Celery: a device that trains holds Celery's only slot, yet it must still
answer predictions; so each worker has an inference thread that BLPOPs its own list, and the
API waits on a one-off reply list. Both directions are encoded and decoded only here:

- Request, API → `ty:predict:<device id>` (RPUSH): a `PredictRequest` as JSON, images in
  base64. `queued_at` opens the worker's batching window; a request past its `deadline` is
  not computed (its caller has given up).
- Reply, worker → `request.reply_to` (RPUSH, short TTL): ``"<request_id> <status> <json body>"``.
  `reply_to` is the inbox of the API process that sent it, one list per process read by one
  listener there (app/api/reply_inbox.py), so a request costs the API one Redis call, not a
  BLPOP of its own, and the worker answers a whole batch's requests to one API in one RPUSH. For
  200 the body is the `PredictResponse` itself, so the API passes it through without re-encoding;
  any other status carries `{"detail": ...}` and maps to the error of the same HTTP status.
- Warm, API → the same list: ``"warm <json>"`` (`WarmRequest`), answered on its `reply_to` like a
  prediction once the job's model is resident on the device (200 `WarmedModel`), or with the
  error of why it cannot be (409: checkpoint unreadable). Sent before an alias moves
  (core/warming.py); riding the predict list keeps it in order with the requests before it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.errors import Conflict, InvalidInput, NotFound, TooLarge, TorchyardError, Unavailable, UnsupportedMedia
from core.images import IMAGE_FORMATS

__all__ = ["IMAGE_FORMATS", "REPLY_TTL_S", "MalformedMessage", "PredictReply", "PredictRequest", "WarmRequest",
           "WarmedModel", "WireImage", "strict_json"]

REPLY_TTL_S = 60

# The statuses a worker may answer with, and the error each becomes in the API.
_ERRORS: dict[int, type[TorchyardError]] = {
    404: NotFound, 409: Conflict, 413: TooLarge, 415: UnsupportedMedia, 422: InvalidInput, 503: Unavailable,
}


def strict_json(document: Any) -> bytes:
    """Compact JSON of plain data as pydantic's `model_dump_json` writes it, byte for byte (floats
    included), with a NaN or an infinity written as null: strict JSON, which most clients need.

    orjson: a /predict reply of five predictions took 1.6 µs against 8.1 for `json.dumps` (this
    2-core host, tight loop), and the worker's CPU per image is what bounds a fast device's
    throughput. orjson refuses a str holding lone surrogates (a file name that was not UTF-8, as
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


class PredictErrorBody(BaseModel):
    detail: str


class WireImage(BaseModel):
    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    filename: str | None
    data: bytes


class PredictRequest(BaseModel):
    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    job_id: str
    top_k: int = Field(ge=1)
    reply_to: str = Field(description="The sending API process's inbox list.")
    request_id: str = Field(description="Names the reply in that inbox.")
    queued_at: float = Field(description="When the API queued it (epoch s): opens the batching window.")
    deadline: float = Field(description="Epoch s after which the caller no longer waits.")
    images: list[WireImage] = Field(min_length=1)

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, raw: str | bytes) -> PredictRequest:
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise MalformedMessage(f"not a prediction request: {exc.error_count()} error(s)") from exc


class PredictReply:
    """A worker's answer: an HTTP status and the JSON body that goes with it."""

    __slots__ = ("body", "status")

    def __init__(self, status: int, body: str) -> None:
        self.status = status
        self.body = body

    @classmethod
    def predictions(cls, job_id: str, model: str, device: str, classes: Sequence[str],
                    images: Sequence[tuple[str | None, Sequence[int], Sequence[float]]]) -> PredictReply:
        """A 200 whose body is a `PredictResponse` (core/schemas.py) with the same fields and order as
        pydantic writes, encoded from plain lists: `images` holds (filename, class indices, probabilities),
        best first. The worker answers every image this way; building and dumping the pydantic models
        cost ~2× the CPU of `json.dumps` (27 against 15 µs per image, measured on this 2-core host),
        which `strict_json` cuts by five again, and the worker's CPU per image is what bounds a GPU's
        throughput. tests/core/test_wire.py holds the two equal, byte for byte. A model that outputs
        NaN gets null, as pydantic writes it, never invalid JSON."""
        results: list[dict[str, Any]] = [{"filename": filename, "predictions": [
            {"label": classes[index], "index": index, "probability": probability}
            for index, probability in zip(indices, probabilities, strict=True)]}
            for filename, indices, probabilities in images]
        document: dict[str, Any] = {"job_id": job_id, "model": model, "device": device, "results": results, "alias": None}
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


# --- warming a model before an alias moves to it (#16) -----------------------------------------
class WarmRequest(BaseModel):
    """Load `job_id`'s model on the device that takes this message; answer when it is resident."""

    PREFIX: ClassVar[str] = "warm "

    job_id: str
    reply_to: str
    deadline: float = Field(description="Epoch s after which the caller no longer waits.")

    def encode(self) -> str:
        return self.PREFIX + self.model_dump_json()

    @classmethod
    def is_warm(cls, raw: str | bytes) -> bool:
        return (raw.startswith(cls.PREFIX) if isinstance(raw, str) else raw.startswith(cls.PREFIX.encode()))

    @classmethod
    def decode(cls, raw: str | bytes) -> WarmRequest:
        text = raw if isinstance(raw, str) else raw.decode("utf-8", "replace")
        try:
            return cls.model_validate_json(text[len(cls.PREFIX):])
        except ValidationError as exc:
            raise MalformedMessage(f"not a warm request: {exc.error_count()} error(s)") from exc


class WarmedModel(BaseModel):
    """The 200 body of a warm reply."""

    job_id: str
    device: str
    loaded: bool = Field(description="False when it was resident already.")
    seconds: float
