"""The README's quick start, read as a newcomer runs it in their fresh clone: every file it writes
(`curl -o`, `-o`) goes outside the clone, so it leaves no stray `model.pt` in the repository root."""

from __future__ import annotations

import re

from tests.support import REPO


def test_the_quick_start_writes_nothing_into_the_clone() -> None:
    readme = (REPO / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):readme.index("## CLI")]
    blocks = re.findall(r"```bash\n(.*?)```", quick_start, re.S)
    targets = [m for block in blocks for m in re.findall(r"(?:-o|--output)\s+(\S+)", block)]
    assert targets, "the quick start downloads the weights somewhere"
    assert all(t.startswith(("/", "~", '"/', "$HOME")) for t in targets), targets
