"""Generated test data in the formats users bring: ImageFolder zips of learnable images, and
torchvision's own on-disk formats for CIFAR-10 (pickled batches) and MNIST (raw idx files)."""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from worker.data.image_array import image_to_array

SHAPE_CLASSES = ("circle", "square", "triangle")
SHAPE_COLOURS = {"circle": (220, 40, 40), "square": (40, 200, 60), "triangle": (50, 70, 230)}
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def shape_image(label: str, rng: np.random.Generator, size: int = 40) -> Image.Image:
    """A coloured shape of the class at a random place and size on a noisy background."""
    background = rng.integers(0, 90, (size, size, 3), dtype=np.uint8)
    image = Image.fromarray(background)
    draw = ImageDraw.Draw(image)
    r = int(rng.integers(size // 5, size // 3))
    cx, cy = (int(v) for v in rng.integers(r, size - r, 2))
    colour = tuple(int(np.clip(c + rng.integers(-25, 26), 0, 255)) for c in SHAPE_COLOURS[label])
    if label == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif label == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    return image


def shapes_zip(per_class: int = 100, seed: int = 0, *, corrupt: str | None = "circle/broken.png",
               top_folder: str | None = "shapes") -> bytes:
    """An ImageFolder zip (PNG and JPEG mixed), optionally with one corrupt image file."""
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    prefix = f"{top_folder}/" if top_folder else ""
    with zipfile.ZipFile(buffer, "w") as archive:
        for label in SHAPE_CLASSES:
            for k in range(per_class):
                image = shape_image(label, rng)
                out = io.BytesIO()
                fmt, ext = ("JPEG", "jpg") if k % 3 == 0 else ("PNG", "png")
                image.save(out, format=fmt, quality=95)
                archive.writestr(f"{prefix}{label}/{k:04d}.{ext}", out.getvalue())
        if corrupt:
            archive.writestr(f"{prefix}{corrupt}", b"\x89PNG\r\n\x1a\n" + b"not really a png" * 8)
    return buffer.getvalue()


def zip_of(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def symlink_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("cls/ok.png", png(np.zeros((8, 8, 3), np.uint8)))
        link = zipfile.ZipInfo("cls/evil.png")
        link.external_attr = (0o120777 << 16)  # S_IFLNK
        archive.writestr(link, "/etc/passwd")
    return buffer.getvalue()


def bomb_zip(megabytes: int = 64) -> bytes:
    """A few KiB that inflate to `megabytes` of zeros: far over any sane ratio."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("cls/bomb.png", b"\0" * (megabytes * 1024 * 1024))
    return buffer.getvalue()


def png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def photo_jpeg(width: int = 500, height: int = 375, seed: int = 0, quality: int = 85) -> bytes:
    """A photo-like JPEG (the photo workload's 500×375 at ~40 KB): a random colour field smoothed over ~25
    pixels, plus pixel noise, so the file has both the broad areas and the fine grain of a photo."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (height // 25 + 2, width // 25 + 2, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    noisy = (smooth + rng.integers(-12, 13, (height, width, 3))).clip(0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(noisy).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def class_pattern_images(labels: np.ndarray, channels: int, size: int, seed: int, noise: float = 0.15) -> np.ndarray:
    """uint8 N×C×H×W: one fixed coarse colour pattern per class plus noise (learnable)."""
    rng = np.random.default_rng(1000 + channels)
    coarse = rng.random((int(labels.max()) + 1, channels, 4, 4))
    patterns = coarse.repeat(size // 4, axis=2).repeat(size // 4, axis=3)
    noisy = patterns[labels] + noise * np.random.default_rng(seed).standard_normal((len(labels), channels, size, size))
    return (np.clip(noisy, 0, 1) * 255).round().astype(np.uint8)


def write_cifar10(root: Path, per_batch: int = 100, seed: int = 0) -> Path:
    """`root/cifar-10-batches-py/` exactly as torchvision's CIFAR10 reads it: five training
    batches, a test batch and batches.meta, pickled dicts with `data` N×3072 uint8 (channel-major
    rows) and `labels`. Returns the folder."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]
    for k, name in enumerate(names):
        labels = np.arange(per_batch) % 10
        images = class_pattern_images(labels, 3, 32, seed=seed + k)
        entry = {"batch_label": name, "labels": labels.tolist(), "data": images.reshape(per_batch, 3072),
                 "filenames": [f"{name}_{i}.png" for i in range(per_batch)]}
        with open(folder / name, "wb") as out:
            pickle.dump(entry, out)
    with open(folder / "batches.meta", "wb") as out:
        pickle.dump({"label_names": CIFAR_CLASSES, "num_cases_per_batch": per_batch, "num_vis": 3072}, out)
    return folder


def _idx(array: np.ndarray) -> bytes:
    """The idx format: magic 0x00000800 | dtype(0x08 = uint8) << 8... big-endian dims, then data."""
    header = struct.pack(">I", 0x0800 | array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(root: Path, folder: str = "MNIST", train: int = 300, test: int = 50, seed: int = 0) -> Path:
    """`root/<folder>/raw/` with the four uncompressed idx files torchvision's MNIST reads."""
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", train), ("t10k", test)):
        labels = np.arange(n) % 10
        images = class_pattern_images(labels, 1, 28, seed=seed + n)[:, 0]
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(_idx(images))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(_idx(labels))
    return raw


def write_photo_set(root: Path, per_class: int, size: tuple[int, int] = (500, 375)) -> list[Path]:
    """`<class>/<image>` of photo-like JPEGs, two classes; the files in the order a set lists them."""
    files: list[Path] = []
    for label in ("a", "b"):
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            path = root / label / f"{i:04d}.jpg"
            path.write_bytes(photo_jpeg(*size, seed=1000 * len(files) + i))
            files.append(path)
    return files


def one_by_one(files: list[Path], channels: int, height: int, width: int,
               resize_size: int | None = None) -> np.ndarray:
    """What the set's rows must be: each readable file through the one transform, in order."""
    arrays = []
    for path in files:
        with Image.open(path) as image:
            arrays.append(image_to_array(image, channels, height, width, resize_size))
    return np.stack(arrays)
