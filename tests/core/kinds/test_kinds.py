"""core/kinds' face: every job's params are read as its kind's model by one reader (`params_of`), a
job stored through the real job store reads back as the params it was created with, and POST /jobs'
request tells a training job from a batch prediction by `kind` (whose wire value stays "predict")."""

from __future__ import annotations

import pytest
import redis
from pydantic import TypeAdapter

from core.defaults import EPOCHS, EVAL_BATCH, EXPORT_PARITY_IMAGES, PREDICT_BATCH_SIZE, TRAIN_BATCH_SIZE
from core.jobs import JobStore
from core.kind_words import kind_noun
from core.kinds import PARAMS, BatchPredictParams, EvaluateParams, ExportParams, TrainingParams, params_of
from core.kinds.batch_predict import BatchPredictSpec
from core.kinds.request import JobRequest
from core.kinds.train import JobSpec
from core.queue import queue_for_device
from core.schemas import JobKind
from tests.core.kinds.examples import params_for, train_params


@pytest.mark.parametrize("kind", list(JobKind))
def test_a_job_reads_back_as_the_params_of_its_kind(clean_redis_url: str, kind: JobKind) -> None:
    store = JobStore(redis.Redis.from_url(clean_redis_url, decode_responses=True), lambda delivery: None)
    params = params_for(kind)
    job, _ = store.create(model="cifar_net", dataset="fake", params=params, requested_device="auto")
    read = store.get(job.id)
    assert read.kind is kind  # the kind is the params' own
    assert params_of(read) == params and type(params_of(read)) is PARAMS[kind]
    assert PARAMS[kind].of(read) == params
    others = [cls for other, cls in PARAMS.items() if other is not kind]
    for cls in others:
        with pytest.raises(ValueError, match=f"is {kind_noun(kind)}"):
            cls.of(read)


def test_the_store_queues_a_gang_by_its_params_and_counts_its_epochs(clean_redis_url: str) -> None:
    store = JobStore(redis.Redis.from_url(clean_redis_url, decode_responses=True), lambda delivery: None)
    gang, _ = store.create(model="cifar_net", dataset="fake", params=train_params(epochs=3, batch_size=64, world_size=2),
                           requested_device="cpu")
    assert store.raw_field(gang.id, "queue") == queue_for_device("cpu", 2) != queue_for_device("cpu")
    assert gang.progress.epochs == 3 and gang.world_size == 2
    evaluation, _ = store.create(model="cifar_net", dataset="fake", params=EvaluateParams(trained_job="t"),
                                 requested_device="cpu")
    assert store.raw_field(evaluation.id, "queue") == queue_for_device("cpu") and evaluation.progress.epochs == 0


def test_every_kind_answers_the_same_questions_from_the_defaults_table() -> None:
    """The batch on each device type and the evaluation batch (a kind left to its defaults takes
    core/defaults.py's), the devices it runs on at once and the epochs its progress counts."""
    export = ExportParams(source_job_id="t", format="onnx", checkpoint_sha256="ab" * 32)
    answers = [  # kind's params: (batch on cuda, on cpu), (evaluation batch on cuda, on cpu)
        (train_params(), ((TRAIN_BATCH_SIZE["cuda"], TRAIN_BATCH_SIZE["cpu"]),
                         (max(TRAIN_BATCH_SIZE["cuda"], EVAL_BATCH), max(TRAIN_BATCH_SIZE["cpu"], EVAL_BATCH)))),
        (EvaluateParams(trained_job="t"), ((EVAL_BATCH, EVAL_BATCH), (EVAL_BATCH, EVAL_BATCH))),
        (BatchPredictParams(trained_job="t"), ((PREDICT_BATCH_SIZE["cuda"], PREDICT_BATCH_SIZE["cpu"]),
                                               (PREDICT_BATCH_SIZE["cuda"], PREDICT_BATCH_SIZE["cpu"]))),
        (export, ((EXPORT_PARITY_IMAGES, EXPORT_PARITY_IMAGES), (EXPORT_PARITY_IMAGES, EXPORT_PARITY_IMAGES))),
    ]
    for params, (batch, evaluation) in answers:
        assert (params.batch_for("cuda"), params.batch_for("cpu")) == batch, params
        assert (params.eval_batch_for("cuda"), params.eval_batch_for("cpu")) == evaluation, params
        assert params.gang_size == 1
        assert params.total_epochs == (EPOCHS if isinstance(params, TrainingParams) else 0)


def test_post_jobs_tells_a_batch_prediction_by_its_wire_kind() -> None:
    request: TypeAdapter = TypeAdapter(JobRequest)
    assert isinstance(request.validate_python({"model": "cifar_net", "dataset": "fake"}), JobSpec)
    batch = request.validate_python({"kind": "predict", "job_id": "j", "dataset": "d"})
    assert isinstance(batch, BatchPredictSpec) and batch.kind is JobKind.batch_predict
    assert JobKind("predict") is JobKind.batch_predict and JobKind.batch_predict.value == "predict"
    with pytest.raises(ValueError):
        request.validate_python({"kind": "batch_predict", "job_id": "j", "dataset": "d"})  # the code's name is not the wire's
