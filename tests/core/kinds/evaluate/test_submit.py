"""Evaluations (core/kinds/evaluate/submit.py) against a real Redis and data dir: an evaluation of a
trained job's checkpoint is a job of its own, listed by the trained job; a dataset it cannot be
measured on, or a job with nothing to measure, is refused saying why."""

from __future__ import annotations

import io

import pytest

from core.errors import Conflict, InvalidInput, NotFound
from core.kinds.evaluate import EvaluateParams, EvaluateSpec
from core.kinds.evaluate.submit import Evaluations
from core.schemas import JobKind, JobStatus
from tests.core.kinds.conftest import World
from tests.core.kinds.examples import train_params
from tests.datagen import shapes_zip


def test_an_evaluation_is_a_job_the_trained_job_lists(world: World) -> None:
    evaluations = Evaluations(*world.parts)
    evaluation, created = evaluations.submit(world.trained, EvaluateSpec(dataset="fake", batch_size=32), "k")
    assert created and evaluation.job_id == world.trained and evaluation.status is JobStatus.queued
    job = world.store.get(evaluation.id)
    assert job.kind is JobKind.evaluate and EvaluateParams.of(job) == EvaluateParams(trained_job=world.trained,
                                                                                     batch_size=32)
    assert evaluations.submit(world.trained, EvaluateSpec(dataset="fake", batch_size=32), "k")[0].id == evaluation.id
    assert [e.id for e in evaluations.list(world.trained)] == [evaluation.id]
    assert evaluations.get(world.trained, evaluation.id).id == evaluation.id
    assert [e.id for e in evaluations.attach(world.store.get(world.trained)).evaluations or []] == [evaluation.id]
    with pytest.raises(NotFound, match=f"has no evaluation {world.trained}"):
        evaluations.get(world.trained, world.trained)  # a job, but not an evaluation of it


def test_a_dataset_it_cannot_be_measured_on_is_refused(world: World) -> None:
    evaluations = Evaluations(*world.parts)
    with pytest.raises(InvalidInput, match=f"has classes the model of job {world.trained} does not: circle, square, triangle"):
        evaluations.submit(world.trained, EvaluateSpec(dataset=world.shapes.id))
    loose = world.catalog.upload(io.BytesIO(shapes_zip(per_class=2, corrupt=None)), "loose", labeled=False)
    with pytest.raises(InvalidInput, match="is unlabelled"):
        evaluations.submit(world.trained, EvaluateSpec(dataset=loose.id))


def test_a_job_without_a_checkpoint_has_nothing_to_measure(world: World) -> None:
    queued, _ = world.store.create(model="cifar_net", dataset="fake", params=train_params(), requested_device="auto")
    with pytest.raises(Conflict):
        Evaluations(*world.parts).submit(queued.id, EvaluateSpec(dataset="fake"))
    with pytest.raises(NotFound):
        Evaluations(*world.parts).submit("nosuchjob", EvaluateSpec(dataset="fake"))
