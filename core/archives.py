"""Extraction of an uploaded dataset zip into the data dir: all of it, or nothing.

Every image is fully decoded by Pillow under a pixel limit before it is kept (a file that only
claims to be an image costs the user that file, with the reason), and everything lands in a fresh
temporary directory next to ``dest`` that is renamed into place, fsynced, only on success, so a
failure leaves nothing behind and a reader never sees half a dataset. What is checked before a byte
is written is core/zip_safety.py's; where each file goes (ImageFolder or unlabelled) is
core/dataset_layout.py's.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from PIL import Image, UnidentifiedImageError

from core.dataset_layout import Plan, SkippedFile, plan_image_folder, plan_unlabeled
from core.errors import InvalidInput, UnsupportedMedia
from core.images import IMAGE_FORMATS, IMAGE_FORMATS_TEXT, refused_format
from core.storage import fsync_dir, fsync_tree
from core.zip_safety import ArchiveLimits, DamagedEntry, check_directory, copy_member

__all__ = ["ExtractedDataset", "extract_image_folder", "extract_images"]

_NOT_A_ZIP = "the upload is not a zip archive (or its directory is corrupt)"
_NO_CLASS = "no usable class: the zip must hold <class>/<image> folders with readable images"
_NO_IMAGE = "no usable image: the zip holds no readable image in an accepted format"

# Image.MAX_IMAGE_PIXELS and the warnings filters are process-wide; this lock makes the
# temporary swap in _pillow_limit safe against other extractions in other threads.
_PIL_LOCK = threading.Lock()


@dataclass(frozen=True)
class ExtractedDataset:
    """What ended up under ``dest``: an ImageFolder tree torchvision can read as is, or (unlabelled)
    the archive's images at their own paths."""

    classes: list[str]  # sorted class names that have >= 1 usable image; [] when unlabelled
    class_counts: dict[str, int]
    num_images: int
    skipped: list[SkippedFile]
    labeled: bool = True


def extract_image_folder(
    archive: BinaryIO | Path, dest: Path, limits: ArchiveLimits
) -> ExtractedDataset:
    """Check ``archive``, extract its images into ``dest`` and report what was kept.

    ``archive`` is a path or a seekable binary file (e.g. an upload's SpooledTemporaryFile).
    ``dest`` must not exist; its parents are created if needed. Raises UnsupportedMedia
    (not a zip), TooLarge (limits, zip bombs) or InvalidInput (unsafe entries, no usable
    class); on any error nothing is left on disk.
    """
    return _extract_archive(archive, dest, limits, labeled=True)


def extract_images(archive: BinaryIO | Path, dest: Path, limits: ArchiveLimits) -> ExtractedDataset:
    """Like ``extract_image_folder`` for an unlabelled archive: every image at any depth (up to
    core/dataset_layout.MAX_UNLABELED_DEPTH folders) keeps its path, with the same checks, limits and decoding; what
    is not an image in an accepted format is skipped and listed. InvalidInput when no image is left."""
    return _extract_archive(archive, dest, limits, labeled=False)


def _extract_archive(archive: BinaryIO | Path, dest: Path, limits: ArchiveLimits, *, labeled: bool
                     ) -> ExtractedDataset:
    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        # The caller picks dest (a fresh dataset id), so this is a bug, not a user error.
        raise FileExistsError(f"extraction destination already exists: {dest}")
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, EOFError, ValueError, UnicodeDecodeError) as exc:
        # Besides BadZipFile, a mangled directory surfaces as EOFError/ValueError, and a
        # name flagged UTF-8 that is not as UnicodeDecodeError.
        raise UnsupportedMedia(_NOT_A_ZIP) from exc
    empty = _NO_CLASS if labeled else _NO_IMAGE
    with zf:
        members = check_directory(zf.infolist(), limits)
        plan, skipped = plan_image_folder(members) if labeled else plan_unlabeled(members)
        if not plan:
            raise InvalidInput(empty)
        created_parents = _make_parents(dest.parent)
        tmp: Path | None = None
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
            counts, extract_skipped = _extract(zf, plan, tmp, limits)
            skipped.extend(extract_skipped)
            if not counts:
                raise InvalidInput(empty)
            # mkdtemp makes the root 0700; open it up like the class dirs under it.
            os.chmod(tmp, 0o755)
            if dest.exists() or dest.is_symlink():
                raise FileExistsError(f"extraction destination already exists: {dest}")
            fsync_tree(tmp)  # the files, then the rename, are on disk before the dataset's record
            os.rename(tmp, dest)
            fsync_dir(dest.parent)
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            _remove_empty(created_parents)
            raise
    if not labeled:
        return ExtractedDataset(classes=[], class_counts={}, num_images=sum(counts.values()), skipped=skipped,
                                labeled=False)
    classes = sorted(counts)
    return ExtractedDataset(
        classes=classes,
        class_counts={name: counts[name] for name in classes},
        num_images=sum(counts.values()),
        skipped=skipped,
    )


