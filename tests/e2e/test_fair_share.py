"""Fair share between projects with two real CPU workers on one Redis: with project alpha holding
both devices and a backlog, project beta's first job is the next to start when a device frees,
not after alpha's backlog; then alpha's high-priority job goes ahead of its own waiting normal
ones (core/access/fair_share.py). The checks are the order jobs started in."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support import Processes, flush, wait_for_job, wait_until, with_db

pytestmark = pytest.mark.e2e

KEY = "bootstrap-admin-key-for-the-fair-share-test"
LONG = {"model": "cifar_net", "dataset": "fake", "epochs": 5, "patience": 0}


def test_another_projects_first_job_starts_before_a_backlog(redis_base_url: str, tmp_path: Path) -> None:
    url = with_db(redis_base_url, 15)
    flush(url)
    procs = Processes(url, tmp_path / "data", tmp_path / "logs", TORCHYARD_API_KEY=KEY)
    for node in ("h1", "h2"):
        procs.worker("cpu", name=node, TORCHYARD_NODE_NAME=node)
    base = procs.ready_api()
    admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    try:
        wait_until(lambda: {d["id"] for d in admin.get("/devices").json()["devices"] if d["status"] == "idle"}
                   >= {"h1/cpu", "h2/cpu"}, timeout=180, what="two idle workers")
        teams = {}
        for team in ("alpha", "beta"):
            secret = admin.post("/keys", json={"name": team, "role": "trainer", "project": team}).json()["secret"]
            teams[team] = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {secret}"}, timeout=60)
        alpha_jobs = []
        for _ in range(4):
            created = teams["alpha"].post("/jobs", json=LONG)
            assert created.status_code == 202, created.text
            alpha_jobs.append(created.json()["id"])
        wait_until(lambda: sum(admin.get(f"/jobs/{j}").json()["status"] == "running" for j in alpha_jobs) == 2,
                   timeout=180, what="alpha's first two jobs on both devices")
        backlog = [j for j in alpha_jobs if admin.get(f"/jobs/{j}").json()["status"] == "queued"]
        assert len(backlog) == 2
        beta_job = teams["beta"].post("/jobs", json=LONG).json()["id"]

        started = wait_for_job(admin, beta_job, {"running", "succeeded", "failed"}, timeout=300)
        assert started["status"] in ("running", "succeeded"), started
        # When beta's job started, alpha's backlog was still waiting: no job of it started before beta's.
        for job_id in backlog:
            job = admin.get(f"/jobs/{job_id}").json()
            assert job["started_at"] is None or job["started_at"] > started["started_at"], (job_id, job["started_at"])

        # Within alpha, a high-priority job goes ahead of its normal ones still waiting.
        urgent = teams["alpha"].post("/jobs", json={**LONG, "priority": "high"}).json()
        assert urgent["priority"] == "high"
        waiting = [j for j in backlog if admin.get(f"/jobs/{j}").json()["status"] == "queued"]
        assert waiting, "alpha's backlog started before the high-priority job was sent: make the jobs longer"
        first = wait_for_job(admin, urgent["id"], {"running", "succeeded", "failed"}, timeout=300)
        for job_id in waiting:
            job = admin.get(f"/jobs/{job_id}").json()
            assert job["started_at"] is None or job["started_at"] > first["started_at"], (job_id, job["started_at"])
        alpha_jobs.append(urgent["id"])
        for job_id in [*alpha_jobs, beta_job]:  # what is left is not the test's: stop it
            admin.post(f"/jobs/{job_id}/cancel")
        for client in teams.values():
            client.close()
    finally:
        admin.close()
        procs.stop_all()
        flush(url)
