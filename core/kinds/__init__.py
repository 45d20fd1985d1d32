"""Job kinds, the API's side: one package per kind, named as its handler is on the worker's side
(worker/kinds/), each with what its kind needs of these:

- `spec`: the request (what POST takes), when the kind has one of its own;
- `params`: the typed params its record stores (a `KindParams`: what the rest of the system asks
  of any job, the batch rules among them), and their resolution when it is short;
- `resolution`: the resolution, when it is long (train: every default decided once, at submit);
- `submit`: its submitter, which checks a request against the world and creates the job.

`train/`, `evaluate/`, `batch_predict/` (wire value "predict": the HTTP contract keeps it; in
code it is a batch prediction, so "predict" alone means /predict) and `export/`. What they share
is here: `submitter.py` (the `Submitter` base), `params.py` (the `KindParams` base), `request.py`
(what POST /jobs accepts: train or batch_predict), and `params_of`, the one reader of a job's
params by its kind.
"""

from __future__ import annotations

from core.kinds.batch_predict.params import BatchPredictParams
from core.kinds.evaluate.params import EvaluateParams
from core.kinds.export.params import ExportParams
from core.kinds.params import KindParams
from core.kinds.train.params import TrainingParams
from core.schemas import Job, JobKind

JobParams = TrainingParams | EvaluateParams | BatchPredictParams | ExportParams
PARAMS: dict[JobKind, type[KindParams]] = {
    JobKind.train: TrainingParams,
    JobKind.evaluate: EvaluateParams,
    JobKind.batch_predict: BatchPredictParams,
    JobKind.export: ExportParams,
}


def params_of(job: Job) -> JobParams:
    """`job`'s params, read as its kind's model (every default its record lacks filled in as that
    kind reads it back)."""
    params = PARAMS[job.kind].of(job)
    assert isinstance(params, JobParams)
    return params


__all__ = ["PARAMS", "BatchPredictParams", "EvaluateParams", "ExportParams", "JobParams", "KindParams",
           "TrainingParams", "params_of"]
