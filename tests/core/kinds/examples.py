"""Typed params of every kind, as its submitter would resolve them, for tests that create jobs through
the job store itself (JobStore.create takes a kind's params, never a raw dict)."""

from __future__ import annotations

from typing import Any

from core.kinds import BatchPredictParams, EvaluateParams, ExportParams, KindParams, TrainingParams
from core.kinds.train import JobSpec, resolve_params
from core.schemas import ExportFormat, JobKind


def train_params(**fields: Any) -> TrainingParams:
    """A cifar_net job on `fake`, with `fields` of its JobSpec as asked."""
    return resolve_params(JobSpec(**{"model": "cifar_net", "dataset": "fake", **fields}))


def params_for(kind: JobKind, source: str = "trained") -> KindParams:
    """Params of `kind`; `source` is the training job an evaluation, a batch prediction or an export reads."""
    if kind is JobKind.train:
        return train_params(epochs=1)
    if kind is JobKind.evaluate:
        return EvaluateParams(trained_job=source)
    if kind is JobKind.batch_predict:
        return BatchPredictParams(trained_job=source)
    return ExportParams(source_job_id=source, format=ExportFormat.onnx, checkpoint_sha256="ab" * 32)
