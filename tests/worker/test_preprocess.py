"""Image → model input (worker/preprocess.py): JPEG decoded at a reduced scale where the target is
small, close to the full decode, and the same arrays for training data and for /predict."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.datagen import photo_jpeg
from worker.checkpoint import Preprocessing
from worker.data import load_image_folder
from worker.preprocess import apply_preprocessing, image_to_array

# Mean absolute difference, in uint8 levels, between the draft path and the full decode of the
# same file: what was measured is in docs/benchmarks.md, "Dataset decode".
TOLERANCE_MEAN = 1.0


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
