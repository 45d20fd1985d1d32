"""The /predict wire protocol (core/wire.py): what the worker writes is what the API's clients read."""

from __future__ import annotations

import json

from core.schemas import ImagePredictions, Prediction, PredictResponse
from core.wire import PredictReply

CLASSES = ["cat", "dog", 'quote " and unicode é', "bird"]


def test_fast_predictions_body_is_the_pydantic_response_byte_for_byte() -> None:
    images = [("a.png", [2, 0, 3], [0.7, 0.2, 1e-05]), (None, [1], [0.999999])]
    reply = PredictReply.predictions("job-1", "resnet18", "cuda:0", CLASSES, images)
    expected = PredictResponse(job_id="job-1", model="resnet18", device="cuda:0", results=[
        ImagePredictions(filename=f, predictions=[Prediction(label=CLASSES[i], index=i, probability=p)
                                                  for i, p in zip(ix, ps, strict=True)])
        for f, ix, ps in images])
    assert reply.status == 200
    assert PredictResponse.model_validate_json(reply.body) == expected
    assert reply.body == expected.model_dump_json()


def test_non_finite_probabilities_become_null_not_invalid_json() -> None:
    # The second file name holds a lone surrogate (a name that was not UTF-8), which orjson refuses:
    # the same document then goes through json, with the same nulls.
    for filename in ("x.png", "x-\udcff.png"):
        reply = PredictReply.predictions("j", "m", "cpu", CLASSES, [(filename, [0, 1], [float("nan"), float("inf")])])
        document = json.loads(reply.body)  # strict JSON: NaN would not parse in most clients
        assert document["results"][0]["filename"] == filename
        assert [p["probability"] for p in document["results"][0]["predictions"]] == [None, None]
        assert "NaN" not in reply.body and "Infinity" not in reply.body


def test_addressed_reply_round_trip() -> None:
    reply = PredictReply.predictions("j", "m", "cpu", CLASSES, [("x.png", [3], [1.0])])
    request_id, decoded = PredictReply.decode_addressed(reply.encode_to("abc123"))
    assert request_id == "abc123" and decoded.status == 200 and decoded.body == reply.body


def test_the_header_the_api_writes_is_the_models_json_byte_for_byte() -> None:
    """`encode_header` (the API's way to write a PredictHeader without building it) takes exactly the
    model's fields, typed alike, and writes what the model would, which the worker validates back."""
    import inspect
    import typing

    from core.wire import PredictHeader, PredictRequest, encode_header

    parameters = inspect.signature(encode_header).parameters
    assert list(parameters) == list(PredictHeader.model_fields)
    hints = typing.get_type_hints(encode_header)
    for name, field in PredictHeader.model_fields.items():
        assert hints[name] == field.annotation, name
        if not field.is_required():
            assert parameters[name].default == field.default, name
    cases = [{"job_id": "j-1", "alias": None, "top_k": 5, "reply_to": "ty:inbox", "request_id": "ab12", "queued_at": 1764300000.123456,
                  "deadline": 1764300030.5, "images": [("x.png", 0, 3)]},
             {"job_id": "j-2", "alias": "pets", "top_k": 1, "reply_to": "ty:inbox", "request_id": "cd34", "queued_at": 1.0, "deadline": 2.0,
                  "images": [(None, 0, 1), ("é €.jpg", 1, 2)], "encoding": "fp32", "shape": (3, 32, 32), "reply": "probabilities"}]
    for fields in cases:
        model = PredictHeader(**fields)
        assert encode_header(**fields) == model.model_dump_json().encode()
        message = bytes(PredictRequest.frame_in_place(bytearray(b"abc"), encode_header(**fields)))
        assert PredictRequest.decode(message).header == model
