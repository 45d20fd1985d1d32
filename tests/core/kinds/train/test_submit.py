"""Accepting a training job (core/kinds/train/submit.py) against a real Redis and data dir: what is
stored is the resolution of the request, a retry gets its job, and what a worker would only trip
over later is refused at once, saying why."""

from __future__ import annotations

import io

import pytest

from core.errors import InvalidInput
from core.kinds.train import JobSpec, TrainingParams, resolve_params
from core.kinds.train.submit import JobSubmission
from core.schemas import Device, JobStatus
from tests.core.kinds.conftest import World
from tests.datagen import shapes_zip


def _submit(world: World, key: str | None = None, **fields):
    spec = JobSpec(**{"model": "cifar_net", "dataset": "fake", "epochs": 1, **fields})
    return JobSubmission(*world.parts).submit(spec, key)


def test_the_job_stores_its_resolved_params_and_a_retry_gets_it(world: World) -> None:
    job, created = _submit(world, "k1", batch_size=32)
    assert created and job.status is JobStatus.queued
    assert TrainingParams.of(world.store.get(job.id)) == resolve_params(
        JobSpec(model="cifar_net", dataset="fake", epochs=1, batch_size=32))
    again, created_again = _submit(world, "k1", batch_size=32)
    assert again.id == job.id and not created_again


def test_a_child_starts_from_a_succeeded_parent_of_the_same_architecture(world: World) -> None:
    child, _ = _submit(world, init_from=world.trained)
    assert TrainingParams.of(child).init_from == world.trained and child.model == "cifar_net"
    with pytest.raises(InvalidInput, match="trained cifar_net, this job trains resnet18"):
        _submit(world, model="resnet18", init_from=world.trained)
    with pytest.raises(InvalidInput, match="is queued; only a succeeded job's weights"):
        _submit(world, init_from=child.id)
    with pytest.raises(InvalidInput, match="job 'nope' does not exist"):
        _submit(world, init_from="nope")
    world.paths.final(world.trained).unlink()
    with pytest.raises(InvalidInput, match="no longer on this server"):
        _submit(world, init_from=world.trained)


def test_what_a_worker_would_trip_over_is_refused(world: World) -> None:
    with pytest.raises(InvalidInput, match="unknown model 'resnet19'"):
        _submit(world, model="resnet19")
    with pytest.raises(InvalidInput, match="leaves no training image"):
        _submit(world, dataset=world.shapes.id, val_fraction=0.95)
    with pytest.raises(InvalidInput, match="unknown device"):
        _submit(world, device="h9/cuda:3")


def test_a_gang_larger_than_the_devices_of_its_type_is_refused(world: World) -> None:
    for host in ("h1", "h2"):
        world.devices.acquire(f"{host}/cpu", f"instance-{host}")
        world.devices.publish(f"{host}/cpu", f"instance-{host}", Device(
            id=f"{host}/cpu", type="cpu", index=None, name="cpu", memory_total_bytes=None, memory_used_bytes=None,
            utilization_percent=None, worker=f"cpu@{host}", status="idle", current_job=None, loaded_models=[],
            last_heartbeat="2026-01-01T00:00:00+00:00"))
    gang, _ = _submit(world, batch_size=64, world_size=2, device="cpu")
    assert gang.world_size == 2
    with pytest.raises(InvalidInput, match="world_size 3 needs 3 CPU devices, one worker each; 2 exist"):
        _submit(world, batch_size=63, world_size=3, device="cpu")


def test_an_unlabelled_set_cannot_be_trained_on(world: World) -> None:
    loose = world.catalog.upload(io.BytesIO(shapes_zip(per_class=2, corrupt=None)), "loose", labeled=False)
    with pytest.raises(InvalidInput, match="is unlabelled"):
        _submit(world, dataset=loose.id)
