"""The mutation pass's list of guards (scripts/mutation_guards.py) follows the code: every entry's
line is in its file exactly as listed, and every test it names exists. A change to a guarded line
fails here, in `make test`, naming the entry to update, rather than stopping `make mutation` later."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO


def test_every_guards_line_and_tests_are_where_its_entry_says() -> None:
    run = subprocess.run([sys.executable, "scripts/mutation.py", "--check"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, f"entries of scripts/mutation_guards.py that no longer match the code:\n{run.stdout}{run.stderr}"
    assert "guards' lines and tests" in run.stdout
