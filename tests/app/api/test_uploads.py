"""POST /datasets' body reader (app/api/uploads.py): the zip part streamed into its file whatever the
chunking, the text fields beside it; a body over the cap, without its file, cut short or malformed
is refused with what is wrong, and leaves no file behind."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from app.api.uploads import MAX_FIELD_BYTES, MAX_PARTS, WRITE_CHUNK, stream_upload
from core.errors import InvalidInput, TooLarge
from tests.app.api.serving.support import form_request

MiB = 1024 * 1024


def _upload(tmp_path: Path, files: list, fields: dict[str, str], *, chunk: int | None = None,
            max_file_bytes: int = 8 * MiB):
    dest = tmp_path / "upload.zip"
    return dest, asyncio.run(stream_upload(form_request(files, fields, chunk), dest, max_file_bytes=max_file_bytes))


@pytest.mark.parametrize("chunk", [None, 1000, 64 * 1024])
def test_the_file_part_reaches_its_file_whatever_the_chunking(tmp_path: Path, chunk: int | None) -> None:
    data = os.urandom(2 * WRITE_CHUNK + 12345)  # more than one write to the disk
    dest, upload = _upload(tmp_path, [("file", ("pets.zip", data, "application/zip"))], {"name": "pets"}, chunk=chunk)
    assert dest.read_bytes() == data
    assert (upload.path, upload.filename, upload.bytes, upload.fields) == (dest, "pets.zip", len(data), {"name": "pets"})


def test_an_upload_over_the_cap_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(TooLarge, match="TORCHYARD_MAX_UPLOAD_BYTES"):
        _upload(tmp_path, [("file", ("big.zip", bytes(2 * MiB), "application/zip"))], {}, chunk=64 * 1024,
                max_file_bytes=MiB)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("files", "fields", "message"), [
    ([("readme", ("readme.txt", b"hello", "text/plain"))], {"name": "pets"}, "send the dataset zip as a `file` part"),
    ([("file", ("a.zip", b"x", "application/zip")), ("file", ("b.zip", b"y", "application/zip"))], {}, "one `file` part"),
    ([("file", ("a.zip", b"x", "application/zip"))], {"name": "n" * (MAX_FIELD_BYTES + 1)}, "over 4096 bytes"),
    ([("file", ("a.zip", b"x", "application/zip"))], {f"f{i}": "1" for i in range(MAX_PARTS)}, "more than 16 parts"),
])
def test_a_form_without_one_file_or_with_too_much_else_is_refused(tmp_path: Path, files: list, fields: dict,
                                                                  message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        _upload(tmp_path, files, fields)
    assert list(tmp_path.iterdir()) == []


def test_a_body_cut_short_or_without_a_boundary_is_refused(tmp_path: Path) -> None:
    request = form_request([("file", ("a.zip", b"x" * 1000, "application/zip"))], {}, chunk=100)
    request._receive = _cut_after(request._receive, 3)  # the client stops sending after 300 bytes
    with pytest.raises(InvalidInput, match="ends before its closing boundary"):
        asyncio.run(stream_upload(request, tmp_path / "upload.zip", max_file_bytes=MiB))
    no_boundary = form_request([("file", ("a.zip", b"x", "application/zip"))], {})
    no_boundary.scope["headers"] = [(b"content-type", b"multipart/form-data")]
    with pytest.raises(InvalidInput, match="with a boundary"):
        asyncio.run(stream_upload(no_boundary, tmp_path / "other.zip", max_file_bytes=MiB))
    assert list(tmp_path.iterdir()) == []


def test_an_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    dest = tmp_path / "upload.zip"
    dest.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        asyncio.run(stream_upload(form_request([("file", ("a.zip", b"x", "application/zip"))], {}), dest,
                                  max_file_bytes=MiB))
    assert dest.read_bytes() == b"someone else's"


def _cut_after(receive, messages: int):
    """The body's first `messages` chunks, then its end: a client that stopped sending."""
    sent = 0

    async def cut() -> dict:
        nonlocal sent
        sent += 1
        message = await receive()
        return {**message, "more_body": False} if sent >= messages else message

    return cut


def test_an_upload_of_exactly_the_cap_is_taken_and_one_byte_more_is_refused(tmp_path: Path) -> None:
    for chunk in (None, 1000):
        try:
            dest, upload = _upload(tmp_path, [("file", ("edge.zip", bytes(MiB), "application/zip"))], {}, chunk=chunk,
                                   max_file_bytes=MiB)
        except TooLarge as exc:
            raise AssertionError(f"an upload of exactly TORCHYARD_MAX_UPLOAD_BYTES ({MiB}) was refused: {exc}") from None
        assert upload.bytes == MiB and dest.stat().st_size == MiB
        dest.unlink()
        try:
            _upload(tmp_path, [("file", ("edge.zip", bytes(MiB + 1), "application/zip"))], {}, chunk=chunk,
                    max_file_bytes=MiB)
        except TooLarge as exc:
            assert "TORCHYARD_MAX_UPLOAD_BYTES" in exc.detail
        else:
            raise AssertionError("an upload one byte over TORCHYARD_MAX_UPLOAD_BYTES was taken")
        assert list(tmp_path.iterdir()) == []
