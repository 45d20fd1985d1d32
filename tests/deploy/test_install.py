"""The Makefile's set-up, as make runs it (`make -n -B`: every recipe it would run, nothing run):
`make run` installs what serving needs and no test, bench or lint tool; `make test` adds them; a
CPU-only host can take torch's CPU wheels through TORCH_INDEX; the metadata reads without a warning."""

from __future__ import annotations

import re
import shutil
import subprocess
import warnings

import pytest

from tests.deploy.support import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this host")


def _installs(target: str, *variables: str) -> list[str]:
    """The pip install lines `make TARGET` would run, whatever is installed already."""
    planned = subprocess.run(["make", "-n", "-B", target, *variables], cwd=ROOT, capture_output=True, text=True,
                             check=True, timeout=60).stdout
    return [line for line in planned.splitlines() if re.search(r"pip install .*-e ", line)]


def test_make_run_installs_serving_only_and_make_test_adds_the_tools() -> None:
    run = _installs("run")
    assert len(run) == 1 and "'.[export]'" in run[0], run
    assert not any(extra in run[0] for extra in ("dev", "bench")), run
    test = _installs("test")
    assert test[0] == run[0] and "'.[dev,bench,export]'" in test[-1], test  # the same base, then the tools
    cpu = _installs("run", "TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in cpu[0], cpu
    readme = (ROOT / "README.md").read_text()
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in readme and "CUDA libraries" in readme


def test_the_package_metadata_reads_without_a_setuptools_warning() -> None:
    """Every install printed setuptools' deprecation of the licence as a TOML table; an SPDX string now."""
    from setuptools.config.pyprojecttoml import read_configuration

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = read_configuration(ROOT / "pyproject.toml")
    assert config["project"]["license"] == "Apache-2.0"
