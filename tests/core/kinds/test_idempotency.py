"""An Idempotency-Key at every entry that takes one (a training job, a batch prediction, an
evaluation: core/kinds/*/submit.py, the API's POST /jobs and POST /jobs/{id}/evaluate): the same
body again gets the first job; another body under the used key is refused (the API's 422), naming
the first job, whether the retry is answered by the replay of the body as sent
(core/jobs/intake.JobStore.replay) or by the create that checks the resolved request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from core.errors import InvalidInput
from core.kinds.batch_predict import BatchPredictSpec
from core.kinds.batch_predict.submit import BatchPredictions
from core.kinds.evaluate import EvaluateSpec
from core.kinds.evaluate.submit import Evaluations
from core.kinds.train import JobSpec
from core.kinds.train.submit import JobSubmission
from core.schemas import JobKind
from tests.core.kinds.conftest import World

Entry = Callable[[World, dict[str, Any], str], tuple[Any, bool]]


def _train(world: World, body: dict[str, Any], key: str) -> tuple[Any, bool]:
    return JobSubmission(*world.parts).submit(JobSpec(model="cifar_net", dataset="fake", **body), key)


def _batch_predict(world: World, body: dict[str, Any], key: str) -> tuple[Any, bool]:
    spec = BatchPredictSpec(kind=JobKind.batch_predict, job_id=world.trained, dataset=world.shapes.id, **body)
    return BatchPredictions(*world.parts).submit(spec, key)


def _evaluate(world: World, body: dict[str, Any], key: str) -> tuple[Any, bool]:
    return Evaluations(*world.parts).submit(world.trained, EvaluateSpec(dataset="fake", **body), key)


# Each entry, a body, and another body that asks for a different job.
ENTRIES: dict[str, tuple[Entry, dict[str, Any], dict[str, Any]]] = {
    "train": (_train, {"epochs": 1}, {"epochs": 2}),
    "batch_predict": (_batch_predict, {"top_k": 1}, {"top_k": 3}),
    "evaluate": (_evaluate, {"batch_size": 32}, {"batch_size": 64}),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_another_body_under_a_used_key_is_refused_naming_the_first_job(world: World, entry: str) -> None:
    submit, body, other = ENTRIES[entry]
    first, created = submit(world, body, "used-key")
    again, created_again = submit(world, body, "used-key")
    assert created and not created_again and again.id == first.id, f"{entry}: a retry of the same body got another job"
    try:
        answered, _ = submit(world, other, "used-key")
    except InvalidInput as refused:
        detail = refused.detail
    else:
        raise AssertionError(f"{entry}: another body under a used Idempotency-Key was answered with job {answered.id} "
                             f"(the first: {first.id}) instead of being refused")
    assert "already used for a different request" in detail and first.id in detail, (
        f"{entry}: another body under a used Idempotency-Key was not refused naming the first job: {detail}")
    assert submit(world, other, "a-new-key")[1], f"{entry}: the other body under a new key was not accepted"
