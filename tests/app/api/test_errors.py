"""The one mapping from errors to HTTP (app/api/errors.py): our errors keep their status and detail
(with WWW-Authenticate on a 401 and Retry-After where one is known), Redis away is a 503 to retry,
a bug is a JSON 500 and nothing else; validation errors name the field the user wrote."""

from __future__ import annotations

import json

import kombu.exceptions
import pytest
import redis
from starlette.exceptions import HTTPException

from app.api.errors import known_error_response, unexpected_error_response, user_location, user_message
from core.errors import InvalidInput, NotFound, TooLarge, Unauthorized, Unavailable


def _body(response) -> dict:
    return json.loads(response.body)


@pytest.mark.parametrize(("error", "status", "headers"), [
    (NotFound("job x not found"), 404, {}),
    (TooLarge("too big"), 413, {}),
    (InvalidInput("bad"), 422, {}),
    (Unauthorized("no key"), 401, {"www-authenticate": "Bearer"}),
    (Unavailable("busy", retry_after_s=3), 503, {"retry-after": "3"}),
    (Unavailable("no worker"), 503, {}),
])
def test_our_errors_keep_their_status_and_detail(error, status: int, headers: dict[str, str]) -> None:
    response = known_error_response(error)
    assert response is not None and response.status_code == status
    assert _body(response) == {"detail": error.detail}
    assert {k: v for k, v in response.headers.items() if k in ("www-authenticate", "retry-after")} == headers


@pytest.mark.parametrize("error", [redis.ConnectionError("Connection refused"), redis.TimeoutError("timed out"),
                                   kombu.exceptions.OperationalError("broker away")])
def test_redis_away_is_a_503_to_retry(error: Exception) -> None:
    response = known_error_response(error)
    assert response is not None and response.status_code == 503 and response.headers["retry-after"] == "2"
    assert _body(response)["detail"].startswith("Redis is unavailable, retry shortly")


def test_starlettes_own_errors_pass_through_and_a_bug_is_a_json_500() -> None:
    response = known_error_response(HTTPException(405, "Method Not Allowed"))
    assert response is not None and (response.status_code, _body(response)) == (405, {"detail": "Method Not Allowed"})
    assert known_error_response(KeyError("x")) is None  # not ours to name: a bug
    bug = unexpected_error_response(KeyError("x"), "GET", "/jobs", log_trace=False)
    assert bug.status_code == 500 and _body(bug) == {"detail": "internal error (KeyError); see the API log"}


def test_a_validation_error_names_the_field_as_the_user_wrote_it() -> None:
    assert user_location(["body", "train", "epochs"]) == ["epochs"]  # the kind's tag is not a field of theirs
    assert user_location(["query", "limit"]) == ["limit"]
    assert user_location(["body", "params", "lr"]) == ["params", "lr"]
    assert user_message({"type": "missing", "loc": ["body", "train", "model"], "msg": "Field required"}) \
        == "model is required"
    assert user_message({"type": "extra_forbidden", "loc": ["body", "train", "epoch"], "msg": "x"}).startswith(
        "unknown field 'epoch'")
    assert user_message({"type": "value_error", "loc": ["body", "train", "epochs"],
                         "msg": "Value error, must be at least 1"}) == "epochs: must be at least 1"
    assert user_message({"type": "union_tag_invalid", "loc": ["body"], "msg": "x", "ctx": {"tag": "evaluate"}}) \
        .startswith("kind 'evaluate' is not a kind of job POST /jobs creates")
    assert user_message({"type": "model_attributes_type", "loc": ["body"], "msg": "x"}) == "the body must be a JSON object"
