"""A gang's member inside a worker (worker/gang/member.py), through the job runner that holds it, with a
real Redis, the real gang scheduler and Celery's real messages: the gang side needs of the runner
only the `Runner` protocol (worker/gang/runner.py) and imports nothing of the runtime that builds
it; the job runner is such a runner; and through it a device reserved for a gang gives a
single-device job back to its queue, and a rank's message of an attempt that is over runs nothing
and takes nothing from the attempt that stands."""

from __future__ import annotations

import ast
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from core.config import Settings
from core.datasets import DatasetCatalog
from core.devices import DeviceRegistry, DeviceSlots
from core.gangs import GangRecords, GangScheduler, Seat
from core.jobs import JobStore
from core.kinds.train import JobSpec, resolve_params
from core.queue import create_celery, dispatcher, waiting_task_ids
from core.schemas import Device, JobStatus
from tests.support import REPO
from worker.device.health import DeviceHealth
from worker.device.pinning import WorkerDevice
from worker.gang.member import GangMember, GangServices
from worker.gang.runner import Runner
from worker.runtime.job_runner import JobRunner
from worker.runtime.state import WorkerState


@pytest.fixture
def cluster(clean_redis_url: str, tmp_path: Path) -> Iterator[dict]:
    client = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    settings = Settings(_env_file=None, redis_url=clean_redis_url, data_dir=tmp_path)
    dispatch = dispatcher(create_celery(settings), client)
    store = JobStore(client, dispatch, lease_ttl_s=30, dispatch_grace_s=30)
    registry = DeviceRegistry(client, ttl_s=30)
    scheduler = GangScheduler(client, dispatch, registry.all, reservation_s=30)
    yield {"client": client, "settings": settings, "store": store, "registry": registry, "scheduler": scheduler}
    client.close()


def _live_device(registry: DeviceRegistry, device_id: str) -> None:
    node = device_id.split("/")[0]
    registry.acquire(device_id, f"instance-{device_id}")
    registry.publish(device_id, f"instance-{device_id}", Device(
        id=device_id, type="cpu", index=None, name="cpu", memory_total_bytes=None, memory_used_bytes=None,
        utilization_percent=None, worker=f"cpu@{node}", status="idle", current_job=None, loaded_models=[],
        last_heartbeat="2026-01-01T00:00:00+00:00"))


def _runner(cluster: dict, node: str) -> JobRunner:
    """A worker's job runner as worker/runtime/main.py builds it, gangs included."""
    client, settings, store = cluster["client"], cluster["settings"], cluster["store"]
    device = WorkerDevice("cpu", None, node)
    return JobRunner(settings, device, store, DatasetCatalog(client, settings, store), WorkerState(),
                     health=DeviceHealth(), instance=f"instance-{device.id}", torch_threads=1,
                     gangs=GangServices(DeviceSlots(client, device.id), GangRecords(client), cluster["scheduler"].resend))


def _imports(path: Path) -> set[str]:
    """Every module an import statement in `path` names, at any depth (TYPE_CHECKING and functions too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_the_gang_side_imports_nothing_of_the_runtime_that_builds_it() -> None:
    """The member holds the runner through the protocol: none of worker/gang/ names the job runner,
    the process or its task, so the runtime imports the gang and never the other way round."""
    builders = {"worker.runtime.job_runner", "worker.runtime.main", "worker.runtime.tasks"}
    reached = {f"{path.name}: {name}" for path in sorted((REPO / "worker" / "gang").glob("*.py"))
               for name in _imports(path) if name in builders}
    assert reached == set()


def test_the_job_runner_is_a_runner_for_its_member(cluster: dict) -> None:
    runner = _runner(cluster, "a")
    assert isinstance(runner, Runner)
    assert isinstance(runner.gang, GangMember) and runner.gang.runner is runner
    hints = {name: typing.get_type_hints(getattr(Runner, name).fget) for name in dir(Runner)
             if isinstance(getattr(Runner, name, None), property)}
    assert len(hints) == 10
    for name, hint in hints.items():
        expected = hint["return"]
        value = getattr(runner, name)
        if isinstance(expected, type):
            assert isinstance(value, expected), name
        else:  # a callable the member calls (the cores handed over, the way out of service)
            assert callable(value), name


def test_a_device_reserved_for_a_gang_gives_a_single_job_back_and_a_stale_rank_runs_nothing(cluster: dict) -> None:
    client, store, scheduler = cluster["client"], cluster["store"], cluster["scheduler"]
    for device_id in ("a/cpu", "b/cpu"):
        _live_device(cluster["registry"], device_id)
    params = resolve_params(JobSpec(model="cifar_net", dataset="fake", batch_size=48, world_size=2))
    gang, _ = store.create(model="cifar_net", dataset="fake", params=params, requested_device="cpu")
    gang_token = store.raw_field(gang.id, "delivery") or ""
    assert scheduler.run_once() == [gang.id]
    attempt = GangRecords(client).read(gang.id).attempt  # type: ignore[union-attr]
    runner = _runner(cluster, "a")

    # A single-device job's message reaches the reserved worker: its runner claims nothing and sends
    # the message back to the job's queue for another worker (or this one, after its rank).
    single, _ = store.create(model="cifar_net", dataset="fake", params=resolve_params(JobSpec(model="cifar_net", dataset="fake", epochs=1)),
                             requested_device="auto")
    single_token = store.raw_field(single.id, "delivery") or ""
    client.delete("train")  # the worker took its message
    runner.run(single.id, single_token)
    assert store.get(single.id).status is JobStatus.queued and store.get(single.id).attempts == 0
    assert waiting_task_ids(client, ["train"]) == {f"{single.id}.{single_token}"}
    assert runner.state.current_job is None

    # A rank's message of another attempt: nothing runs, and the reservation of the attempt that
    # stands is still there for its own rank's message.
    runner.run(gang.id, gang_token, Seat(0, "an-attempt-that-is-over").encode())
    assert store.get(gang.id).status is JobStatus.queued and store.get(gang.id).attempts == 0
    slot = DeviceSlots(client, "a/cpu").state()
    assert (slot["state"], slot["job"], slot["attempt"]) == ("reserved", gang.id, attempt)
