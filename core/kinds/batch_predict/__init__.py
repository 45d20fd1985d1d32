"""The `batch_predict` kind (wire value "predict"): a trained job's model over every image of an
uploaded dataset → a JSON-lines results file (worker/kinds/batch_predict.py runs it).

- `spec`: what POST /jobs with `"kind": "predict"` takes (`BatchPredictSpec`);
- `params`: what the job stores (`BatchPredictParams`) and their resolution at submit (`resolve`);
- `submit`: the submitter (`BatchPredictions`): the trained job (by id, or an alias resolved once),
  the uploaded dataset and top-k checked, the job created; where its results file is.
"""

from core.kinds.batch_predict.params import BatchPredictParams
from core.kinds.batch_predict.spec import BatchPredictSpec

__all__ = ["BatchPredictParams", "BatchPredictSpec"]
