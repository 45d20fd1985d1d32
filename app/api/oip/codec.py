"""The protocol's bodies: a request read as it streams and split by the binary tensor extension, and
an answer written as JSON or with binary outputs.

The binary extension: a request whose `Inference-Header-Content-Length` is N has N bytes of JSON
(the `InferenceRequest`) and then the tensors' bytes, in the order of the inputs whose
`parameters.binary_data_size` says how many are theirs. A BYTES tensor's elements are each a 4-byte
little-endian length and that many bytes. The answer mirrors it: an output asked for with
`binary_data` (or all, with the request's `binary_data_output`) carries `binary_data_size` and no
`data`, its bytes after the JSON, whose length goes back in the same header.

Clients send no Content-Type (tritonclient sends none), so the body is read as bytes, counted
against the /predict budget as it arrives (app/api/serving/budget.py) and capped at
TORCHYARD_MAX_PREDICT_REQUEST_BYTES, and the tensors stay in the buffer they arrived in: the
message queued for a worker is that buffer with its header appended (core/wire.py), as /predict's.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.requests import Request

from app.api.oip.protocol import InferenceRequest
from core.errors import InvalidInput, TooLarge

HEADER_LENGTH = "inference-header-content-length"
_LENGTH = struct.Struct("<I")


class BadRequest(InvalidInput):
    """A request the protocol answers 400: wrong shape, datatype, name, or a malformed binary header."""

    status_code = 400


@dataclass(frozen=True)
class Body:
    """A request as it arrived: its JSON header parsed, and where each input's binary data lies."""

    buffer: bytearray
    request: InferenceRequest
    binary: dict[str, tuple[int, int]]  # input name → (offset, length) in `buffer`


async def read_body(request: Request, limit: int, on_bytes: Callable[[int], None]) -> bytearray:
    """The whole body, each chunk reserved as it arrives; 413 past `limit`."""
    buffer = bytearray()
    async for chunk in request.stream():
        if not chunk:
            continue
        if len(buffer) + len(chunk) > limit:
            raise TooLarge(f"the request is over the limit of {limit} bytes (TORCHYARD_MAX_PREDICT_REQUEST_BYTES)")
        on_bytes(len(chunk))
        buffer += chunk
    return buffer


def parse(buffer: bytearray, header_length: str | None, max_json_bytes: int) -> Body:
    """The JSON header and the binary section's slices; 400 for anything that does not add up, 413
    for JSON over `max_json_bytes` (parsed, a JSON tensor's numbers take up to 8× their text)."""
    if header_length is None:
        json_end = len(buffer)
    elif not header_length.strip().isdigit() or not 0 < int(header_length) <= len(buffer):
        raise BadRequest(f"Inference-Header-Content-Length {header_length[:40]!r} is not a length within the "
                         f"body of {len(buffer)} bytes")
    else:
        json_end = int(header_length)
    if json_end == 0:
        raise BadRequest("the body is empty: send an inference request (JSON)")
    if json_end > max_json_bytes:
        raise TooLarge(f"the request's JSON is {json_end} bytes; the limit is {max_json_bytes} "
                       f"(TORCHYARD_OIP_MAX_JSON_BYTES): send tensors with the binary extension")
    try:
        request = InferenceRequest.model_validate_json(bytes(memoryview(buffer)[:json_end]))
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem.get("loc", ()))
        raise BadRequest(f"malformed inference request: {where + ': ' if where else ''}{problem.get('msg')}") from None
    binary: dict[str, tuple[int, int]] = {}
    at = json_end
    for tensor in request.inputs:
        size = (tensor.parameters or {}).get("binary_data_size")
        if size is None:
            continue
        if header_length is None:
            raise BadRequest(f"input {tensor.name!r} has binary_data_size but the request has no "
                             f"Inference-Header-Content-Length")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or at + size > len(buffer):
            raise BadRequest(f"input {tensor.name!r}: binary_data_size {size!r} does not fit in the "
                             f"{len(buffer) - at} bytes left of the body")
        binary[tensor.name] = (at, size)
        at += size
    if at != len(buffer):
        raise BadRequest(f"{len(buffer) - at} bytes of the body belong to no input (binary_data_size)")
    return Body(buffer, request, binary)


def split_elements(buffer: bytearray, offset: int, length: int, name: str) -> list[tuple[int, int]]:
    """A binary BYTES tensor's elements as (offset, length) in `buffer`: each a 4-byte little-endian
    length and its bytes, to the end of the tensor's data exactly."""
    elements, at, end = [], offset, offset + length
    while at < end:
        if at + 4 > end:
            raise BadRequest(f"input {name!r}: a BYTES element's 4-byte length is cut off")
        (size,) = _LENGTH.unpack_from(buffer, at)
        at += 4
        if at + size > end:
            raise BadRequest(f"input {name!r}: a BYTES element of {size} bytes runs past the tensor's data")
        elements.append((at, size))
        at += size
    return elements


def encode_bytes_elements(elements: list[bytes]) -> bytes:
    return b"".join(_LENGTH.pack(len(e)) + e for e in elements)


def encode_response(response: dict[str, Any], binary: list[bytes]) -> tuple[bytes, int | None]:
    """The answer's body (an `InferenceResponse` as plain data), and its JSON's length when binary
    outputs follow it (None: JSON only)."""
    header = orjson.dumps(response)
    if not binary:
        return header, None
    return header + b"".join(binary), len(header)
