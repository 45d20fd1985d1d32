"""Safe extraction of an uploaded dataset zip: in ImageFolder layout (``<class>/<image>``), or
unlabelled (images at any depth, kept at their paths: what a batch-prediction job labels).

An upload is hostile until proven otherwise, so the archive is judged from its central
directory before a single byte is written (size, entry count, compression ratio, names,
entry types), every member is then streamed through a byte counter rather than trusting
the sizes it declares, and every image is fully decoded by Pillow under a pixel limit.
Everything lands in a fresh temporary directory next to ``dest`` that is renamed into
place only on success, so a failure leaves nothing behind and a reader never sees half a
dataset.
"""

from __future__ import annotations

import copy
import lzma
import os
import re
import shutil
import stat
import tempfile
import threading
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from PIL import Image, UnidentifiedImageError

from core.errors import InvalidInput, TooLarge, UnsupportedMedia
from core.images import IMAGE_FORMATS, IMAGE_FORMATS_TEXT, refused_format
from core.storage import fsync_dir, fsync_tree

__all__ = ["ArchiveLimits", "ExtractedDataset", "SkippedFile", "extract_image_folder", "extract_images"]

# Ratios are only meaningful for data big enough to hurt: tiny, highly compressible
# files (a solid-colour BMP, a text file) legitimately compress far beyond any sane limit.
_RATIO_FLOOR_BYTES = 1024 * 1024
_CHUNK = 64 * 1024
# A single path component longer than this cannot be created on common filesystems.
_MAX_NAME_BYTES = 255
_DRIVE = re.compile(r"^[A-Za-z]:")
# Clutter that archivers and desktops add; dropped without being reported.
_JUNK_NAMES = frozenset({"__macosx", "thumbs.db", "desktop.ini"})
_SUPPORTED_METHODS = frozenset(
    {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
)
_NOT_A_ZIP = "the upload is not a zip archive (or its directory is corrupt)"
_NO_CLASS = "no usable class: the zip must hold <class>/<image> folders with readable images"
_NO_IMAGE = "no usable image: the zip holds no readable image in an accepted format"
# An unlabelled upload keeps its folders; deeper than this is not a photo library, it is an attack.
MAX_UNLABELED_DEPTH = 32

# Image.MAX_IMAGE_PIXELS and the warnings filters are process-wide; this lock makes the
# temporary swap in _pillow_limit safe against other extractions in other threads.
_PIL_LOCK = threading.Lock()


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds an upload must stay within (see Settings.max_zip_*, max_image_pixels)."""

    max_entries: int
    max_uncompressed_bytes: int
    max_ratio: float  # total uncompressed / compressed size, and per entry
    max_image_pixels: int  # Pillow decompression-bomb guard for each image


@dataclass(frozen=True)
class SkippedFile:
    """A file that was left out of the dataset, and why (shown to the user)."""

    path: str  # path inside the archive
    reason: str


@dataclass(frozen=True)
class ExtractedDataset:
    """What ended up under ``dest``: an ImageFolder tree torchvision can read as is, or (unlabelled)
    the archive's images at their own paths."""

    classes: list[str]  # sorted class names that have >= 1 usable image; [] when unlabelled
    class_counts: dict[str, int]
    num_images: int
    skipped: list[SkippedFile]
    labeled: bool = True


class _DamagedEntry(Exception):
    """An entry whose compressed data cannot be read back; costs that file only."""


# What zipfile and its decompressors raise on damaged member data (bz2 raises OSError).
# Writing is outside the guarded calls, so a full disk still propagates as an error.
_READ_ERRORS = (zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, OSError, NotImplementedError)


@dataclass(frozen=True)
class _Member:
    """A regular-file entry that survived the checks, with its normalised path."""

    info: zipfile.ZipInfo
    parts: tuple[str, ...]


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
    MAX_UNLABELED_DEPTH folders) keeps its path, with the same checks, limits and decoding; what
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
        members = _check_directory(zf.infolist(), limits)
        plan, skipped = _plan_layout(members) if labeled else _plan_unlabeled(members)
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


# --- checks on the central directory (nothing written yet) ------------------------------


