"""Tests for an upload's extraction, through its entry points (core.archives): hostile zips are
refused before anything is written (core.zip_safety), files land where their layout puts them or
are skipped with a reason (core.dataset_layout), and a good zip lands atomically at dest with
broken images skipped (core.archives)."""

from __future__ import annotations

import io
import stat
import struct
import tempfile
import warnings
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from core.archives import ExtractedDataset, extract_image_folder, extract_images
from core.dataset_layout import SkippedFile
from core.errors import InvalidInput, TooLarge, UnsupportedMedia
from core.zip_safety import ArchiveLimits

LIMITS = ArchiveLimits(
    max_entries=50,
    max_uncompressed_bytes=8 * 1024 * 1024,
    max_ratio=100.0,
    max_image_pixels=64 * 64,
)
GARBAGE_JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"this is not really a jpeg" * 4


# --- helpers ------------------------------------------------------------------------------


def _image(fmt: str, size: tuple[int, int] = (8, 8), color: tuple[int, int, int] = (200, 40, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


PNG = _image("PNG")
JPEG = _image("JPEG")
TRUNCATED_JPEG = _image("JPEG", size=(32, 32))[:300]  # identifies as JPEG, fails to decode


def _zip(path: Path, entries: list[tuple[str | zipfile.ZipInfo, bytes]], method: int = zipfile.ZIP_DEFLATED) -> Path:
    """Write ``entries`` in order; a name ending in '/' becomes a directory entry."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Duplicate name" is the point of a test
        with zipfile.ZipFile(path, "w", compression=method) as zf:
            for name, data in entries:
                if isinstance(name, str) and name.endswith("/"):
                    zf.writestr(zipfile.ZipInfo(name), b"")
                else:
                    zf.writestr(name, data)
    return path


def _patch_central(path: Path, name: str, offset: int, fmt: str, value: int) -> None:
    """Overwrite a field of ``name``'s central-directory record (offsets per APPNOTE 4.3.12)."""
    raw = bytearray(path.read_bytes())
    pos = raw.find(b"PK\x01\x02")
    while pos != -1:
        (name_len,) = struct.unpack_from("<H", raw, pos + 28)
        if raw[pos + 46 : pos + 46 + name_len] == name.encode():
            struct.pack_into(fmt, raw, pos + offset, value)
            path.write_bytes(bytes(raw))
            return
        pos = raw.find(b"PK\x01\x02", pos + 4)
    raise AssertionError(f"{name} not in central directory")


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    # A parent that does not exist yet: extraction must create it, and remove it on failure.
    return tmp_path / "datasets" / "ds1"


def _assert_nothing_written(tmp_path: Path, archive: Path) -> None:
    assert _listing(tmp_path) == {archive.name}


# --- success ------------------------------------------------------------------------------


def test_happy_path_with_top_level_folder(tmp_path: Path, dest: Path) -> None:
    archive = _zip(
        tmp_path / "pets.zip",
        [
            ("PetImages/", b""),
            ("PetImages/Cat/", b""),
            ("PetImages/Cat/1.png", PNG),
            ("PetImages/Cat/2.jpg", JPEG),
            ("PetImages/Dog/1.png", _image("PNG", color=(1, 2, 3))),
            ("PetImages/Dog/2.jpeg", JPEG),
            ("PetImages/Dog/666.jpg", TRUNCATED_JPEG),
            # clutter, dropped silently
            ("PetImages/.DS_Store", b"\0\0\0\1Bud1"),
            ("PetImages/Cat/Thumbs.db", b"junk"),
            ("__MACOSX/PetImages/Cat/._1.png", b"\0\5\26\7"),
        ],
    )

    result = extract_image_folder(archive, dest, LIMITS)

    assert result == ExtractedDataset(
        classes=["Cat", "Dog"],
        class_counts={"Cat": 2, "Dog": 2},
        num_images=4,
        skipped=[SkippedFile("PetImages/Dog/666.jpg", result.skipped[0].reason)],
    )
    assert "corrupt" in result.skipped[0].reason
    assert _listing(dest) == {"Cat", "Dog", "Cat/1.png", "Cat/2.jpg", "Dog/1.png", "Dog/2.jpeg"}
    assert (dest / "Cat" / "1.png").read_bytes() == PNG
    # no temporary directory left next to dest, nothing outside it
    assert _listing(tmp_path) == {"pets.zip", "datasets", "datasets/ds1"} | {
        f"datasets/ds1/{p}" for p in _listing(dest)
    }


def test_extracted_files_and_folders_are_on_disk_before_the_record(tmp_path: Path, dest: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every extracted file, every folder and the folder the dataset was renamed into are fsynced
    (the dataset's record is written after extraction returns). The spy records what the real
    os.fsync was called on, by inode, and calls it."""
    import os

    synced: set[int] = set()
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    archive = _zip(tmp_path / "d.zip", [("Cat/1.png", PNG), ("Dog/1.png", PNG), ("Dog/2.jpg", JPEG)])
    extract_image_folder(archive, dest, LIMITS)
    expected = set(dest.rglob("*")) | {dest, dest.parent}
    assert {p.stat().st_ino for p in expected} <= synced, sorted(str(p) for p in expected
                                                                 if p.stat().st_ino not in synced)


def test_no_top_level_folder_from_file_object(tmp_path: Path, dest: Path) -> None:
    archive = _zip(
        tmp_path / "flat.zip",
        [
            ("cats/a.png", PNG),
            ("cats/b.png", PNG),
            ("dogs/a.jpg", JPEG),
            ("README.txt", b"hello"),
            ("dogs/puppies/c.png", PNG),
        ],
    )
    with tempfile.SpooledTemporaryFile(max_size=1024) as upload:  # like an upload body
        upload.write(archive.read_bytes())
        result = extract_image_folder(upload, dest, LIMITS)

    assert result.classes == ["cats", "dogs"]
    assert result.class_counts == {"cats": 2, "dogs": 1}
    assert result.num_images == 3
    reasons = {s.path: s.reason for s in result.skipped}
    assert set(reasons) == {"README.txt", "dogs/puppies/c.png"}
    assert "top level" in reasons["README.txt"]
    assert "nested" in reasons["dogs/puppies/c.png"]
    assert not (dest / "README.txt").exists() and not (dest / "dogs" / "puppies").exists()


def test_single_class_zip_is_not_mistaken_for_a_wrapper(tmp_path: Path, dest: Path) -> None:
    archive = _zip(tmp_path / "one.zip", [("Cat/1.png", PNG), ("Cat/2.png", PNG)])

    result = extract_image_folder(archive, dest, LIMITS)

    assert result.classes == ["Cat"] and result.num_images == 2


def test_image_above_pixel_limit_is_skipped(tmp_path: Path, dest: Path) -> None:
    before = Image.MAX_IMAGE_PIXELS
    archive = _zip(
        tmp_path / "big.zip",
        [
            ("Cat/small.png", PNG),
            ("Cat/huge.png", _image("PNG", size=(70, 70))),  # 4900 px: warning zone, as error
            ("Cat/giant.png", _image("PNG", size=(100, 100))),  # > 2x limit: Pillow's own error
            ("Dog/small.png", PNG),
        ],
    )

    result = extract_image_folder(archive, dest, LIMITS)

    assert result.class_counts == {"Cat": 1, "Dog": 1}
    assert {s.path for s in result.skipped} == {"Cat/huge.png", "Cat/giant.png"}
    limit = f"over the limit of {LIMITS.max_image_pixels:,} pixels (TORCHYARD_MAX_IMAGE_PIXELS)"
    assert {s.path: s.reason for s in result.skipped} == {"Cat/huge.png": f"image has 4,900 pixels, {limit}",
                                                         "Cat/giant.png": f"image has 10,000 pixels, {limit}"}
    assert not (dest / "Cat" / "huge.png").exists()
    assert before == Image.MAX_IMAGE_PIXELS  # the global is restored


def test_damaged_entry_costs_only_that_file(tmp_path: Path, dest: Path) -> None:
    archive = _zip(tmp_path / "crc.zip", [("Cat/1.png", PNG), ("Cat/2.png", PNG), ("Dog/1.png", PNG)])
    _patch_central(archive, "Cat/2.png", 16, "<I", 0xDEADBEEF)  # CRC-32

    result = extract_image_folder(archive, dest, LIMITS)

    assert result.class_counts == {"Cat": 1, "Dog": 1}
    assert [(s.path, "damaged" in s.reason) for s in result.skipped] == [("Cat/2.png", True)]


# --- refused before anything is written -------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"definitely not a zip file" * 10])
def test_not_a_zip(tmp_path: Path, dest: Path, content: bytes) -> None:
    archive = tmp_path / "upload.zip"
    archive.write_bytes(content)

    with pytest.raises(UnsupportedMedia, match="not a zip"):
        extract_image_folder(archive, dest, LIMITS)
    _assert_nothing_written(tmp_path, archive)


@pytest.mark.parametrize(
    "evil",
    ["../evil.png", "/etc/x.png", "Cat/../../evil.png", "..\\evil.png", "C:/evil.png", "C:\\evil.png"],
)
def test_path_traversal_and_absolute_names(tmp_path: Path, dest: Path, evil: str) -> None:
    archive = _zip(tmp_path / "evil.zip", [("Cat/ok.png", PNG), (zipfile.ZipInfo(evil), PNG)])

    with pytest.raises(InvalidInput) as excinfo:
        extract_image_folder(archive, dest, LIMITS)
    assert repr(evil) in excinfo.value.detail
    _assert_nothing_written(tmp_path, archive)
    assert not (tmp_path.parent / "evil.png").exists()


def test_nul_in_name(tmp_path: Path, dest: Path) -> None:
    archive = _zip(tmp_path / "nul.zip", [("Cat/ok.png", PNG), ("Cat/a.pngX../x", PNG)])
    archive.write_bytes(archive.read_bytes().replace(b"Cat/a.pngX", b"Cat/a.png\x00"))

    with pytest.raises(InvalidInput, match="NUL"):
        extract_image_folder(archive, dest, LIMITS)
    _assert_nothing_written(tmp_path, archive)


@pytest.mark.parametrize("kind", [stat.S_IFLNK, stat.S_IFIFO, stat.S_IFCHR])
def test_symlink_and_special_files(tmp_path: Path, dest: Path, kind: int) -> None:
    link = zipfile.ZipInfo("Cat/link.png")
    link.external_attr = (kind | 0o777) << 16
    archive = _zip(tmp_path / "link.zip", [("Cat/ok.png", PNG), (link, b"/etc/passwd")])

    with pytest.raises(InvalidInput, match=r"Cat/link\.png"):
        extract_image_folder(archive, dest, LIMITS)
    _assert_nothing_written(tmp_path, archive)


@pytest.mark.parametrize("second", ["Cat/1.png", "./Cat/1.png", "Cat\\1.png", "Cat//1.png"])
def test_duplicate_names(tmp_path: Path, dest: Path, second: str) -> None:
    archive = _zip(tmp_path / "dup.zip", [("Cat/1.png", PNG), (second, JPEG)])

    with pytest.raises(InvalidInput, match="more than once"):
        extract_image_folder(archive, dest, LIMITS)
    _assert_nothing_written(tmp_path, archive)


def test_encrypted_entry(tmp_path: Path, dest: Path) -> None:
    archive = _zip(tmp_path / "enc.zip", [("Cat/1.png", PNG), ("Cat/2.png", PNG)])
    _patch_central(archive, "Cat/2.png", 8, "<H", 0x1)  # general purpose flag: encrypted

    with pytest.raises(InvalidInput, match="encrypted"):
        extract_image_folder(archive, dest, LIMITS)
    _assert_nothing_written(tmp_path, archive)


def test_too_many_entries(tmp_path: Path, dest: Path) -> None:
    archive = _zip(tmp_path / "many.zip", [(f"Cat/{i}.png", PNG) for i in range(6)])

    with pytest.raises(TooLarge, match="entries"):
        extract_image_folder(archive, dest, ArchiveLimits(5, 10**9, 100.0, 10**6))
    _assert_nothing_written(tmp_path, archive)


def test_declared_total_over_limit(tmp_path: Path, dest: Path) -> None:
    archive = _zip(tmp_path / "big.zip", [(f"Cat/{i}.png", PNG) for i in range(4)])

    with pytest.raises(TooLarge, match="limit"):
        extract_image_folder(archive, dest, ArchiveLimits(50, 3 * len(PNG), 100.0, 10**6))
    _assert_nothing_written(tmp_path, archive)


def test_zip_bomb_single_entry(tmp_path: Path, dest: Path) -> None:
    archive = _zip(tmp_path / "bomb.zip", [("Cat/ok.png", PNG), ("Cat/zeros.png", bytes(50 * 1024 * 1024))])

    with pytest.raises(TooLarge, match="zip bomb"):
        extract_image_folder(archive, dest, ArchiveLimits(50, 10**9, 100.0, 10**6))
    _assert_nothing_written(tmp_path, archive)


def test_zip_bomb_spread_over_small_entries(tmp_path: Path, dest: Path) -> None:
    zeros = bytes(512 * 1024)  # each under the per-entry floor; together they blow up 1000x
    archive = _zip(tmp_path / "bomb.zip", [(f"Cat/{i}.png", zeros) for i in range(8)])

    with pytest.raises(TooLarge, match="zip bomb"):
        extract_image_folder(archive, dest, ArchiveLimits(50, 10**9, 100.0, 10**6))
    _assert_nothing_written(tmp_path, archive)


@pytest.mark.parametrize("method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED])
def test_entry_inflating_past_its_declared_size(tmp_path: Path, dest: Path, method: int) -> None:
    archive = _zip(
        tmp_path / "liar.zip",
        [("Cat/ok.png", PNG), ("Dog/ok.png", PNG), ("Dog/liar.png", bytes(200_000))],
        method=method,
    )
    _patch_central(archive, "Dog/liar.png", 24, "<I", 100)  # uncompressed size: claims 100 bytes

    with pytest.raises(TooLarge, match="declared size"):
        extract_image_folder(archive, dest, LIMITS)
    _assert_nothing_written(tmp_path, archive)


# --- refused after extraction -------------------------------------------------------------


def test_no_usable_class(tmp_path: Path, dest: Path) -> None:
    archive = _zip(
        tmp_path / "broken.zip",
        [("Cat/1.jpg", TRUNCATED_JPEG), ("Dog/1.jpg", GARBAGE_JPEG), ("Dog/2.png", b"plain text"), ("readme.md", b"# hi")],
    )

    with pytest.raises(InvalidInput, match="no usable class"):
        extract_image_folder(archive, dest, LIMITS)
    assert not dest.exists()
    _assert_nothing_written(tmp_path, archive)  # the created parent is gone too


def test_dest_must_not_exist(tmp_path: Path) -> None:
    archive = _zip(tmp_path / "ok.zip", [("Cat/1.png", PNG)])
    (tmp_path / "taken").mkdir()

    with pytest.raises(FileExistsError):
        extract_image_folder(archive, tmp_path / "taken", LIMITS)
    assert _listing(tmp_path) == {"ok.zip", "taken"}


# --- unlabelled uploads (batch predictions) -------------------------------------------------


def test_unlabeled_keeps_images_at_any_depth_and_skips_what_is_not_one(tmp_path: Path, dest: Path) -> None:
    archive = _zip(tmp_path / "flat.zip", [
        ("a.png", PNG), ("b.jpg", JPEG), ("deep/er/c.png", PNG), ("notes.txt", b"hello"),
        ("bad.jpg", TRUNCATED_JPEG), ("__MACOSX/._a.png", b"junk"), (".hidden.png", PNG), ("empty/", b""),
    ])
    result = extract_images(archive, dest, LIMITS)
    assert result.labeled is False and result.classes == [] and result.class_counts == {}
    assert result.num_images == 3
    assert _listing(dest) == {"a.png", "b.jpg", "deep", "deep/er", "deep/er/c.png"}
    assert {s.path for s in result.skipped} == {"notes.txt", "bad.jpg"}


def test_unlabeled_refuses_hostile_entries_like_a_labelled_upload(tmp_path: Path, dest: Path) -> None:
    for evil in ("../escape.png", "/abs.png", "x/../../y.png"):
        archive = _zip(tmp_path / "evil.zip", [("ok.png", PNG), (evil, PNG)])
        with pytest.raises(InvalidInput):
            extract_images(archive, dest, LIMITS)
        assert not dest.exists()
    link = zipfile.ZipInfo("ok/link.png")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    archive = _zip(tmp_path / "link.zip", [("ok.png", PNG), (link, b"/etc/passwd")])
    with pytest.raises(InvalidInput, match="symbolic link"):
        extract_images(archive, dest, LIMITS)
    too_many = _zip(tmp_path / "many.zip", [(f"{k}.png", PNG) for k in range(LIMITS.max_entries + 1)])
    with pytest.raises(TooLarge):
        extract_images(too_many, dest, LIMITS)


def test_unlabeled_with_no_image_is_refused_and_a_file_folder_clash_is_skipped(tmp_path: Path, dest: Path) -> None:
    with pytest.raises(InvalidInput, match="no usable image"):
        extract_images(_zip(tmp_path / "none.zip", [("a.txt", b"text")]), dest, LIMITS)
    assert not dest.exists()
    clash = extract_images(_zip(tmp_path / "clash.zip", [("a", PNG), ("a/b.png", PNG)]), dest, LIMITS)
    assert clash.num_images == 1 and [s.path for s in clash.skipped] == ["a/b.png"]
