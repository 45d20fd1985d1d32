"""An image's size read from its first bytes, before any decoder sees them: a JPEG's frame header
(SOF) and a PNG's IHDR.

Two readers need them. The API's /predict intake checks every image's format and pixel count the
moment its part arrives (app/api/serving/intake.check_image): Pillow's `Image.open` does that for
any format, but for a JPEG it parses every marker segment in Python and for a PNG it builds its
chunk reader, tens of microseconds a request (docs/benchmarks.md, "The service's own CPU per
request"), where reading the one header a photo or a PNG states its size in costs a few. What these
readers do not positively recognise goes to Pillow exactly as before.

And the JPEG decoders of the worker: why a parser of our own there: torchvision's `decode_jpeg` has no header-only call, so the pixel limit
that Pillow's lazy `Image.open` enforces before decoding (a decompression bomb costs nothing until
it is refused) must be checked here for the faster decoder too; and the same header says whether
that decoder takes the file at all (worker/data/image_array.py's `fast_jpeg_plan`). The parser
walks the marker segments up to the first frame header or the scan, with bounded steps; anything
it does not understand is answered with None, and the file then goes to Pillow, which either
decodes it or refuses it (415) as before. No torch here: the decision is made before any import.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

# Frame headers (ITU T.81 B.1.1.3): Huffman baseline, extended, progressive; the others (lossless,
# arithmetic coding, hierarchical) are named so the walk stops at them and the file goes to Pillow.
HUFFMAN_FRAMES = (0xC0, 0xC1, 0xC2)
OTHER_FRAMES = (0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF)
START_OF_SCAN = 0xDA
# Markers without a length (TEM, RSTn, SOI, EOI).
STANDALONE = (0x01, *range(0xD0, 0xDA))
MAX_SEGMENTS = 512  # APPn/COM segments before the frame: a real file has a handful


class JpegHeader(NamedTuple):
    width: int
    height: int
    components: int  # 1 grayscale, 3 YCbCr (or RGB), 4 CMYK/YCCK
    precision: int  # bits per sample: 8, or 12 (which the fast decoder does not take)
    huffman: bool  # baseline, extended or progressive Huffman coding (what libjpeg decodes everywhere)
    frame: int  # the SOFn marker's byte: 0xC0 baseline, 0xC1 extended, 0xC2 progressive, ...


def is_jpeg(data: bytes | memoryview) -> bool:
    return bytes(data[:3]) == b"\xff\xd8\xff"


def read_header(data: bytes | memoryview) -> JpegHeader | None:
    """The first frame header of a JPEG (a multi-picture file's first picture), or None when
    `data` is not a JPEG this parser reads to its frame (truncated, a height left to a DNL marker,
    a malformed segment)."""
    if not is_jpeg(data):
        return None
    at, end = 2, len(data)
    for _ in range(MAX_SEGMENTS):
        while at < end and data[at] == 0xFF:  # a marker, after any fill bytes
            at += 1
        if at >= end or at < 3 or data[at - 1] != 0xFF:
            return None
        marker = data[at]
        at += 1
        if marker in STANDALONE:
            continue
        if at + 2 > end:
            return None
        length = (data[at] << 8) | data[at + 1]
        if length < 2 or at + length > end:
            return None
        if marker in HUFFMAN_FRAMES or marker in OTHER_FRAMES:
            if length < 8:
                return None
            precision = data[at + 2]
            height = (data[at + 3] << 8) | data[at + 4]
            width = (data[at + 5] << 8) | data[at + 6]
            components = data[at + 7]
            if width == 0 or height == 0:
                return None
            return JpegHeader(width, height, components, precision, marker in HUFFMAN_FRAMES, marker)
        if marker == START_OF_SCAN:
            return None  # a scan before any frame: not a file we decode ourselves
        at += length
    return None


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# IHDR's bit depths by colour type (PNG specification, 11.2.2): anything else is a file Pillow refuses.
PNG_BIT_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
PNG_MAX_DIMENSION = 2**31 - 1


class PngHeader(NamedTuple):
    width: int
    height: int


def read_png_header(data: bytes | memoryview) -> PngHeader | None:
    """A PNG's size from its IHDR chunk (which the specification puts first, 13 bytes, CRC-checked),
    or None when `data` does not begin with a PNG signature and a well-formed IHDR (the caller then
    asks Pillow, which refuses what is malformed)."""
    if len(data) < 33 or bytes(data[:8]) != PNG_SIGNATURE or bytes(data[8:16]) != b"\x00\x00\x00\rIHDR":
        return None
    ihdr = bytes(data[12:29])  # the type and the 13 bytes of data the CRC covers
    if zlib.crc32(ihdr) != int.from_bytes(data[29:33], "big"):
        return None
    width, height = int.from_bytes(ihdr[4:8], "big"), int.from_bytes(ihdr[8:12], "big")
    depth, colour, compression, filtering, interlace = ihdr[12:17]
    if not (0 < width <= PNG_MAX_DIMENSION and 0 < height <= PNG_MAX_DIMENSION):
        return None
    if depth not in PNG_BIT_DEPTHS.get(colour, ()) or compression or filtering or interlace > 1:
        return None
    return PngHeader(width, height)
