"""The binary tensor extension's reading (app/api/oip/codec.py): what adds up is split in place,
anything that does not is a 400 (a JSON part over its cap a 413), before any worker sees it."""

from __future__ import annotations

import json
import struct

import pytest

from app.api.oip.codec import BadRequest, encode_bytes_elements, parse, split_elements
from core.errors import TooLarge

CAP = 1 << 20


def _request(*sizes: int) -> bytes:
    return json.dumps({"inputs": [{"name": f"IN{i}", "shape": [1], "datatype": "BYTES",
                                   "parameters": {"binary_data_size": size}} for i, size in enumerate(sizes)]}).encode()


def test_binary_inputs_are_sliced_in_order_and_bytes_elements_split() -> None:
    elements = encode_bytes_elements([b"first", b"", b"third!"])
    header = _request(3, len(elements))
    body = parse(bytearray(header + b"abc" + elements), str(len(header)), CAP)
    assert body.binary == {"IN0": (len(header), 3), "IN1": (len(header) + 3, len(elements))}
    found = split_elements(body.buffer, *body.binary["IN1"], "IN1")
    assert [bytes(body.buffer[o:o + n]) for o, n in found] == [b"first", b"", b"third!"]


@pytest.mark.parametrize("tail, length", [
    (b"abc", "0"), (b"abc", "-3"), (b"abc", "12x"), (b"abc", "999999"),  # header length outside the body
    (b"ab", None),  # binary_data_size past the body
    (b"abcEXTRA", None),  # bytes of no input
])
def test_what_does_not_add_up_is_a_400(tail: bytes, length: str | None) -> None:
    header = _request(3)
    with pytest.raises(BadRequest):
        parse(bytearray(header + tail), length if length is not None else str(len(header)), CAP)


def test_malformed_json_and_bytes_elements_are_400s_and_json_over_its_cap_a_413() -> None:
    for bad in (b"{not json", b'{"inputs": []}', b'{"inputs": [{"name": "x"}]}', b"[1, 2]"):
        with pytest.raises(BadRequest):
            parse(bytearray(bad), None, CAP)
    with pytest.raises(BadRequest):  # binary_data_size without the header that says where the JSON ends
        parse(bytearray(_request(0)), None, CAP)
    for raw in (struct.pack("<I", 10) + b"short", b"\x01\x00"):
        with pytest.raises(BadRequest):
            split_elements(bytearray(raw), 0, len(raw), "IMAGE")
    with pytest.raises(TooLarge):
        parse(bytearray(b" " * 2048 + _request(0)), None, 1024)


def test_the_answer_written_as_plain_data_is_the_protocols_document() -> None:
    """infer.py writes the answer without pydantic (for speed); it must be the model's document."""
    from app.api.oip.catalog import ModelInfo, ModelRef
    from app.api.oip.infer import Inference, _Reply
    from app.api.oip.protocol import InferenceResponse
    from app.api.oip.stats import InferenceStats

    header = json.dumps({"id": "r1", "inputs": [{"name": "IMAGE", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
                         "outputs": [{"name": "OUTPUT__0", "parameters": {"binary_data": True}},
                                     {"name": "OUTPUT__0", "parameters": {"classification": 2}}]}).encode()
    body = parse(bytearray(header), None, CAP)
    inference = Inference(None, None, InferenceStats(), max_items=4, max_image_bytes=CAP, max_pixels=CAP,  # type: ignore[arg-type]
                          max_body_bytes=CAP, max_json_bytes=CAP)
    ref = ModelRef("pets", ("j1", "j2"), "2", ModelInfo("j2", "cifar_net", ("a", "b", "c"), (3, 32, 32), True), "pets")
    reply = _Reply("j1", "cpu0", ["a", "b", "c"], [[0.2, 0.5, 0.3]])
    raw, length = inference._response(body, ref, reply, inference._outputs(body))
    assert length is not None
    document = json.loads(raw[:length])
    assert InferenceResponse.model_validate(document).model_dump(exclude_none=True) == document
    assert document["model_version"] == "1" and document["id"] == "r1"  # the job that answered: version 1
    assert document["outputs"][0]["parameters"] == {"binary_data_size": 12}
    assert struct.unpack("<3f", raw[length:]) == pytest.approx((0.2, 0.5, 0.3))
    assert document["outputs"][1] == {"name": "OUTPUT__0", "shape": [1, 2], "datatype": "BYTES",
                                      "data": ["0.500000:1:b", "0.300000:2:c"]}
