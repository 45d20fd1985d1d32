"""A batch prediction's request and params (core/kinds/batch_predict/): exactly one model named, the
batch left to the device type when the job leaves it open, and what the dataset tells at submit."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.datasets import DatasetRecord
from core.defaults import PREDICT_BATCH_SIZE, TOP_K
from core.kinds.batch_predict import BatchPredictParams, BatchPredictSpec
from core.kinds.batch_predict.params import resolve
from core.schemas import JobKind

LOOSE = DatasetRecord(id="dsloose", name="loose", kind="upload", num_images=12, labeled=False)


def test_it_names_one_model_by_job_or_alias_under_the_wire_kind() -> None:
    assert BatchPredictSpec.model_validate({"kind": "predict", "alias": "pets", "dataset": "d"}).alias == "pets"
    for both_or_none in ({"job_id": "j", "alias": "pets"}, {}):
        with pytest.raises(ValidationError, match="exactly one of job_id and alias"):
            BatchPredictSpec.model_validate({"kind": JobKind.batch_predict.value, "dataset": "d", **both_or_none})


def test_the_batch_is_the_jobs_else_its_device_types() -> None:
    left_open = resolve("trained", BatchPredictSpec(kind=JobKind.batch_predict, alias="pets", dataset="d"), LOOSE)
    assert left_open == BatchPredictParams(trained_job="trained", alias="pets", top_k=TOP_K, labeled=False, images=12)
    assert [left_open.batch_for(t) for t in ("cuda", "cpu")] == [PREDICT_BATCH_SIZE["cuda"], PREDICT_BATCH_SIZE["cpu"]]
    assert left_open.eval_batch_for("cpu") == PREDICT_BATCH_SIZE["cpu"]  # every forward is an evaluation's
    asked = resolve("trained", BatchPredictSpec(kind=JobKind.batch_predict, job_id="j", dataset="d", batch_size=9),
                    LOOSE)
    assert (asked.batch_for("cuda"), asked.batch_for("cpu"), asked.alias) == (9, 9, None)
