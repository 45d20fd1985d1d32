"""docs/deploying-models.md's plain-Python TorchScript example, run as written (its preprocessing
block, then its TorchScript block) on a real export of a trained job, in a fresh interpreter that
cannot import torchyard: it prints the classes, and no deprecation warning is left unexplained."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.e2e.test_exports import _get_export
from tests.support import REPO

pytestmark = pytest.mark.e2e


def _python_block(doc: str, heading: str) -> str:
    section = doc[doc.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]  # type: ignore[index]


def test_the_torchscript_example_runs_as_written_without_a_warning(stack: dict, cifar_pair: tuple[str, str],
                                                                   tmp_path: Path) -> None:
    answer, _ = _get_export(stack["client"], cifar_pair[0], "torchscript")
    assert answer.status_code == 200, answer.text
    (tmp_path / "pets.torchscript.pt").write_bytes(answer.content)
    with Image.open(REPO / "examples" / "pattern_3.png") as image:
        image.convert("RGB").save(tmp_path / "photo.jpg", quality=95)
        image.save(tmp_path / "other.png")
    doc = (REPO / "docs" / "deploying-models.md").read_text()
    script = _python_block(doc, "### From plain Python: shared preprocessing") + _python_block(doc, "### TorchScript")
    ran = subprocess.run([sys.executable, "-I", "-W", "default", "-c", script], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert re.fullmatch(r"\['pattern_\d', 'pattern_\d'\]\n", ran.stdout), ran.stdout
    assert "Warning" not in ran.stderr, ran.stderr
