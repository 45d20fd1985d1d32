"""Whether an uploaded zip is safe to read: judged from its central directory before a single byte
is written, then each member read through a byte counter.

An upload is hostile until proven otherwise, and the attacks on an extractor are the zip's own:
a directory that declares more entries or bytes than the host can hold, a ratio only a zip bomb
has, names that climb out of the destination (`..`, absolute paths, drive letters, NUL bytes),
links, devices, encrypted or exotically compressed entries, and members that inflate to more than
they declare. Kept apart from what the files mean (core/dataset_layout.py) and from where they
land (core/archives.py) so that these checks read as one list and apply to every layout alike.
"""

from __future__ import annotations

import copy
import lzma
import re
import stat
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from core.errors import InvalidInput, TooLarge, UnsupportedMedia

__all__ = ["ArchiveLimits", "DamagedEntry", "ZipMember", "check_directory", "copy_member"]

# Ratios are only meaningful for data big enough to hurt: tiny, highly compressible
# files (a solid-colour BMP, a text file) legitimately compress far beyond any sane limit.
_RATIO_FLOOR_BYTES = 1024 * 1024
_CHUNK = 64 * 1024
_DRIVE = re.compile(r"^[A-Za-z]:")
_SUPPORTED_METHODS = frozenset(
    {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
)
# What zipfile and its decompressors raise on damaged member data (bz2 raises OSError).
# Writing is outside the guarded calls, so a full disk still propagates as an error.
_READ_ERRORS = (zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, OSError, NotImplementedError)


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds an upload must stay within (see Settings.max_zip_*, max_image_pixels)."""

    max_entries: int
    max_uncompressed_bytes: int
    max_ratio: float  # total uncompressed / compressed size, and per entry
    max_image_pixels: int  # Pillow decompression-bomb guard for each image


@dataclass(frozen=True)
class ZipMember:
    """A regular-file entry that survived the checks, with its normalised path."""

    info: zipfile.ZipInfo
    parts: tuple[str, ...]


class DamagedEntry(Exception):
    """An entry whose compressed data cannot be read back; costs that file only."""


def check_directory(infos: list[zipfile.ZipInfo], limits: ArchiveLimits) -> list[ZipMember]:
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

    members: list[ZipMember] = []
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
        members.append(ZipMember(info, parts))
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


def copy_member(
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
    Raises TooLarge (the archive is forged or over its limit) or DamagedEntry (this entry
    cannot be read back).
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
            raise DamagedEntry(type(exc).__name__) from exc
        with src:
            while True:
                try:
                    chunk = src.read(_CHUNK)
                except _READ_ERRORS as exc:
                    raise DamagedEntry(type(exc).__name__) from exc
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
        raise DamagedEntry("bad CRC-32")
    return written_total
