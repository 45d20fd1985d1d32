"""The intake's reader of the /predict body: multipart/form-data read as it streams, into the one
buffer that is sent on.

Why not FastAPI's `UploadFile` and `Form` parameters: Starlette's parser spools every file to a
SpooledTemporaryFile and parses headers in Python callbacks, a large share of the API's CPU per
prediction (docs/benchmarks.md). Why not read the whole body and split it: the images would be
held twice (the body, then each part), and a request's limits would be checked only once all of
it had arrived. Here each chunk is appended to one `bytearray`, which becomes the message the
worker receives (core/wire.PredictRequest frames it in place), and the parts are found as they
complete: an image over its byte limit, one image too many, or a file that is not an image is
refused while the rest of the body is still on its way. Anything malformed is a 422.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.requests import Request

from core.errors import InvalidInput, TooLarge

_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)
_NAME = re.compile(rb'(?:^|;)\s*name="((?:[^"\\]|\\.)*)"|(?:^|;)\s*name=([^;\s"]+)', re.IGNORECASE)
_FILENAME = re.compile(rb'(?:^|;)\s*filename="((?:[^"\\]|\\.)*)"|(?:^|;)\s*filename=([^;\s"]+)', re.IGNORECASE)

IMAGE_FIELD = "file"
MAX_FIELD_BYTES = 4096  # job_id, alias, top_k: a few characters each
MAX_PART_HEADER_BYTES = 16 * 1024
MAX_FIELDS = 8
NO_IMAGE = f"send at least one image as a `{IMAGE_FIELD}` part of a multipart/form-data body"


@dataclass(frozen=True)
class FormLimits:
    max_images: int
    max_image_bytes: int
    max_body_bytes: int  # the whole body: what one message to the worker may carry


@dataclass
class PredictForm:
    """A /predict body: its text fields, and its images as (filename, offset, length) in `buffer`,
    the body as it arrived."""

    buffer: bytearray
    fields: dict[str, str] = field(default_factory=dict)
    images: list[tuple[str | None, int, int]] = field(default_factory=list)


class _Parser:
    """The body's parts, found as the bytes arrive: PREAMBLE (to the first boundary), then for each
    part its HEADERS and its CONTENT (to the next boundary), until the closing boundary (END)."""

    def __init__(self, boundary: bytes, limits: FormLimits, check_image: Callable[[str | None, memoryview], None]) -> None:
        self.opening = b"--" + boundary
        self.delimiter = b"\r\n--" + boundary  # the line break before a boundary belongs to it
        self.limits = limits
        self.check_image = check_image
        self.form = PredictForm(bytearray())
        self.state = "preamble"
        self.at = 0  # where the current state's bytes begin in the buffer
        self.scanned = 0  # a part's content holds no delimiter before this
        self.name = ""
        self.filename: str | None = None

    def feed(self, chunk: bytes) -> None:
        buffer = self.form.buffer
        buffer += chunk
        while True:
            if self.state == "preamble":  # a preamble before the first boundary is allowed, and ignored
                found = buffer.find(self.opening)
                if found < 0 or (found > 0 and buffer[found - 2:found] != b"\r\n"):
                    if len(buffer) > MAX_PART_HEADER_BYTES:
                        raise InvalidInput("malformed multipart body: no opening boundary")
                    return
                if not self._after_boundary(found + len(self.opening)):
                    return
            elif self.state == "headers":
                end = buffer.find(b"\r\n\r\n", self.at)
                if end < 0:
                    if len(buffer) - self.at > MAX_PART_HEADER_BYTES:
                        raise InvalidInput(f"a multipart part's headers exceed {MAX_PART_HEADER_BYTES} bytes")
                    return
                self._start_part(bytes(buffer[self.at:end]))
                self.at, self.state = end + 4, "content"
            elif self.state == "content":
                end = buffer.find(self.delimiter, max(self.at, self.scanned))
                if end < 0:  # a delimiter split between two chunks is found from here next time
                    self.scanned = len(buffer) - len(self.delimiter) + 1
                    self._check_growing(len(buffer) - self.at - len(self.delimiter))
                    return
                self._end_part(end)
                if not self._after_boundary(end + len(self.delimiter)):
                    self.at, self.state = end + len(self.delimiter), "boundary"
                    return
            elif self.state == "boundary":
                if not self._after_boundary(self.at):
                    return
            else:  # "end": the epilogue is ignored (the body's cap still bounds it)
                return

    def _after_boundary(self, at: int) -> bool:
        """After a boundary: `--` closes the body, a line break opens the next part. False: the two
        bytes that tell have not arrived yet."""
        buffer = self.form.buffer
        if len(buffer) < at + 2:
            self.at, self.state = at, "boundary"
            return False
        follows = bytes(buffer[at:at + 2])
        if follows == b"--":
            self.state = "end"
        elif follows == b"\r\n":
            self.at, self.state = at + 2, "headers"
        else:
            raise InvalidInput("malformed multipart body: a boundary is not followed by a line break")
        return True

    def _start_part(self, headers: bytes) -> None:
        disposition = _disposition(headers)
        name = _param(_NAME, disposition)
        if not name:
            raise InvalidInput("a multipart part has no name")
        self.name, self.filename = name, _param(_FILENAME, disposition)
        if self.name != IMAGE_FIELD:
            if self.filename is not None:
                raise InvalidInput(f"unexpected file part {self.name!r}: images go in `{IMAGE_FIELD}` parts")
            if len(self.form.fields) >= MAX_FIELDS:
                raise InvalidInput(f"more than {MAX_FIELDS} form fields")
        elif len(self.form.images) >= self.limits.max_images:
            raise TooLarge(f"more than {self.limits.max_images} images in one request; the limit is "
                           f"{self.limits.max_images} (TORCHYARD_MAX_IMAGES_PER_REQUEST)")

    def _check_growing(self, size: int) -> None:
        """The current part, still arriving, is already over its limit."""
        if self.name == IMAGE_FIELD and size > self.limits.max_image_bytes:
            raise TooLarge(f"{self.filename or 'image'} is over the limit of {self.limits.max_image_bytes} bytes "
                           f"(TORCHYARD_MAX_IMAGE_BYTES)")
        if self.name != IMAGE_FIELD and size > MAX_FIELD_BYTES:
            raise InvalidInput(f"form field {self.name} is over {MAX_FIELD_BYTES} bytes")

    def _end_part(self, end: int) -> None:
        self._check_growing(end - self.at)
        if self.name == IMAGE_FIELD:
            view = memoryview(self.form.buffer)[self.at:end]
            try:
                self.check_image(self.filename, view)
            finally:
                view.release()  # the buffer grows with the next chunk: no view of it may outlive this
            self.form.images.append((self.filename or None, self.at, end - self.at))
            return
        try:
            self.form.fields[self.name] = self.form.buffer[self.at:end].decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput(f"form field {self.name} is not UTF-8 text") from None


def boundary_of(content_type: str) -> bytes:
    match = _BOUNDARY.search(content_type)
    if not content_type.lower().startswith("multipart/form-data") or match is None:
        raise InvalidInput(f"send multipart/form-data: one or more `{IMAGE_FIELD}` parts and a `job_id` field")
    return (match.group(1) or match.group(2)).encode("latin-1", errors="replace")


async def read_predict_form(request: Request, limits: FormLimits,
                            check_image: Callable[[str | None, memoryview], None],
                            on_bytes: Callable[[int], None] = lambda n: None) -> PredictForm:
    """The body's fields and images, checked as they stream in. `check_image(filename, bytes)` runs
    on each image as soon as its part is complete (raise to refuse the request); `on_bytes(n)` on
    every chunk (the API's memory admission may refuse it)."""
    parser = _Parser(boundary_of(request.headers.get("content-type", "")), limits, check_image)
    received = 0
    async for chunk in request.stream():
        if not chunk:
            continue
        received += len(chunk)
        if received > limits.max_body_bytes:
            raise TooLarge(f"the request is over the limit of {limits.max_body_bytes} bytes "
                           f"(TORCHYARD_MAX_PREDICT_REQUEST_BYTES)")
        on_bytes(len(chunk))
        parser.feed(chunk)
    if received == 0:
        raise InvalidInput(f"the body is empty: {NO_IMAGE}")
    if parser.state != "end":
        raise InvalidInput("malformed multipart body: it ends before its closing boundary")
    return parser.form


def _disposition(headers: bytes) -> bytes:
    for line in headers.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-disposition":
            return value
    raise InvalidInput("a multipart part has no Content-Disposition header")


def _param(pattern: re.Pattern[bytes], disposition: bytes) -> str | None:
    match = pattern.search(disposition)
    if match is None:
        return None
    raw = match.group(1) if match.group(1) is not None else match.group(2)
    return raw.replace(b'\\"', b'"').decode("utf-8", errors="replace")
