"""The intake stage: a /predict body → a checked `PredictCall`, its bytes held against the budget.

The request is checked once, as its body streams in: its bytes are reserved against the process's
memory budget as they arrive (app/api/serving/budget.py), the multipart body is read into the one
buffer that becomes the message (app/api/serving/multipart.py), each image's header is checked the
moment its part is complete (`check_image`: an allowed format, under the pixel limit; the full
decode is the worker's decode stage, worker/serving/decode.py), and the fields become a
`PredictCall`. So a request that is too large or not an image is refused (413, 415, 422) while the
rest of its body is still on its way, and nothing of it reaches Redis.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image
from starlette.requests import Request

from app.api.serving.budget import BodyBudget, Reservation
from app.api.serving.multipart import NO_IMAGE, FormLimits, PredictForm, read_predict_form
from core.aliases import validate_alias_name
from core.config import Settings
from core.defaults import MAX_TOP_K, TOP_K
from core.errors import InvalidInput, TooLarge, UnsupportedMedia
from core.image_headers import is_jpeg, read_header, read_png_header
from core.images import IMAGE_FORMATS, IMAGE_FORMATS_TEXT, OPENED_FORMATS, ViewReader
from core.storage import validate_id
from core.wire import Encoding, ReplyKind


@dataclass(frozen=True)
class PredictCall:
    """A /predict request, checked: exactly one of job_id and alias, top_k, at least one image."""

    job_id: str | None
    alias: str | None
    top_k: int
    form: PredictForm
    # What the form's items are and what the answer holds (core/wire.py): /predict's are the
    # defaults; the Open Inference Protocol (app/api/oip/) sends preprocessed rows or wants every probability.
    encoding: Encoding = "image"
    shape: tuple[int, int, int] | None = None
    reply: ReplyKind = "top_k"

    @classmethod
    def from_form(cls, form: PredictForm) -> PredictCall:
        job_id, alias = form.fields.get("job_id") or None, form.fields.get("alias") or None
        if (job_id is None) == (alias is None):
            raise InvalidInput("send exactly one of the form fields job_id and alias")
        if alias is not None:
            validate_alias_name(alias)
        else:
            validate_id(job_id or "", "job_id")
        try:
            top_k = int(form.fields.get("top_k", str(TOP_K)))
        except ValueError:
            raise InvalidInput(f"top_k: must be an integer between 1 and {MAX_TOP_K}") from None
        if not 1 <= top_k <= MAX_TOP_K:
            raise InvalidInput(f"top_k: must be an integer between 1 and {MAX_TOP_K}")
        if not form.images:
            raise InvalidInput(f"file: {NO_IMAGE}")
        return cls(job_id, alias, top_k, form)


def check_image(filename: str | None, data: bytes | memoryview, max_pixels: int) -> None:
    """Cheap gatekeeping from the header alone (the worker does the full decode): an allowed format,
    at most `max_pixels`. Reads the bytes in place: a 10 MiB image is not copied to be looked at.
    A baseline or progressive 8-bit JPEG and a PNG are read by core/image_headers.py (a few
    microseconds, where Pillow's `Image.open` took tens: most of /predict's images); any other file,
    and any such file those readers do not take, is opened by Pillow as before."""
    name = filename or "image"
    size = _header_size(data)
    if size is not None:
        if size > max_pixels:
            raise TooLarge(f"{name} has {size} pixels; the limit is {max_pixels} (TORCHYARD_MAX_IMAGE_PIXELS)")
        return
    try:
        with Image.open(io.BufferedReader(ViewReader(data)), formats=IMAGE_FORMATS) as probe:  # no other plugin runs
            fmt, (width, height) = probe.format, probe.size
    except Image.DecompressionBombError:
        raise TooLarge(f"{name} has too many pixels; the limit is {max_pixels} (TORCHYARD_MAX_IMAGE_PIXELS)") from None
    except Exception:
        raise UnsupportedMedia(f"{filename or 'file'} is not an image ({IMAGE_FORMATS_TEXT})") from None
    if fmt not in OPENED_FORMATS:
        raise UnsupportedMedia(f"{filename or 'file'} is {fmt}; send {IMAGE_FORMATS_TEXT}")
    if width * height > max_pixels:
        raise TooLarge(f"{name} has {width * height} pixels; the limit is {max_pixels} (TORCHYARD_MAX_IMAGE_PIXELS)")


def _header_size(data: bytes | memoryview) -> int | None:
    """The pixels of a JPEG or PNG whose header core/image_headers.py reads, or None."""
    jpeg = read_header(data) if is_jpeg(data) else None
    if jpeg is not None and jpeg.huffman and jpeg.precision == 8 and jpeg.components in (1, 3, 4):
        return jpeg.width * jpeg.height
    png = read_png_header(data)
    return png.width * png.height if png is not None else None


class Intake:
    """The limits a /predict body is read under, and the process's budget of bytes in flight."""

    def __init__(self, settings: Settings) -> None:
        self.max_pixels = settings.max_image_pixels
        self.limits = FormLimits(max_images=settings.max_images_per_request, max_image_bytes=settings.max_image_bytes,
                                 max_body_bytes=settings.max_predict_request_bytes)
        self.budget = BodyBudget(settings.predict_memory_budget_bytes, settings.predict_memory_per_client_limit)

    def reservation(self, request: Request) -> Reservation:
        """The request's share of the budget, empty until its bytes arrive; the caller releases it
        once the request is answered (its bytes are held until then: they are what is sent again)."""
        return self.budget.reservation(request.client.host if request.client else "")

    async def read(self, request: Request, reservation: Reservation) -> PredictCall:
        """The body read as it streams, each chunk reserved as it arrives (never a declared length:
        app/api/serving/budget.py says why); 413, 415, 422 or 503 as soon as it is known."""
        form = await read_predict_form(request, self.limits, self._check_image, on_bytes=reservation.reserve)
        return PredictCall.from_form(form)

    def _check_image(self, filename: str | None, data: memoryview) -> None:
        check_image(filename, data, self.max_pixels)
