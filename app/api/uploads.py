"""POST /datasets' body, streamed: the zip goes straight into one file under the data dir as it
arrives, with the byte cap enforced while it streams.

Why not FastAPI's `UploadFile`: Starlette spools each file part into a SpooledTemporaryFile (in
/tmp, possibly another disk, and in memory up to 1 MiB), the route then copied it again, and
none of it starts before the whole body has been received. Here python-multipart's streaming
parser (what Starlette uses underneath) hands over the part's bytes chunk by chunk; they are
gathered into 1 MiB writes done in the thread pool (a disk write never stalls the event loop),
and the memory a request holds is that buffer, whatever the upload's size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from core.errors import InvalidInput, TooLarge

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

WRITE_CHUNK = 1024 * 1024
MAX_FIELD_BYTES = 4096  # a text field (`name`); the file is the only large part
MAX_PART_HEADER_BYTES = 16 * 1024
MAX_PARTS = 16


@dataclass
class StreamedUpload:
    """What the body held: its one file part, already on disk at `path`, and its text fields."""

    path: Path
    filename: str | None
    bytes: int
    fields: dict[str, str] = field(default_factory=dict)


class _Reader:
    """python-multipart's callbacks: text fields into memory (small, capped), the one file part
    into `buffer`, which the caller flushes to disk between chunks."""

    def __init__(self, file_field: str, max_file_bytes: int) -> None:
        self.file_field = file_field
        self.max_file_bytes = max_file_bytes
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_bytes = 0
        self.file_seen = False
        self.buffer = bytearray()
        self.parts = 0
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._disposition = b""
        self._header_bytes = 0
        self._name: str | None = None
        self._is_file = False
        self._field = bytearray()

    def callbacks(self) -> MultipartCallbacks:
        return {"on_part_begin": self.on_part_begin, "on_part_data": self.on_part_data,
                "on_part_end": self.on_part_end, "on_header_field": self.on_header_field,
                "on_header_value": self.on_header_value, "on_header_end": self.on_header_end,
                "on_headers_finished": self.on_headers_finished}

    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise InvalidInput(f"the form has more than {MAX_PARTS} parts; send `file` and an optional `name`")
        self._disposition, self._header_bytes, self._name, self._is_file = b"", 0, None, False
        self._field.clear()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self._header_value += data[start:end]

    def _count_header(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_PART_HEADER_BYTES:
            raise InvalidInput(f"a multipart part's headers are over {MAX_PART_HEADER_BYTES} bytes")

    def on_header_end(self) -> None:
        if bytes(self._header_name).strip().lower() == b"content-disposition":
            self._disposition = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise InvalidInput("a multipart part has no name (Content-Disposition: form-data; name=...)")
        self._name = options[b"name"].decode("utf-8", errors="replace")
        if self._name == self.file_field:
            if self.file_seen:
                raise InvalidInput(f"send one `{self.file_field}` part, not several")
            self.file_seen = self._is_file = True
            raw = options.get(b"filename")
            self.filename = raw.decode("utf-8", errors="replace") if raw is not None else None

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self.file_bytes += end - start
            if self.file_bytes > self.max_file_bytes:
                raise TooLarge(f"the upload is over {self.max_file_bytes} bytes; the limit is {self.max_file_bytes} "
                               f"(TORCHYARD_MAX_UPLOAD_BYTES)")
            self.buffer += data[start:end]
        else:
            if len(self._field) + end - start > MAX_FIELD_BYTES:
                raise InvalidInput(f"form field {self._name!r} is over {MAX_FIELD_BYTES} bytes")
            self._field += data[start:end]

    def on_part_end(self) -> None:
        if not self._is_file and self._name is not None:
            self.fields[self._name] = self._field.decode("utf-8", errors="replace")


async def stream_upload(request: Request, dest: Path, *, max_file_bytes: int, file_field: str = "file") -> StreamedUpload:
    """Stream the multipart body of `request`: its `file_field` part into `dest` (created, never
    overwritten), its text fields into memory. The caller removes `dest` when it is done with it,
    whatever happened (on an error here it is removed already)."""
    _, params = parse_options_header(request.headers.get("content-type"))
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidInput("send multipart/form-data with a boundary: a `file` part (the zip) and an optional `name`")
    reader = _Reader(file_field, max_file_bytes)
    parser = MultipartParser(boundary, reader.callbacks())
    out: BinaryIO = open(dest, "xb")  # noqa: SIM115 - closed below, on every path
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            if len(reader.buffer) >= WRITE_CHUNK:
                data, reader.buffer = reader.buffer, bytearray()
                await run_in_threadpool(out.write, data)
        parser.finalize()
        if parser.state != MultipartState.END:  # a body that stops without its closing boundary
            raise InvalidInput("malformed multipart body: it ends before its closing boundary")
        if reader.buffer:
            await run_in_threadpool(out.write, reader.buffer)
        await run_in_threadpool(out.close)
    except FormParserError as exc:
        out.close()
        dest.unlink(missing_ok=True)
        raise InvalidInput(f"malformed multipart body ({type(exc).__name__})") from None
    except ClientDisconnect:
        out.close()
        dest.unlink(missing_ok=True)
        raise InvalidInput("the client went away before the upload was complete") from None
    except BaseException:
        out.close()
        dest.unlink(missing_ok=True)
        raise
    if not reader.file_seen:
        dest.unlink(missing_ok=True)
        raise InvalidInput(f"{file_field}: send the dataset zip as a `{file_field}` part")
    return StreamedUpload(dest, reader.filename, reader.file_bytes, reader.fields)
