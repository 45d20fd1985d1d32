"""core/image_headers.py: the sizes the JPEG and PNG readers take from a header are Pillow's, and
what they do not positively recognise is left to Pillow (None), never guessed. The /predict intake
relies on both: app/api/serving/intake.check_image answers from these headers and asks Pillow
only for the rest."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from app.api.serving.intake import check_image
from core.errors import TooLarge, UnsupportedMedia
from core.image_headers import read_header, read_png_header


def _encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _noise(mode: str, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(sum(size))
    rgb = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    return rgb.convert(mode)


PNG_CASES = [(mode, size, options) for mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16")
             for size, options in (((1, 1), {}), ((37, 5), {}), ((640, 480), {"optimize": True}))]


@pytest.mark.parametrize(("mode", "size", "options"), PNG_CASES)
def test_a_png_header_gives_pillows_size(mode: str, size: tuple[int, int], options: dict) -> None:
    data = _encoded(_noise(mode, size), "PNG", **options)
    header = read_png_header(data)
    assert header is not None and (header.width, header.height) == Image.open(io.BytesIO(data)).size
    assert read_png_header(memoryview(data)) == header  # read in place, as the intake does


JPEG_CASES = [("RGB", {}), ("RGB", {"progressive": True}), ("L", {}), ("CMYK", {}),
              ("RGB", {"subsampling": 0, "quality": 95}), ("RGB", {"exif": b"Exif\x00\x00" + b"\x00" * 4000})]


@pytest.mark.parametrize(("mode", "options"), JPEG_CASES)
def test_a_jpeg_header_gives_pillows_size(mode: str, options: dict) -> None:
    data = _encoded(_noise(mode, (500, 375)), "JPEG", **options)
    header = read_header(data)
    assert header is not None and (header.width, header.height) == Image.open(io.BytesIO(data)).size


def _png_with_ihdr(width: int, height: int, depth: int = 8, colour: int = 2, crc: int | None = None) -> bytes:
    body = b"IHDR" + struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + body
            + struct.pack(">I", zlib.crc32(body) if crc is None else crc) + b"\x00" * 16)


def test_what_the_png_reader_does_not_take_is_left_to_pillow() -> None:
    good = _png_with_ihdr(10, 10)
    assert read_png_header(good) == (10, 10)
    assert read_png_header(_png_with_ihdr(10, 10, crc=0)) is None  # a damaged IHDR
    assert read_png_header(_png_with_ihdr(0, 10)) is None
    assert read_png_header(_png_with_ihdr(10, 10, depth=3)) is None  # no such depth for RGB
    assert read_png_header(_png_with_ihdr(10, 10, colour=5)) is None  # no such colour type
    assert read_png_header(good[:30]) is None  # truncated inside the chunk
    assert read_png_header(b"GIF89a" + good[6:]) is None


def test_the_intake_refuses_from_the_header_what_pillow_refused() -> None:
    """A bomb's header alone is a 413, from either reader; what the readers leave to Pillow is
    judged by Pillow as before (a damaged PNG header: 415)."""
    with pytest.raises(TooLarge, match="TORCHYARD_MAX_IMAGE_PIXELS"):
        check_image("bomb.png", _png_with_ihdr(60000, 60000), 10**8)
    jpeg = bytearray(_encoded(_noise("RGB", (16, 16)), "JPEG"))
    header = read_header(bytes(jpeg))
    assert header is not None
    sof = bytes(jpeg).index(b"\xff\xc0")
    jpeg[sof + 5:sof + 9] = struct.pack(">HH", 60000, 60000)  # height, width
    with pytest.raises(TooLarge, match="TORCHYARD_MAX_IMAGE_PIXELS"):
        check_image("bomb.jpg", bytes(jpeg), 10**8)
    with pytest.raises(UnsupportedMedia):
        check_image("damaged.png", _png_with_ihdr(10, 10, crc=0), 10**8)
    check_image("fine.png", _encoded(_noise("RGB", (9, 9)), "PNG"), 81)
    with pytest.raises(TooLarge):
        check_image("one-too-many.png", _encoded(_noise("RGB", (9, 9)), "PNG"), 80)
