"""One allowlist of image formats (core/images.py) for uploads, training data and predict: a file
in another format is skipped with its name, and no other decoder runs. The proof: a `gs` on the
PATH that leaves a mark when run. Pillow's default open runs it on an EPS file; torchyard's
upload and training paths, given the same file, never do."""

from __future__ import annotations

import ast
import io
import os
import zipfile
from pathlib import Path

import pytest
from PIL import EpsImagePlugin, Image

from core.archives import extract_image_folder
from core.images import IMAGE_FORMATS, refused_format
from core.zip_safety import ArchiveLimits
from tests.support import REPO
from worker.data.datasets import load_image_folder

EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
       b"0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n")
LIMITS = ArchiveLimits(max_entries=50, max_uncompressed_bytes=1 << 24, max_ratio=100.0, max_image_pixels=1 << 20)


def _image(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 200, 30)).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture
def ghostscript_tripwire(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `gs` first on the PATH that records that it ran; Pillow looks `gs` up afresh."""
    marker = tmp_path / "ghostscript-ran"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gs = bin_dir / "gs"
    gs.write_text(f'#!/bin/sh\ntouch {marker}\n[ "$1" = --version ] && echo 10.02 && exit 0\nexit 1\n')
    gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)  # Pillow caches where it found `gs`
    return marker


def test_eps_would_run_ghostscript_but_torchyard_never_decodes_it(tmp_path: Path, ghostscript_tripwire: Path) -> None:
    eps = tmp_path / "drawing.eps"
    eps.write_bytes(EPS)
    # The threat is real here: Pillow's default open hands the file to Ghostscript.
    with pytest.raises(Exception), Image.open(eps) as image:  # noqa: B017 - whatever gs's failure becomes
        image.load()
    assert ghostscript_tripwire.exists()
    ghostscript_tripwire.unlink()

    # An upload with it (and a TIFF): both skipped, named; the PNG kept; Ghostscript never ran.
    archive = tmp_path / "upload.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("cats/ok.png", _image("PNG"))
        zf.writestr("cats/drawing.eps", EPS)
        zf.writestr("cats/scan.tif", _image("TIFF"))
        zf.writestr("cats/icon.ico", _image("ICO"))
    result = extract_image_folder(archive, tmp_path / "dataset", LIMITS)
    assert result.num_images == 1
    reasons = {s.path: s.reason for s in result.skipped}
    assert reasons["cats/drawing.eps"].startswith("EPS images are not accepted; use PNG, JPEG")
    assert reasons["cats/scan.tif"].startswith("TIFF images are not accepted")
    assert reasons["cats/icon.ico"].startswith("ICO images are not accepted")
    assert not ghostscript_tripwire.exists()

    # Training data read from the data dir (a file put there by hand): skipped too, nothing runs.
    (tmp_path / "dataset" / "cats" / "planted.eps").write_bytes(EPS)
    data = load_image_folder(tmp_path / "dataset", 3, 8, 8)
    assert len(data.labels) == 1
    assert not ghostscript_tripwire.exists()


def test_refused_formats_are_named_from_their_signature() -> None:
    assert refused_format(_image("TIFF")[:64]) == "TIFF"
    assert refused_format(EPS[:64]) == "EPS"
    assert refused_format(b"hello, world") is None
    for fmt in IMAGE_FORMATS:  # the allowed ones are never "refused"
        assert refused_format(_image(fmt)[:64]) is None


def test_every_image_open_of_user_data_passes_the_allowlist() -> None:
    """A static check, so a new `Image.open` without `formats=` fails CI."""
    missing = []
    for package in ("app", "core", "worker"):
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "open"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "Image"
                        and not any(k.arg == "formats" for k in node.keywords)):
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing, missing
