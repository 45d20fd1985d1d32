"""A job's files: per-delivery staging, promotion by the owner, settling after the fact."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.storage import CheckpointPaths


def test_settle_promotes_the_owners_file_and_removes_every_delivery(tmp_path: Path) -> None:
    paths = CheckpointPaths(tmp_path)
    owner, stale = "a" * 16, "b" * 16
    paths.staged("job1", owner, "model.pt").parent.mkdir(parents=True)
    paths.staged("job1", owner, "model.pt").write_bytes(b"owner")
    paths.staged("job1", owner, "resume-3.pt").write_bytes(b"state")
    paths.staged("job1", stale, "model.pt").parent.mkdir(parents=True)
    paths.staged("job1", stale, "model.pt").write_bytes(b"stale")
    assert paths.settle_files("job1", owner, ["model.pt"])
    assert paths.final("job1").read_bytes() == b"owner"
    assert sorted(p.name for p in paths.job_dir("job1").iterdir()) == ["model.pt"]
    assert paths.settle_files("job1", owner, ["model.pt"])  # again (a sweep after the owner): nothing changes
    assert paths.final("job1").read_bytes() == b"owner"
    assert not paths.settle_files("job2", owner, ["model.pt"])  # not on this disk: left for another host


def test_pointers_stay_inside_the_jobs_deliveries(tmp_path: Path) -> None:
    paths = CheckpointPaths(tmp_path)
    path = paths.staged("job1", "a" * 16, "resume-2.pt")
    assert paths.resolve("job1", paths.relative("job1", path)) == path
    for bad in ("../../etc/passwd", "deliveries/../x/y", "model.pt", "deliveries/a/../../x", "/abs/path"):
        with pytest.raises(ValueError):
            paths.resolve("job1", bad)
