"""bench/photos.py in its tiny mode (a handful of photos, 1 epoch, 1-second cells, one LitServe
configuration): every stage runs for real on this host (`torchyard up`, an upload, two jobs,
/predict at 1, 32 and 128 clients, the floors in fresh processes, LitServe), the table has a row
for each cell with positive figures and its floor, and nothing the bench started is left running.
No speed is asserted: the figures of a 2-core CI host mean nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support import REPO

pytestmark = pytest.mark.e2e

CONCURRENCY = (1, 32, 128)


def _ours(tmp_path: Path) -> list[str]:
    """Processes whose command line or environment names the bench's work dir (under tmp_path)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            text = " ".join(proc.info["cmdline"] or []) + " " + " ".join(f"{k}={v}" for k, v in proc.environ().items())
        except psutil.Error:
            continue
        if str(tmp_path) in text and proc.pid != os.getpid():
            found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])[:200]}")
    return found


def test_tiny_photo_bench(tmp_path: Path) -> None:
    out = tmp_path / "photos.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env["TMPDIR"] = str(tmp_path)  # the bench's work dir, data dir and logs: all under tmp_path
    run = subprocess.run([sys.executable, "bench/photos.py", "--tiny", "--json", str(out)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-4000:]
    assert _ours(tmp_path) == []

    report = json.loads(out.read_text())
    rows = {row["what"]: row for row in report["rows"]}
    assert "| what | measured | floor / ceiling (same run) | ratio | LitServe at its best | ratio to LitServe |" in run.stdout
    for row in rows.values():
        assert row["measured"] > 0, row
        assert f"| {row['what']} |" in run.stdout
    m = "cifar_net@32"
    for what in ("job 1 (fresh set), submit → succeeded", "job 1, outside its epochs", "job 1, inside its epochs",
                 "job 2 (decoded set), submit → succeeded", "steady epoch (best after the first, both jobs)",
                 "/predict, 1 client, p50", "/predict, 1 client, p99"):
        assert f"{m}: {what}" in rows
    for c in CONCURRENCY[1:]:
        for suffix in ("", ", p50", ", p99"):
            assert f"{m}: /predict, {c} clients{suffix}" in rows
    # the floors and ceilings the service is read against, measured in the same run
    for what in ("job 1, outside its epochs", "steady epoch (best after the first, both jobs)",
                 "/predict, 1 client, p50", "/predict, 32 clients", "/predict, 128 clients"):
        assert rows[f"{m}: {what}"]["floor"] > 0 and rows[f"{m}: {what}"]["ratio"] > 0
    model = report["results"]["models"]["cifar_net"]
    assert model["decode_all"]["images_s"] > 0 and model["decode_one"]["images_s"] > 0
    assert {t["draft"] for t in model["decode_all"]["tried"]} == {False, True}
    assert model["forward"]["1"]["p50_ms"] > 0 and model["forward"]["32"]["images_s"] > 0
    assert report["results"]["upload"]["num_images"] == 20
    if importlib.util.find_spec("litserve") is not None:  # the `bench` extra, which `make test` installs
        for c in CONCURRENCY:
            what = f"{m}: /predict, 1 client, p50" if c == 1 else f"{m}: /predict, {c} clients"
            assert rows[what]["litserve"] > 0, rows[what]
    else:
        assert "LitServe not measured" in run.stdout
    goals = {g["goal"] for g in report["goals"]}
    assert any("2-core decode ceiling" in g or "-core decode ceiling" in g for g in goals)
