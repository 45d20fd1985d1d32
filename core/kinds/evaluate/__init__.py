"""The `evaluate` kind: a trained job's checkpoint measured on a labelled dataset → accuracy, loss,
per-class accuracy, confusion matrix (worker/kinds/evaluate.py runs it).

- `spec`: what POST /jobs/{id}/evaluate takes (`EvaluateSpec`);
- `params`: what the job stores (`EvaluateParams`) and their resolution at submit (`resolve`);
- `submit`: the submitter (`Evaluations`): the request checked against the trained job and the
  dataset, the job created, and the trained job's index of its evaluations.
"""

from core.kinds.evaluate.params import EvaluateParams
from core.kinds.evaluate.spec import EvaluateSpec

__all__ = ["EvaluateParams", "EvaluateSpec"]
