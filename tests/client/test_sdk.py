"""The Python client's own logic: SSE framing, resuming a dropped stream, error mapping, zipping a
directory, checksum verification. The HTTP server is httpx's MockTransport here; the client
against the real stack is covered by tests/e2e/test_cli.py."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import httpx
import pytest

from client.sdk import ApiError, TorchyardClient, zip_directory

NOW = "2026-01-01T00:00:00Z"


def job_doc(job_id: str = "j1", status: str = "running") -> dict:
    return {"id": job_id, "status": status, "model": "cifar_net", "dataset": "fake", "params": {"epochs": 2},
            "created_at": NOW}


def client_for(handler) -> TorchyardClient:
    return TorchyardClient("http://torchyard.test", api_key="k", transport=httpx.MockTransport(handler))


def test_sse_framing() -> None:
    """retry lines and comments are skipped, multi-line data is joined, the last id carries over,
    and data that is not JSON is still delivered."""
    text = ("retry: 2000\n\n: keepalive\n\nid: 1-0\nevent: status\ndata: {\"status\": \"queued\"}\n\n"
            "id: 2-0\nevent: progress\ndata: {\"epoch\": 1,\ndata:  \"step\": 3}\n\n"
            "event: note\ndata: not json\n\nid: 3-0\nevent: status\ndata: {\"status\": \"failed\"}\n\n")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream; charset=utf-8"})

    with client_for(handler) as client:
        events = list(client.events("j1", reconnect=False))
    assert [(e.id, e.kind) for e in events] == [("1-0", "status"), ("2-0", "progress"), ("2-0", "note"),
                                                ("3-0", "status")]
    assert events[1].data == {"epoch": 1, "step": 3}
    assert events[2].data == {"raw": "not json"}
    assert not events[0].terminal and events[3].terminal


def test_events_resume_with_last_event_id_until_terminal() -> None:
    calls: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer k"
        if request.url.path == "/jobs/j1":
            return httpx.Response(200, json=job_doc())
        calls.append(request.headers.get("last-event-id"))
        if len(calls) == 1:  # the stream drops after two events, before the end
            body = 'id: 1-0\nevent: status\ndata: {"status": "running"}\n\nid: 2-0\nevent: metrics\ndata: {"epoch": 1}\n\n'
        else:
            body = 'id: 3-0\nevent: status\ndata: {"status": "succeeded"}\n\nid: 4-0\nevent: late\ndata: {}\n\n'
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    with client_for(handler) as client:
        events = list(client.events("j1"))
    assert [e.kind for e in events] == ["status", "metrics", "status"]  # stops at the terminal status
    assert events[-1].terminal
    assert calls == [None, "2-0"]


def test_errors_carry_the_api_detail() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/jobs/missing":
            return httpx.Response(404, json={"detail": "job missing not found"})
        return httpx.Response(502, text="bad gateway")

    with client_for(handler) as client:
        with pytest.raises(ApiError) as caught:
            client.job("missing")
        assert caught.value.status == 404 and caught.value.detail == "job missing not found"
        with pytest.raises(ApiError) as caught:
            client.devices()
        assert caught.value.status == 502 and caught.value.detail == "bad gateway"

    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with client_for(unreachable) as client, pytest.raises(ApiError) as caught:
        client.jobs()
    assert caught.value.status is None and "cannot reach torchyard at http://torchyard.test" in str(caught.value)


def test_submit_sends_only_what_was_given() -> None:
    seen: dict = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content), key=request.headers.get("idempotency-key"))
        return httpx.Response(202, json=job_doc(status="queued"))

    with client_for(handler) as client:
        job = client.submit(model="cifar_net", dataset="fake", epochs=3, batch_size=None, idempotency_key="once")
    assert job.status.value == "queued"
    assert seen == {"model": "cifar_net", "dataset": "fake", "epochs": 3, "key": "once"}


def test_directory_upload_is_zipped_in_imagefolder_layout(tmp_path: Path) -> None:
    for name in ("cats/a.png", "cats/b.png", "dogs/c.png", ".hidden/x.png", "dogs/.DS_Store"):
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / name).write_bytes(b"img")
    buffer = io.BytesIO()
    assert zip_directory(tmp_path / "data", buffer) == 3
    assert sorted(zipfile.ZipFile(buffer).namelist()) == ["cats/a.png", "cats/b.png", "dogs/c.png"]

    uploaded: dict = {}

    def handler(request: httpx.Request) -> httpx.Response:
        body = request.read()
        uploaded["zip"] = body[body.index(b"PK\x03\x04"):]
        uploaded["type"] = request.headers["content-type"]
        return httpx.Response(201, json={"id": "ds1", "name": "pets", "classes": ["cats", "dogs"]})

    with client_for(handler) as client:
        assert client.upload_dataset(tmp_path / "data", name="pets")["id"] == "ds1"
        with pytest.raises(ApiError, match="no such file"):
            client.upload_dataset(tmp_path / "nope")
    assert uploaded["type"].startswith("multipart/form-data")
    assert b"cats/a.png" in uploaded["zip"] and b"dogs/c.png" in uploaded["zip"]


def test_checkpoint_download_checks_the_sha256(tmp_path: Path) -> None:
    weights = b"weights" * 1000
    good = hashlib.sha256(weights).hexdigest()
    claimed = {"sha": good}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=weights, headers={"X-Checkpoint-SHA256": claimed["sha"]})

    with client_for(handler) as client:
        path, digest = client.download_checkpoint("j1", tmp_path / "a" / "model.pt")
        assert digest == good and path.read_bytes() == weights
        claimed["sha"] = "0" * 64
        with pytest.raises(ApiError, match="sha256 mismatch"):
            client.download_checkpoint("j1", tmp_path / "b.pt")
    assert not (tmp_path / "b.pt").exists() and not (tmp_path / "b.pt.part").exists()


def test_the_cli_parser_stays_light() -> None:
    """A worker builds the same parser before it pins its GPU: no torch, no httpx at that point."""
    import subprocess
    import sys

    code = ("import sys, app.cli; app.cli.build_parser().parse_args(['predict', '--job', 'j', 'x.png']); "
            "print(sorted({'torch', 'httpx', 'client.sdk'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
