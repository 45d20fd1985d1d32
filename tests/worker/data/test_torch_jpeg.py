"""Two JPEG decoders, one preprocessing contract (worker/data/image_array.py, worker/data/torch_jpeg.py):
a JPEG at full scale goes through torchvision's CPU decoder and torch's uint8 resize, everything
else through Pillow, and the same file gives the contract's array (Pillow's decode + BILINEAR,
docs/deploying-models.md) within JPEG_TOLERANCE whichever decodes it, the same predictions from a
model; what torchvision refuses or is not given is Pillow's (decoded or refused as before), and
the pixel limit holds on the header before either decodes."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from core.image_headers import read_header
from models.registry import build_model
from tests.datagen import photo_jpeg
from tests.support import REPO
from worker.data import torch_jpeg  # imported here: decode_image uses it from the first call on
from worker.data.image_array import (
    JPEG_TOLERANCE_MAX,
    JPEG_TOLERANCE_MEAN,
    BadImage,
    InputSpec,
    decode_image,
    fast_jpeg_plan,
    image_to_array,
)


def contract(data: bytes, spec: InputSpec) -> np.ndarray:
    """The documented preprocessing: Pillow opens, converts, resizes (BILINEAR), crops."""
    with Image.open(io.BytesIO(data)) as image:
        return image_to_array(image, spec.channels, spec.height, spec.width, spec.resize_size)


def reencode(data: bytes, mode: str = "RGB", **options: object) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(data)).convert(mode).save(out, format="JPEG", quality=90, **options)
    return out.getvalue()


@pytest.mark.parametrize(("size", "spec"), [
    ((500, 375), InputSpec(3, 224, 224)),  # the photo workload: no libjpeg scale keeps 2 × 224 of 375 rows
    ((500, 375), InputSpec(1, 224, 224)),  # a grayscale model: the luma plane, as Pillow's draft("L") decodes it
    ((500, 375), InputSpec(3, 224, 224, 256)),  # shorter side to 256, centre crop
    ((48, 40), InputSpec(3, 32, 32)),  # a small JPEG, shrunk
    ((32, 32), InputSpec(3, 32, 32)),  # already the model's size: no resize at all
])
def test_a_full_scale_jpeg_goes_to_torchvision_and_stays_within_the_contracts_tolerance(
        size: tuple[int, int], spec: InputSpec) -> None:
    for seed in range(3):
        data = photo_jpeg(*size, seed=seed)
        plan = fast_jpeg_plan(data, spec, 10**8)
        assert plan is not None
        fast, expected = decode_image(data, spec, 10**8), contract(data, spec)
        assert np.array_equal(fast, torch_jpeg.decode(data, spec.channels, spec.height, spec.width, *plan))
        assert fast.shape == expected.shape == (spec.channels, spec.height, spec.width) and fast.dtype == np.uint8
        assert fast.flags.c_contiguous
        difference = np.abs(fast.astype(int) - expected.astype(int))
        assert difference.max() <= JPEG_TOLERANCE_MAX and difference.mean() <= JPEG_TOLERANCE_MEAN
        if size == spec_size(spec):  # nothing resized: the very pixels Pillow decodes (one libjpeg-turbo)
            assert np.array_equal(fast, expected)


def spec_size(spec: InputSpec) -> tuple[int, int]:
    return spec.width, spec.height


@pytest.mark.parametrize(("arch", "size", "spec"), [("resnet18", (500, 375), InputSpec(3, 224, 224)),
                                                    ("cifar_net", (48, 40), InputSpec(3, 32, 32))])
def test_a_model_predicts_the_same_from_either_decoder(arch: str, size: tuple[int, int], spec: InputSpec) -> None:
    torch.manual_seed(0)
    model = build_model(arch, 10).eval()
    files = [photo_jpeg(*size, seed=20 + i) for i in range(6)]
    fast = torch.from_numpy(np.stack([decode_image(f, spec, 10**8) for f in files])).float() / 255
    slow = torch.from_numpy(np.stack([contract(f, spec) for f in files])).float() / 255
    with torch.no_grad():
        p_fast, p_slow = model(fast).softmax(1), model(slow).softmax(1)
    assert torch.equal(p_fast.argmax(1), p_slow.argmax(1))
    assert (p_fast - p_slow).abs().max().item() <= 1e-3


def test_where_pillows_draft_shrinks_the_decode_pillow_keeps_the_jpeg() -> None:
    """A photo to 32×32 (libjpeg at 1/4) and a 2000×1500 photo to 224 (at 1/2) decode fewer pixels
    with Pillow: the plan leaves them there, and the output is Pillow's to the bit."""
    for size, spec in [((500, 375), InputSpec(3, 32, 32)), ((2000, 1500), InputSpec(3, 224, 224, 256))]:
        data = photo_jpeg(*size, seed=1)
        assert fast_jpeg_plan(data, spec, 10**8) is None
        assert np.array_equal(decode_image(data, spec, 10**8), contract(data, spec))


