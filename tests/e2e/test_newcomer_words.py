"""A newcomer's slips answered in their words: a field's short name (`lr`) or a near miss named as
the field meant, a flat folder of images pointed at `predict-folder`, and numbers with nouns that
agree. Against the shared stack."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.test_cli import cli
from tests.support import png_bytes, wait_until

pytestmark = pytest.mark.e2e


def test_a_short_or_misspelt_field_is_named_as_the_field_meant(stack: dict) -> None:
    client = stack["client"]
    for sent, meant in (("lr", "learning_rate"), ("epoch", "epochs"), ("batchsize", "batch_size")):
        answer = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", sent: 1})
        assert answer.status_code == 422 and f"did you mean {meant!r}?" in answer.json()["detail"], answer.text
    unrelated = client.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "colour": "red"})
    assert unrelated.status_code == 422 and "did you mean" not in unrelated.json()["detail"]


def test_a_flat_folder_is_pointed_at_predict_folder_and_counts_agree(stack: dict, tmp_path: Path) -> None:
    flat = tmp_path / "photos"
    flat.mkdir()
    for k in range(3):
        (flat / f"{k}.png").write_bytes(png_bytes(np.full((8, 8, 3), 40 * k, dtype=np.uint8)))
    refused = cli(stack, "datasets", "upload", str(flat), "--name", "flat-photos")
    assert refused.returncode == 1, refused.stderr
    assert "3 files but no <class> folders" in refused.stderr and f"torchyard predict-folder {flat}" in refused.stderr
    assert all(d["name"] != "flat-photos" for d in stack["client"].get("/datasets").json()["datasets"])

    one = cli(stack, "train", "--model", "cifar_net", "--dataset", "fake", "--epochs", "1", "--detach")
    assert one.returncode == 0, one.stderr
    assert "1 epoch, device" in one.stderr and "1 epochs" not in one.stderr, one.stderr
    stack["client"].post(f"/jobs/{one.stdout.strip()}/cancel")


def test_a_piped_table_has_no_padding(stack: dict) -> None:
    """Into a pipe the table's lines end where their text does (rich padded each to the widest row)."""
    for command in (("models",), ("datasets",)):
        listed = cli(stack, *command)
        assert listed.returncode == 0, listed.stderr
        lines = listed.stdout.splitlines()
        assert len(lines) >= 3 and all(line == line.rstrip() for line in lines), (command, lines)


def test_a_worker_starts_without_celerys_root_warning(stack: dict) -> None:
    """Run as root (`make run` on a root shell, a root container), Celery warned at every start; the
    worker accepts JSON only, the danger it warns of. Its log shows Celery's banner and no warning."""
    banner = re.compile(r"-{5,} \S+@\S+ v\d+\.\d+")  # Celery's banner: printed after its root check

    def started() -> str | None:
        text = stack["procs"].log(stack["worker"])
        return text if banner.search(text) else None

    log = wait_until(started, timeout=60, what="Celery's banner in the worker's log")
    assert "superuser privileges" not in log and "SecurityWarning" not in log, log[-2000:]
