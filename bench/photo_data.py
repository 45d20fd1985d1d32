"""Photo-like JPEGs for bench/photos.py: 500×375, ~38 KB at quality 85, a fixed seed.

A real photo's size and decode cost come from smooth regions (which JPEG codes in few bits), edges
and texture, and sensor noise; uniform noise would be a 200 KB file, a flat field 5 KB, and both
would decode at the wrong speed. Each image here is a smooth colour field (a coarse random grid
upsampled, tinted by its class so a model can learn the classes), a mid-frequency texture and
per-pixel noise. Generated in spawned processes (numpy and Pillow only), one per core.
"""

from __future__ import annotations

import functools
import io
import multiprocessing
import os
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

WIDTH, HEIGHT = 500, 375
QUALITY = 85
CLASSES = 10
SAMPLE_SEED = 1_000_003  # the /predict image: drawn like the dataset's, in none of them


TINT = 0.4  # the class's share of each image's colour field: its learnable signal


def photo(seed: int, label: int, width: int = WIDTH, height: int = HEIGHT, tint: float = TINT) -> np.ndarray:
    """height×width×3 uint8. A smaller `tint` makes the classes harder to tell apart: the class's
    colour shift sinks into the random field (bench/sweep.py's set, where trials must differ)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    shift = np.array([(label * 0.1) % 1.0, (label * 0.37) % 1.0, (label * 0.73) % 1.0])
    coarse = (1 - tint) * (rng.random((4, 5, 3)) * 0.6 + 0.2) + tint * shift
    field = Image.fromarray((coarse * 255).astype(np.uint8)).resize((width, height), Image.Resampling.BICUBIC)
    grain = rng.standard_normal((height // 6 + 1, width // 6 + 1)) * 30 + 128
    texture = Image.fromarray(grain.clip(0, 255).astype(np.uint8)).resize((width, height), Image.Resampling.BICUBIC)
    image = (np.asarray(field, dtype=np.float32) + np.asarray(texture, dtype=np.float32)[..., None] - 128
             + rng.normal(0, 5.0, (height, width, 3)).astype(np.float32))
    return image.clip(0, 255).astype(np.uint8)


def jpeg(seed: int, label: int, width: int = WIDTH, height: int = HEIGHT, tint: float = TINT) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(photo(seed, label, width, height, tint)).save(buffer, format="JPEG", quality=QUALITY)
    return buffer.getvalue()


def _chunk(indices: list[int], width: int = WIDTH, height: int = HEIGHT, tint: float = TINT) -> list[tuple[int, bytes]]:
    return [(i, jpeg(i, i % CLASSES, width, height, tint)) for i in indices]


def write_dataset_zip(path: Path, count: int, processes: int | None = None, *, width: int = WIDTH,
                      height: int = HEIGHT, tint: float = TINT) -> dict[str, float]:
    """`count` photos as an ImageFolder zip (`class<k>/photo<i>.jpg`, stored: JPEG does not
    compress); {"photos", "bytes", "mean_jpeg_bytes"}."""
    workers = max(1, min(processes or os.cpu_count() or 1, count))
    chunks = [list(range(k, count, workers)) for k in range(workers)]
    total = 0
    make = functools.partial(_chunk, width=width, height=height, tint=tint)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool, \
            zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for done in pool.map(make, chunks):
            for i, data in done:
                archive.writestr(f"class{i % CLASSES}/photo{i:05d}.jpg", data)
                total += len(data)
    return {"photos": count, "bytes": path.stat().st_size, "mean_jpeg_bytes": total / max(count, 1)}


def sample_jpeg() -> bytes:
    """The one image every /predict request of the bench carries."""
    return jpeg(SAMPLE_SEED, 0)
