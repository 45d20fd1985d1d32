"""The image formats torchyard decodes, in one place.

Pillow can open dozens of formats, some through large or external decoders (EPS runs
Ghostscript); a service that decodes files from the network should run only the decoders it
means to. This allowlist is what /predict accepts, what dataset uploads keep and what training
reads: every `Image.open` of a user's file passes `formats=IMAGE_FORMATS`, so Pillow never even
asks another plugin whether the file is its format (a test scans the code for that).
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

# Pillow's plugin names, what `Image.open(..., formats=IMAGE_FORMATS)` is told to try. No "MPO" here:
# the multi-picture JPEG many cameras write is opened by the JPEG plugin (and Pillow 13 has no
# plugin of that name: listing it made every refused file a KeyError instead of "not an image").
IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "BMP", "GIF")
# What such an image's `format` can then be.
OPENED_FORMATS: tuple[str, ...] = (*IMAGE_FORMATS, "MPO")

# How the formats are named to people (errors, help texts, the OpenAPI document).
IMAGE_FORMATS_TEXT = "PNG, JPEG, WebP, BMP or GIF"


def refused_format(prefix: bytes) -> str | None:
    """The name of the format outside the allowlist that `prefix` (a file's first bytes) looks like,
    to say why a file was refused ("TIFF images are not accepted"). Only Pillow's signature checks
    run (each plugin's `_accept`, a comparison of leading bytes); no decoder does."""
    Image.init()
    for name in Image.ID:
        if name in IMAGE_FORMATS:
            continue
        accept = Image.OPEN[name][1]
        try:
            if accept is not None and accept(prefix):
                return name
        except Exception:
            continue
    return None


class ViewReader(io.RawIOBase):
    """A read-only file over bytes in memory that copies only what is read, for `Image.open` on an
    image that lies inside a larger buffer (a /predict body): `io.BytesIO` would copy all of it
    first."""

    def __init__(self, data: bytes | memoryview) -> None:
        super().__init__()
        self._data = data
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        n = max(0, min(len(target), len(self._data) - self._at))
        target[:n] = self._data[self._at:self._at + n]
        self._at += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._data)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def tell(self) -> int:
        return self._at

    def close(self) -> None:
        self._data = b""
        super().close()