def _check_directory(infos: list[zipfile.ZipInfo], limits: ArchiveLimits) -> list[_Member]:
    """Reject the whole archive on any limit or unsafe entry; return its regular files.

    Safety checks cover every entry, ignored clutter included: an archive that carries a
    symlink or a traversal anywhere was made to attack an extractor, not to be a dataset.
    """
    if len(infos) > limits.max_entries:
        raise TooLarge(f"the zip has {len(infos)} entries; the limit is {limits.max_entries}")
    total = sum(info.file_size for info in infos)
    if total > limits.max_uncompressed_bytes:
        raise TooLarge(
            f"the zip expands to {total} bytes; the limit is {limits.max_uncompressed_bytes}"
        )
    compressed = sum(info.compress_size for info in infos)
    if total > _RATIO_FLOOR_BYTES and total / max(compressed, 1) > limits.max_ratio:
        raise TooLarge(
            f"the zip expands {total / max(compressed, 1):.0f}x (limit {limits.max_ratio:g}x):"
            " it looks like a zip bomb"
        )

    members: list[_Member] = []
    seen: set[tuple[str, ...]] = set()
    for info in infos:
        name = info.orig_filename  # ZipInfo.filename silently cuts names at a NUL
        if info.file_size > _RATIO_FLOOR_BYTES and (
            info.file_size / max(info.compress_size, 1) > limits.max_ratio
        ):
            raise TooLarge(
                f"entry {name!r} expands {info.file_size / max(info.compress_size, 1):.0f}x"
                f" (limit {limits.max_ratio:g}x): it looks like a zip bomb"
            )
        parts = _safe_parts(name)
        if info.flag_bits & 0x1:
            raise InvalidInput(f"entry {name!r} is encrypted; upload an unencrypted zip")
        mode = info.external_attr >> 16
        kind = stat.S_IFMT(mode)
        if stat.S_ISLNK(mode):
            raise InvalidInput(f"entry {name!r} is a symbolic link; links are not allowed")
        if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise InvalidInput(f"entry {name!r} is not a regular file (device, fifo or socket)")
        if name.endswith(("/", "\\")) or kind == stat.S_IFDIR or not parts:
            continue
        if parts in seen:
            raise InvalidInput(f"entry {name!r} appears more than once in the zip")
        seen.add(parts)
        if info.compress_type not in _SUPPORTED_METHODS:
            raise UnsupportedMedia(
                f"entry {name!r} uses an unsupported compression method ({info.compress_type});"
                " use deflate"
            )
        members.append(_Member(info, parts))
    return members


def _safe_parts(name: str) -> tuple[str, ...]:
    """Split an entry name into components, refusing anything that could escape ``dest``.

    Backslashes are treated as separators (Windows tools write them), so ``..\\x`` is
    caught as the traversal it would be on Windows; ``.`` and empty components are dropped.
    """
    if "\x00" in name:
        raise InvalidInput(f"entry {name!r} has a NUL byte in its name")
    unified = name.replace("\\", "/")
    if unified.startswith("/") or _DRIVE.match(unified):
        raise InvalidInput(f"entry {name!r} has an absolute path")
    parts = tuple(part for part in unified.split("/") if part not in ("", "."))
    if ".." in parts:
        raise InvalidInput(f"entry {name!r} has a '..' component (path traversal)")
    return parts


# --- layout ------------------------------------------------------------------------------


def _is_junk(parts: tuple[str, ...]) -> bool:
    """Archiver and desktop clutter (``__MACOSX/``, dotfiles, Thumbs.db), never reported."""
    return any(part.startswith(".") or part.lower() in _JUNK_NAMES for part in parts)


def _plan_layout(members: list[_Member]) -> tuple[list[tuple[_Member, tuple[str, ...]]], list[SkippedFile]]:
    """Map each file to ``(member, class, filename)``; misplaced files become skipped.

    One common top-level folder (``PetImages/Cat/1.jpg``) is stripped when that puts more
    files at ``<class>/<image>`` depth than leaving it would, so a single-class zip
    (``Cat/1.jpg``) is not mistaken for a wrapper.
    """
    files = [m for m in members if not _is_junk(m.parts)]
    tops = {m.parts[0] for m in files}
    strip = 0
    if len(tops) == 1 and all(len(m.parts) >= 2 for m in files):
        at_depth_if_stripped = sum(len(m.parts) == 3 for m in files)
        at_depth_as_is = sum(len(m.parts) == 2 for m in files)
        if at_depth_if_stripped > at_depth_as_is:
            strip = 1

    plan: list[tuple[_Member, tuple[str, ...]]] = []
    skipped: list[SkippedFile] = []
    for m in files:
        parts = m.parts[strip:]
        path = m.info.orig_filename
        if len(parts) == 1:
            skipped.append(SkippedFile(path, "file at the top level; images must be in a <class>/ folder"))
        elif len(parts) > 2:
            skipped.append(SkippedFile(path, "nested too deep; expected <class>/<image>"))
        elif not _is_safe_component(parts[0]):
            skipped.append(SkippedFile(path, "class folder name is not a usable directory name"))
        elif not _is_safe_component(parts[1]):
            skipped.append(SkippedFile(path, "file name is not usable"))
        else:
            plan.append((m, (parts[0], parts[1])))
    return plan, skipped