def test_progressive_and_grayscale_jpegs_decode_alike_and_cmyk_stays_with_pillow() -> None:
    base = photo_jpeg(500, 375, seed=2)
    spec = InputSpec(3, 224, 224)
    for data in (reencode(base, progressive=True), reencode(base, "L")):
        assert fast_jpeg_plan(data, spec, 10**8) is not None
        difference = np.abs(decode_image(data, spec, 10**8).astype(int) - contract(data, spec).astype(int))
        assert difference.max() <= JPEG_TOLERANCE_MAX
    cmyk = reencode(base, "CMYK")
    assert read_header(cmyk) is not None and read_header(cmyk).components == 4  # type: ignore[union-attr]
    assert fast_jpeg_plan(cmyk, spec, 10**8) is None
    assert np.array_equal(decode_image(cmyk, spec, 10**8), contract(cmyk, spec))


def sof_offset(data: bytes) -> int:
    return data.index(b"\xff\xc0")


def test_a_12_bit_header_is_left_to_pillow_and_a_truncated_jpeg_is_still_a_415() -> None:
    data = bytearray(photo_jpeg(500, 375, seed=3))
    spec = InputSpec(3, 224, 224)
    twelve = bytearray(data)
    twelve[sof_offset(data) + 4] = 12  # the frame's sample precision
    assert read_header(bytes(twelve)).precision == 12  # type: ignore[union-attr]
    assert fast_jpeg_plan(bytes(twelve), spec, 10**8) is None
    truncated = bytes(data[:len(data) // 2])
    assert fast_jpeg_plan(truncated, spec, 10**8) is not None  # its header is whole: torchvision tries it
    with pytest.raises(BadImage) as info:  # refused there, then by Pillow, with Pillow's reason
        decode_image(truncated, spec, 10**8)
    assert info.value.status == 415


def test_the_pixel_limit_holds_on_the_header_before_any_decode() -> None:
    """A crafted JPEG that claims 60000×60000 pixels and holds none is a 413 on its header; a real
    one over the limit too, with the count in the message."""
    data = bytearray(photo_jpeg(200, 100, seed=4))
    at = sof_offset(data)
    data[at + 5:at + 9] = struct.pack(">HH", 60000, 60000)
    bomb = bytes(data[:at + 64])
    for blob, pixels in ((bomb, 60000 * 60000), (photo_jpeg(200, 100, seed=4), 20000)):
        with pytest.raises(BadImage) as info:
            decode_image(blob, InputSpec(3, 224, 224), max_pixels=10_000)
        assert info.value.status == 413 and str(pixels) in info.value.detail


@pytest.mark.parametrize("data", [b"", b"\xff\xd8\xff", b"\xff\xd8\xff\xe0\x00", b"\xff\xd8\xff\xda\x00\x02",
                                  b"\xff\xd8\xff\xe0\xff\xff" + bytes(10), b"GIF89a", b"\x89PNG\r\n\x1a\n"])
def test_a_header_the_parser_does_not_read_to_its_frame_is_none(data: bytes) -> None:
    assert read_header(data) is None


def test_the_header_is_found_past_fill_bytes_and_application_segments() -> None:
    data = photo_jpeg(123, 45, seed=5)
    padded = data[:2] + b"\xff\xe1\x00\x06exif" + b"\xff\xfe\x00\x05abc" + b"\xff" + data[2:]
    for blob in (data, padded):
        header = read_header(blob)
        assert header is not None and (header.width, header.height, header.components, header.precision) == (123, 45, 3, 8)
    assert Image.open(io.BytesIO(padded)).size == (123, 45)  # Pillow reads the same file alike


FIRST_JPEGS = """
import sys, numpy as np
from tests.datagen import photo_jpeg
from worker.data import image_array
from worker.data.image_array import InputSpec, decode_image, image_to_array
import io
from PIL import Image
spec = InputSpec(3, 224, 224)
data = photo_jpeg(500, 375, seed=1)
with Image.open(io.BytesIO(data)) as image:
    pillow = image_to_array(image, 3, 224, 224)
first = decode_image(data, spec, 10**8)
print("torch before:", "torch" in sys.modules and "worker.data.torch_jpeg" in sys.modules and
      getattr(sys.modules["worker.data.torch_jpeg"], "READY", False))
print("first is pillow:", np.array_equal(first, pillow))
image_array._importing[0].join()
later = decode_image(data, spec, 10**8)
from worker.data import torch_jpeg
print("later is torchvision:", np.array_equal(later, torch_jpeg.decode(data, 3, 224, 224, (224, 224), False)),
      "and differs from pillow:", not np.array_equal(later, pillow))
"""


def test_a_process_without_torch_decodes_with_pillow_while_torchvision_imports() -> None:
    """A /predict decoding process forks without torch: its first JPEG starts the import on a thread
    and is decoded by Pillow (no chunk waits seconds for torch), the ones after it by torchvision."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", FIRST_JPEGS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["torch before: False", "first is pillow: True",
                                       "later is torchvision: True and differs from pillow: True"]
