"""The quotas that hold a job's start (core/access/holds.py), with two real CPU workers on one
Redis and 2 s leases: `running_jobs` and `devices_held` keep a project's second job queued (its
message names the quota) while two devices are free, without a recovery counted or a re-send
logged, and start it when the first ends, also when the first's worker is SIGKILLed mid-job;
`device_seconds_per_day` holds starts and refuses new jobs with a 429 and Retry-After to the next
UTC day. The checks are the statuses observed while the jobs run."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from core.jobs import JobStore
from core.redis import connect
from tests.support import TERMINAL, get_job, submit_cifar, two_hosts, wait_until

pytestmark = pytest.mark.e2e

KEY = "bootstrap-admin-key-for-the-quota-hold-tests"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with two_hosts(tmp_path_factory.mktemp("holds"), TORCHYARD_API_KEY=KEY, TORCHYARD_LEASE_TTL_S="2",
                   TORCHYARD_MAX_ATTEMPTS="5") as hosts:
        yield hosts


def _team(cluster: dict, project: str, quota: dict) -> httpx.Client:
    admin = cluster["client"]
    assert admin.put(f"/projects/{project}", json=quota).status_code == 200
    secret = admin.post("/keys", json={"name": project, "role": "trainer", "project": project}).json()["secret"]
    return httpx.Client(base_url=str(admin.base_url), headers={"Authorization": f"Bearer {secret}"}, timeout=60)


def _watch(client: httpx.Client, job_ids: list[str], timeout: float = 600) -> list[list[dict]]:
    """Every job's record, polled together until all ended: the snapshots, in order."""
    snapshots: list[list[dict]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snapshot = [get_job(client, job_id) for job_id in job_ids]
        snapshots.append(snapshot)
        if all(job["status"] in TERMINAL for job in snapshot):
            return snapshots
        time.sleep(0.2)
    raise AssertionError(f"jobs {job_ids} did not end: {[j['status'] for j in snapshots[-1]]}")


def _one_runs_one_waits(client: httpx.Client, jobs: list[str], quota: str) -> tuple[dict, dict]:
    """Wait until one of two jobs runs and the other waits, queued, with `quota` in its message."""
    def split() -> tuple[dict, dict] | None:
        a, b = (get_job(client, job_id) for job_id in jobs)
        for runs, waits in ((a, b), (b, a)):
            if runs["status"] == "running" and waits["status"] == "queued" and quota in (waits["message"] or ""):
                return runs, waits
        return None

    return wait_until(split, timeout=300, what=f"one job running, the other held for {quota}")


def _recoveries(cluster: dict) -> dict[str, int]:
    return JobStore(connect(cluster["url"])).recovery_stats()


def test_running_jobs_holds_the_second_job_until_the_first_ends(cluster: dict) -> None:
    team = _team(cluster, "solo", {"running_jobs": 1})
    before = _recoveries(cluster)
    first = submit_cifar(team, 1, batch_size=8)
    second = submit_cifar(team, 1, batch_size=8)
    snapshots = _watch(team, [first, second])
    assert all(sum(job["status"] == "running" for job in snap) <= 1 for snap in snapshots), "two ran at once"
    held = [job for snap in snapshots for job in snap
            if job["status"] == "queued" and any(other["status"] == "running" for other in snap)]
    assert held and "running_jobs = 1" in held[-1]["message"], "the second job never waited for the quota"
    done = sorted((get_job(team, job_id) for job_id in (first, second)), key=lambda job: job["started_at"])
    assert [job["status"] for job in done] == ["succeeded", "succeeded"], done
    assert done[1]["started_at"] >= done[0]["finished_at"]
    assert done[1]["attempts"] == 1  # held, not delivered and given back
    assert _recoveries(cluster) == before, "a quota wait counted as a recovery"
    view = team.get("/projects/solo").json()
    assert view["quota"]["running_jobs"] == 1 and view["usage"]["running_jobs"] == 0
    assert view["usage"]["device_seconds_today"] > 0
    team.close()


def test_devices_held_are_given_back_when_the_holder_is_sigkilled(cluster: dict) -> None:
    """A worker SIGKILLed mid-job: its lease expires, the job goes back to the queue, and the place
    it held is free again, so the project's jobs still all run, one device at a time."""
    team = _team(cluster, "pair", {"devices_held": 1})
    jobs = [submit_cifar(team, 2, batch_size=8), submit_cifar(team, 2, batch_size=8)]
    running, _ = _one_runs_one_waits(team, jobs, "devices_held = 1")
    victim = cluster["workers"][running["device"].split("/")[0]]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    snapshots = _watch(team, jobs)
    assert all(sum(job["status"] == "running" for job in snap) <= 1 for snap in snapshots), "two held devices"
    assert [get_job(team, j)["status"] for j in jobs] == ["succeeded", "succeeded"]
    assert get_job(team, running["id"])["attempts"] >= 2  # it was taken back from the dead worker
    assert team.get("/projects/pair").json()["usage"]["devices_held"] == 0
    team.close()


def test_device_seconds_per_day_holds_starts_and_refuses_new_jobs_until_the_next_utc_day(cluster: dict) -> None:
    """One job at a time (running_jobs = 1): a long first job runs, a second waits behind it, the
    admin sets the day's quota of one device-second, and once the project's tally shows it used
    the first is cancelled; the second now waits for the next UTC day. (A 1-epoch first job can
    end in under a second on a fast host, and then the second rightly starts: the long job and
    the cancel make the test hold on any host's speed.)"""
    team = _team(cluster, "daily", {"running_jobs": 1})
    first = submit_cifar(team, 50, batch_size=8)
    wait_until(lambda: get_job(team, first)["status"] == "running", timeout=300, what="the first job running")
    second = submit_cifar(team, 1, batch_size=8)
    daily = {"device_seconds_per_day": 1, "running_jobs": 1}
    assert cluster["client"].put("/projects/daily", json=daily).status_code == 200
    wait_until(lambda: team.get("/projects/daily").json()["usage"]["device_seconds_today"] >= 1.5, timeout=300,
               what="the first job to use the day's device-second")
    assert get_job(team, second)["status"] == "queued"
    assert team.post(f"/jobs/{first}/cancel").status_code == 202
    wait_until(lambda: get_job(team, first)["status"] in TERMINAL, timeout=120, what="the first job to end")
    wait_until(lambda: "device_seconds_per_day = 1" in (get_job(team, second)["message"] or ""), timeout=60,
               what="the second job held for the day's device-seconds")
    assert get_job(team, second)["status"] == "queued"
    refused = team.post("/jobs", json={"model": "cifar_net", "dataset": "fake", "epochs": 1})
    assert refused.status_code == 429, refused.text
    assert "device_seconds_per_day = 1" in refused.json()["detail"] and "daily" in refused.json()["detail"]
    retry = int(refused.headers["retry-after"])
    assert 0 < retry <= 86_401
    assert team.get("/projects/daily").json()["usage"]["device_seconds_today"] >= 1
    # An admin lifting the quota releases the held job (the workers' sweep), which then runs.
    assert cluster["client"].put("/projects/daily", json={"running_jobs": 1}).status_code == 200
    wait_until(lambda: get_job(team, second)["status"] in TERMINAL, timeout=600, what="the held job to run")
    assert get_job(team, second)["status"] == "succeeded"
    team.close()
