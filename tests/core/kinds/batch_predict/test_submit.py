"""Batch predictions (core/kinds/batch_predict/submit.py) against a real Redis and data dir: a job
over an uploaded dataset, naming the trained job directly or through an alias resolved once; what
it cannot do is refused saying why, and its results are there only once it succeeded."""

from __future__ import annotations

import pytest

from core.aliases import AliasStore, Caller
from core.errors import Conflict, InvalidInput, NotFound
from core.kinds.batch_predict import BatchPredictParams, BatchPredictSpec
from core.kinds.batch_predict.submit import BatchPredictions, results_path
from core.schemas import JobKind, JobStatus
from tests.core.kinds.conftest import World


def _spec(**fields) -> BatchPredictSpec:
    return BatchPredictSpec(**{"kind": JobKind.batch_predict, **fields})


def test_an_alias_is_resolved_once_at_submit(world: World) -> None:
    AliasStore(world.store.redis).move("pets", world.trained, Caller())
    job, created = BatchPredictions(*world.parts).submit(_spec(alias="pets", dataset="shapes", top_k=3), "k")
    assert created and job.kind is JobKind.batch_predict and world.store.raw_field(job.id, "kind") == "predict"
    assert BatchPredictParams.of(job) == BatchPredictParams(trained_job=world.trained, alias="pets", top_k=3,
                                                            labeled=True, images=world.shapes.num_images)


def test_what_it_cannot_do_is_refused(world: World) -> None:
    submit = BatchPredictions(*world.parts).submit
    with pytest.raises(InvalidInput, match="top_k 11 is more than the 10 classes"):
        submit(_spec(job_id=world.trained, dataset=world.shapes.id, top_k=11))
    with pytest.raises(InvalidInput, match="dataset fake is built in"):
        submit(_spec(job_id=world.trained, dataset="fake"))
    with pytest.raises(NotFound):
        submit(_spec(alias="nobody", dataset=world.shapes.id))


def test_its_results_are_there_once_it_succeeded(world: World) -> None:
    predictions = BatchPredictions(*world.parts)
    job, _ = predictions.submit(_spec(job_id=world.trained, dataset=world.shapes.id))
    with pytest.raises(Conflict, match="is queued"):
        predictions.results_file(job.id)
    with pytest.raises(NotFound, match="is a training job; only batch prediction jobs have results"):
        predictions.results_file(world.trained)
    world.succeeded(job.id, [])
    results_path(world.paths, job.id).write_text('{"file": "a.png"}\n')
    assert predictions.results_file(job.id)[1] == results_path(world.paths, job.id)
    assert world.store.get(job.id).status is JobStatus.succeeded