def _plan_unlabeled(members: list[_Member]) -> tuple[list[tuple[_Member, tuple[str, ...]]], list[SkippedFile]]:
    """Every file at its own path (any depth); a name that cannot be created is skipped. The
    counts of the extraction are kept under one key (there are no classes)."""
    plan: list[tuple[_Member, tuple[str, ...]]] = []
    skipped: list[SkippedFile] = []
    for m in (m for m in members if not _is_junk(m.parts)):
        path = m.info.orig_filename
        if len(m.parts) > MAX_UNLABELED_DEPTH:
            skipped.append(SkippedFile(path, f"nested deeper than {MAX_UNLABELED_DEPTH} folders"))
        elif not all(_is_safe_component(part) for part in m.parts):
            skipped.append(SkippedFile(path, "file or folder name is not usable"))
        else:
            plan.append((m, m.parts))
    return plan, skipped


def _is_safe_component(part: str) -> bool:
    """True for a name that is exactly one creatable path component."""
    return (
        part not in ("", ".", "..")
        and "/" not in part
        and "\\" not in part
        and "\x00" not in part
        and len(part.encode("utf-8", "surrogateescape")) <= _MAX_NAME_BYTES
    )


# --- extraction and verification --------------------------------------------------------


def _extract(
    zf: zipfile.ZipFile,
    plan: list[tuple[_Member, tuple[str, ...]]],
    root: Path,
    limits: ArchiveLimits,
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
            written_total = _copy_member(zf, member.info, target, written_total, limits)
        except _DamagedEntry as exc:
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


def _prune_empty_dirs(root: Path) -> None:
    for directory, _, _ in sorted(os.walk(root), key=lambda entry: -len(entry[0])):
        if Path(directory) != root:
            try:
                os.rmdir(directory)
            except OSError:
                pass  # not empty


def _copy_member(
    zf: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    target: Path,
    written_total: int,
    limits: ArchiveLimits,
) -> int:
    """Copy one entry to ``target`` counting real bytes; return the new running total.

    zipfile stops reading at the declared size, which would hide an entry that inflates
    to more than it claims; opening it with room for one extra byte lets the counter see
    the overrun. zipfile would then fail that read on a CRC mismatch and mask the overrun,
    so the probe carries no CRC (zipfile skips the check) and the CRC is checked here.
    """
    probe = copy.copy(info)
    probe.file_size = info.file_size + 1
    del probe.CRC
    written = 0
    crc = 0
    with open(target, "xb") as out:
        try:
            src = zf.open(probe)
        except _READ_ERRORS as exc:
            raise _DamagedEntry(type(exc).__name__) from exc
        with src:
            while True:
                try:
                    chunk = src.read(_CHUNK)
                except _READ_ERRORS as exc:
                    raise _DamagedEntry(type(exc).__name__) from exc
                if not chunk:
                    break
                written += len(chunk)
                written_total += len(chunk)
                if written > info.file_size:
                    raise TooLarge(
                        f"entry {info.orig_filename!r} inflates past its declared size"
                        f" of {info.file_size} bytes; the zip is forged"
                    )
                if written_total > limits.max_uncompressed_bytes:
                    raise TooLarge(
                        f"the zip expands past {limits.max_uncompressed_bytes} bytes, the limit"
                    )
                crc = zlib.crc32(chunk, crc)
                out.write(chunk)
    if crc != info.CRC:
        raise _DamagedEntry("bad CRC-32")
    return written_total


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


# --- filesystem helpers -------------------------------------------------------------------


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
