"""What POST /jobs accepts: a training job (the default kind) or a batch-prediction job, told apart
by `kind` (which a training job may leave out)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Tag

from core.kinds.predict import PredictSpec
from core.kinds.train import JobSpec
from core.schemas import JobKind


def _spec_kind(value: Any) -> str:
    kind = value.get("kind", JobKind.train) if isinstance(value, dict) else getattr(value, "kind", JobKind.train)
    return str(kind.value if isinstance(kind, JobKind) else kind)


JobRequest = Annotated[Annotated[JobSpec, Tag(JobKind.train.value)] | Annotated[PredictSpec, Tag(JobKind.predict.value)],
                       Discriminator(_spec_kind)]