def _extract(zf: zipfile.ZipFile, plan: Plan, root: Path, limits: ArchiveLimits
             ) -> tuple[dict[str, int], list[SkippedFile]]:
    """Stream each planned file under ``root`` at its planned path, keep it only if Pillow decodes
    it fully. Counts are per first path component (the class, in ImageFolder layout)."""
    counts: dict[str, int] = {}
    skipped: list[SkippedFile] = []
    written_total = 0
    for member, parts in plan:
        cls = parts[0]
        target = root.joinpath(*parts)
        path = member.info.orig_filename
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            skipped.append(SkippedFile(path, "a folder of its path is also a file in the zip"))
            continue
        if target.exists():  # `a/b` as a file after `a/b/c`: never overwrite, never follow
            skipped.append(SkippedFile(path, "a file of the same path is already in the zip"))
            continue
        try:
            written_total = copy_member(zf, member.info, target, written_total, limits)
        except DamagedEntry as exc:
            # A damaged entry (bad CRC, truncated data, mismatched local header) loses
            # that file only, like a broken JPEG does.
            target.unlink(missing_ok=True)
            skipped.append(SkippedFile(path, f"damaged zip entry ({exc})"))
            continue
        reason = _verify_image(target, limits.max_image_pixels)
        if reason is not None:
            target.unlink()
            skipped.append(SkippedFile(path, reason))
            continue
        counts[cls] = counts.get(cls, 0) + 1
    _prune_empty_dirs(root)  # folders whose every file was skipped
    return counts, skipped


# --- each image decoded before it is kept ------------------------------------------------


def _verify_image(path: Path, max_pixels: int) -> str | None:
    """Fully decode ``path``; return why it is unusable, or None if it is a good image.

    Decoding (not just ``verify()``) catches truncated files that only fail mid-stream;
    messages are fixed strings because Pillow's quote the server-side path.
    """
    try:
        # Only the allowlisted decoders: EPS would run Ghostscript on attacker PostScript in this process.
        with _pillow_limit(max_pixels), Image.open(path, formats=IMAGE_FORMATS) as im:
            im.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        return too_many_pixels(exc, max_pixels)
    except UnidentifiedImageError:
        with open(path, "rb") as fh:
            other = refused_format(fh.read(64))
        if other is not None:
            return f"{other} images are not accepted; use {IMAGE_FORMATS_TEXT}"
        return f"not an image in an accepted format ({IMAGE_FORMATS_TEXT})"
    except Exception:
        return "corrupt or truncated image"
    return None


def too_many_pixels(bomb: Exception, max_pixels: int) -> str:
    """Pillow's decompression-bomb error in torchyard's words: its own limit and the setting that
    sets it, not Pillow's (which is twice it, with a warning below)."""
    counted = re.search(r"\((\d+) pixels\)", str(bomb))
    size = f"{int(counted.group(1)):,} pixels" if counted else f"more than {max_pixels:,} pixels"
    return f"image has {size}, over the limit of {max_pixels:,} pixels (TORCHYARD_MAX_IMAGE_PIXELS)"


@contextmanager
def _pillow_limit(max_pixels: int) -> Iterator[None]:
    """Set Pillow's pixel limit and make its bomb warning an error, then restore both."""
    with _PIL_LOCK:
        previous = Image.MAX_IMAGE_PIXELS
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                Image.MAX_IMAGE_PIXELS = max_pixels
                yield
        finally:
            Image.MAX_IMAGE_PIXELS = previous


# --- the destination's folders -----------------------------------------------------------


def _prune_empty_dirs(root: Path) -> None:
    for directory, _, _ in sorted(os.walk(root), key=lambda entry: -len(entry[0])):
        if Path(directory) != root:
            try:
                os.rmdir(directory)
            except OSError:
                pass  # not empty


def _make_parents(parent: Path) -> list[Path]:
    """Create ``parent`` and missing ancestors; return those created, deepest first."""
    missing: list[Path] = []
    probe = parent
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    parent.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    """Undo _make_parents on failure, leaving any directory something else has filled."""
    for directory in dirs:
        try:
            directory.rmdir()
        except OSError:
            return
