"""`torchyard alias …`, `predict --alias` and `export` as a user runs them, against the shared stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_cli import cli
from tests.support import REPO

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_jobs(cifar_pair: tuple[str, str]) -> tuple[str, str]:
    return cifar_pair


def test_alias_commands(stack: dict, two_jobs: tuple[str, str]) -> None:
    a, b = two_jobs
    made = cli(stack, "alias", "set", "cli-pets", a, "--note", "first")
    assert made.returncode == 0, made.stderr
    assert "cli-pets" in made.stdout and a in made.stdout
    moved = cli(stack, "alias", "set", "cli-pets", b, "--json")
    assert moved.returncode == 0, moved.stderr
    assert (json.loads(moved.stdout)["job_id"], json.loads(moved.stdout)["previous_job_id"]) == (b, a)

    answer = cli(stack, "predict", "--alias", "cli-pets", str(REPO / "examples" / "pattern_3.png"), "--json")
    assert answer.returncode == 0, answer.stderr
    assert (json.loads(answer.stdout)["alias"], json.loads(answer.stdout)["job_id"]) == ("cli-pets", b)

    back = cli(stack, "alias", "rollback", "cli-pets", "--note", "oops")
    assert back.returncode == 0 and a in back.stdout
    listed = cli(stack, "alias", "list")
    assert listed.returncode == 0 and "cli-pets" in listed.stdout and a in listed.stdout
    history = cli(stack, "alias", "history", "cli-pets", "--json")
    moves = json.loads(history.stdout)["moves"]
    assert [m["action"] for m in moves] == ["rollback", "set", "set"]
    assert moves[0]["note"] == "oops" and moves[0]["user_agent"].startswith("torchyard-client/")
    got = cli(stack, "alias", "get", "cli-pets", "--json")
    assert json.loads(got.stdout)["job_id"] == a
    assert cli(stack, "alias", "delete", "cli-pets").returncode == 0
    missing = cli(stack, "alias", "get", "cli-pets")
    assert missing.returncode == 1 and "(404)" in missing.stderr and "not found" in missing.stderr
    bad = cli(stack, "alias", "set", "Bad Name", a)
    assert bad.returncode == 1 and "(422)" in bad.stderr


def test_export_command_writes_a_file_torch_can_load(stack: dict, two_jobs: tuple[str, str], tmp_path: Path) -> None:
    a, _ = two_jobs
    target = tmp_path / "model.torchscript.pt"
    result = cli(stack, "export", a, "--format", "torchscript", "-o", str(target), "--json")
    assert result.returncode == 0, result.stderr
    saved = json.loads(result.stdout)
    assert saved["path"] == str(target) and saved["bytes"] == target.stat().st_size
    check = subprocess.run([sys.executable, "-I", "-c", (
        "import json, sys, torch; extra = {'torchyard.json': ''}; "
        "m = torch.jit.load(sys.argv[1], _extra_files=extra); "
        "print(json.loads(extra['torchyard.json'])['classes'][3], tuple(m(torch.rand(5, 3, 32, 32)).shape))"),
        str(target)], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    assert check.stdout.split() == ["pattern_3", "(5,", "10)"]
