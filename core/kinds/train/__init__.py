"""The `train` kind: a model from a dataset → a checkpoint (worker/kinds/train.py runs it).

- `spec`: what POST /jobs takes (`JobSpec`);
- `params`: what the job stores (`TrainingParams`) and the rules read from it (its batch on a
  device type, its validation batch, its schedule);
- `resolution`: a spec into params, every default decided once, at submit;
- `submit`: the submitter (`JobSubmission`): a request checked against the models, datasets,
  devices, earlier jobs and memory we have, resolved, and created.
"""

from core.kinds.train.params import TrainingParams
from core.kinds.train.resolution import resolve_params
from core.kinds.train.spec import JobSpec

__all__ = ["JobSpec", "TrainingParams", "resolve_params"]
