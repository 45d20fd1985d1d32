"""The OpenAPI document a client writer reads (`GET /openapi.json`) against docs/api.md's table of
statuses by operation: every operation has a description, every status the page promises is in the
schema with what it means, and the 404s it promises are what the API answers for an unknown id."""

from __future__ import annotations

import re

import pytest

from tests.support import REPO

pytestmark = pytest.mark.e2e

_ROW = re.compile(r"^\| `(GET|POST|PUT|DELETE) (\S+)` \| ([\d, ]+) \|$")


def _promised() -> dict[tuple[str, str], set[str]]:
    text = (REPO / "docs" / "api.md").read_text()
    table = text[text.index("## Statuses by operation"):]
    rows = [_ROW.match(line) for line in table.splitlines()]
    return {(m[1], m[2]): {s.strip() for s in m[3].split(",")} for m in rows if m}


def test_every_operation_is_described_with_the_statuses_the_docs_promise(stack: dict) -> None:
    client = stack["client"]
    schema = client.get("/openapi.json").json()
    operations = {(method.upper(), path): op for path, ops in schema["paths"].items() for method, op in ops.items()}
    promised = _promised()
    assert set(promised) == set(operations), set(promised) ^ set(operations)  # the table names every operation
    for key, op in operations.items():
        assert op.get("description"), f"{key}: no description"
        documented = set(op.get("responses", {}))
        assert promised[key] <= documented, (key, promised[key] - documented)
        for status in promised[key]:
            assert op["responses"][status].get("description"), (key, status)

    # The 404s promised for an unknown id are what the API answers, with a detail that says so.
    for (method, path), statuses in promised.items():
        if "404" not in statuses or "{" not in path:
            continue
        concrete = re.sub(r"\{[^}]+\}", "nosuch", path)
        params = {"format": "onnx"} if path.endswith("/export") else None
        answer = client.request(method, concrete, params=params, json={} if method in ("POST", "PUT") else None)
        if method in ("POST", "PUT") and answer.status_code == 422:
            continue  # the body is checked first; an empty one is refused before the id is looked up
        assert answer.status_code == 404 and answer.json()["detail"], (method, concrete, answer.status_code, answer.text)
