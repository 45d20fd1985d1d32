"""Image → model input (worker/data/image_array.py), the one transform of training data, /predict and
batch predictions: every accepted format decoded as training does, what cannot be an input refused
with its status, JPEG decoded at a reduced scale where the target is small (close to the full
decode), and the same arrays for training data and for /predict."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.datagen import photo_jpeg
from tests.worker.serving.test_engine import _encode, _rgb
from worker.checkpoints.format import Preprocessing
from worker.data.datasets import load_image_folder
from worker.data.image_array import (
    JPEG_TOLERANCE_MAX,
    BadImage,
    InputSpec,
    apply_preprocessing,
    decode_image,
    image_to_array,
)

# Mean absolute difference, in uint8 levels, between the draft path and the full decode of the
# same file: what was measured is in docs/benchmarks.md, "Dataset decode".
TOLERANCE_MEAN = 1.0
SPEC = InputSpec(3, 32, 32)


def full_decode(data: bytes, *spec: int | None) -> np.ndarray:
    """The transform without the draft: the image is decoded in full before it runs."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image_to_array(image, *spec)


def drafted(data: bytes, *spec: int | None) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return image_to_array(image, *spec)


@pytest.mark.parametrize(("size", "spec"), [
    ((500, 375), (3, 32, 32, None)),  # libjpeg at 1/4: 125×94, then the resize
    ((500, 375), (1, 50, 50, None)),  # grayscale: the luma plane alone, at 1/2
    ((2000, 1500), (3, 224, 224, 256)),  # shorter side to 256, centre crop: at 1/2
    ((2000, 1500), (3, 224, 224, None)),
])
def test_a_jpeg_decoded_at_a_reduced_scale_stays_close_to_the_full_decode(size: tuple[int, int], spec: tuple) -> None:
    data = photo_jpeg(*size, seed=3)
    full, fast = full_decode(data, *spec), drafted(data, *spec)
    assert fast.shape == full.shape == (spec[0], spec[1], spec[2]) and fast.dtype == np.uint8
    difference = np.abs(fast.astype(int) - full.astype(int))
    assert 0 < difference.mean() <= TOLERANCE_MEAN  # reduced (not the full decode), and close to it
    assert difference.max() <= 16


def test_a_jpeg_too_small_for_a_reduced_scale_decodes_in_full() -> None:
    data = photo_jpeg(500, 375, seed=4)  # 375 < 2 × 224: no scale keeps twice the target
    assert np.array_equal(drafted(data, 3, 224, 224, None), full_decode(data, 3, 224, 224, None))
    png = io.BytesIO()
    Image.open(io.BytesIO(data)).save(png, format="PNG")  # other formats never draft
    assert np.array_equal(drafted(png.getvalue(), 3, 32, 32, None), full_decode(png.getvalue(), 3, 32, 32, None))


def test_training_data_and_predict_decode_a_jpeg_alike(tmp_path: Path) -> None:
    """The rows of an uploaded set are what /predict's transform (apply_preprocessing, with the
    checkpoint's recorded preprocessing) makes of the same files, draft included."""
    root = tmp_path / "ds"
    blobs = {f"{label}/{i}.jpg": photo_jpeg(500, 375, seed=10 * label + i) for label in range(2) for i in range(3)}
    for name, blob in blobs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(blob)
    for spec in [(3, 32, 32, None), (3, 48, 48, 56)]:
        data = load_image_folder(root, *spec)
        pre = Preprocessing(spec[0], spec[1], spec[2], (0.5,) * 3, (0.25,) * 3, spec[3])
        for row, name in enumerate(sorted(blobs)):
            with Image.open(io.BytesIO(blobs[name])) as image:
                assert np.array_equal(data.images[row].numpy(), apply_preprocessing(image, pre))
            assert not np.array_equal(data.images[row].numpy(), full_decode(blobs[name], *spec))


@pytest.mark.parametrize("fmt,kw", [("PNG", {}), ("BMP", {}), ("WEBP", {"lossless": True}), ("JPEG", {"quality": 95})])
def test_decode_matches_the_training_transform(fmt: str, kw: dict) -> None:
    data = _encode(_rgb(1, (48, 40)), fmt, **kw)
    expected = image_to_array(Image.open(io.BytesIO(data)), 3, 32, 32)  # training's transform
    decoded = decode_image(data, SPEC, max_pixels=10_000)
    assert decoded.shape == (3, 32, 32) and decoded.dtype == np.uint8
    if fmt == "JPEG":  # at full scale: torchvision's decoder, within the contract's tolerance (test_torch_jpeg.py)
        assert np.abs(decoded.astype(int) - expected.astype(int)).max() <= JPEG_TOLERANCE_MAX
    else:
        assert np.array_equal(decoded, expected)
    if fmt != "JPEG":  # lossless formats decode to exactly the resized source
        source = np.asarray(_rgb(1, (48, 40)).resize((32, 32), Image.Resampling.BILINEAR)).transpose(2, 0, 1)
        assert np.array_equal(decoded, source)


def test_gif_uses_the_first_frame_and_grayscale_models_get_one_channel() -> None:
    frames = [Image.new("RGB", (32, 32), (255, 0, 0)), Image.new("RGB", (32, 32), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    decoded = decode_image(buffer.getvalue(), SPEC, max_pixels=10_000)
    assert decoded[0].min() > 200 and decoded[2].max() < 50  # red, not blue
    gray = InputSpec.of(Preprocessing(1, 50, 50, (0.5,), (0.5,)))
    assert decode_image(_encode(_rgb(2), "PNG"), gray, max_pixels=10_000).shape == (1, 50, 50)


def test_a_png_whose_header_fits_but_whose_data_is_broken_is_a_415() -> None:
    """Why PNGs are not decoded by libpng through torchvision.io.decode_png, though it takes about
    half of PIL's CPU for a small PNG (docs/benchmarks.md): torchvision 0.29.1 segfaults on this
    very file, a worker killed by one upload."""
    data = bytearray(_encode(_rgb(13), "PNG"))
    idat = data.index(b"IDAT")
    data[idat + 8:idat + 40] = bytes(32)  # zlib stream destroyed, header intact
    with pytest.raises(BadImage) as info:
        decode_image(bytes(data), SPEC, max_pixels=10_000)
    assert info.value.status == 415


@pytest.mark.parametrize("data", [b"", b"not an image at all", _encode(_rgb(3), "PNG")[:200],
                                  _encode(_rgb(3), "TIFF")])
def test_undecodable_input_is_a_415(data: bytes) -> None:
    with pytest.raises(BadImage) as info:
        decode_image(data, SPEC, max_pixels=10_000)
    assert info.value.status == 415


def test_too_many_pixels_is_a_413() -> None:
    with pytest.raises(BadImage) as info:
        decode_image(_encode(_rgb(4, (200, 100)), "PNG"), SPEC, max_pixels=10_000)
    assert info.value.status == 413


def test_bytes_decode_at_a_checkpoints_spec_as_its_preprocessing_does() -> None:
    """/predict and batch predictions decode bytes at InputSpec.of(the checkpoint's preprocessing);
    training data goes through apply_preprocessing: the same array, resize and crop included."""
    pre = Preprocessing(3, 48, 48, (0.5,) * 3, (0.25,) * 3, 56)
    data = photo_jpeg(500, 375, seed=5)
    with Image.open(io.BytesIO(data)) as image:
        expected = apply_preprocessing(image, pre)
    assert InputSpec.of(pre) == InputSpec(3, 48, 48, 56)
    assert np.array_equal(decode_image(data, InputSpec.of(pre), max_pixels=10**6), expected)
