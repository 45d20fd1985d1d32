"""An evaluate job's params (core/kinds/evaluate/params.py): resolved once at submit, the same batch
on every device type, and a record from before the batch was resolved read back with the default."""

from __future__ import annotations

from core.defaults import EVAL_BATCH
from core.kinds.evaluate import EvaluateParams, EvaluateSpec
from core.kinds.evaluate.params import resolve


def test_the_batch_is_resolved_at_submit_and_the_same_on_every_device_type() -> None:
    left_open = resolve("trained", EvaluateSpec(dataset="fake"))
    assert left_open == EvaluateParams(trained_job="trained", batch_size=EVAL_BATCH)
    asked = resolve("trained", EvaluateSpec(dataset="fake", batch_size=40))
    assert [asked.batch_for(t) for t in ("cuda", "cpu")] == [40, 40] == [asked.eval_batch_for(t) for t in ("cuda", "cpu")]


def test_an_older_record_without_a_batch_reads_back_with_the_default() -> None:
    assert EvaluateParams.model_validate({"trained_job": "t", "batch_size": None}).batch_size == EVAL_BATCH
    assert EvaluateParams.model_validate({"trained_job": "t"}).batch_for("cpu") == EVAL_BATCH
