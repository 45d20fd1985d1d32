"""What every kind's params answer, whatever the kind: the base of TrainingParams, EvaluateParams,
BatchPredictParams and ExportParams.

A job record stores its params as JSON (`Job.params`, the HTTP contract's dict); code reads them
only through a kind's model (`TrainingParams.of(job)`, or `core.kinds.params_of(job)` when the
kind is not known in advance), never key by key. Each kind says here what the rest of the system
asks of any job: the batch a device of a type runs it with and its evaluation batch (each kind's
default and rule written once, in its own params), how many devices it trains on at once, and
how many epochs its progress counts.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Self

from pydantic import BaseModel

from core.kind_words import kind_noun
from core.schemas import Job, JobKind


class KindParams(BaseModel):
    """A job's params as its kind stores them (one subclass per kind)."""

    kind: ClassVar[JobKind]

    @classmethod
    def of(cls, job: Job) -> Self:
        """`job`'s params, read as this kind's; ValueError for a job of another kind."""
        if job.kind is not cls.kind:
            raise ValueError(f"job {job.id} is {kind_noun(job.kind)}, not {kind_noun(cls.kind)}")
        return cls.model_validate(job.params)

    @abstractmethod
    def batch_for(self, device_type: str) -> int:
        """Images per step (or per forward) on a device of `device_type` ("cuda" or "cpu")."""

    def eval_batch_for(self, device_type: str) -> int:
        """Images per forward of an evaluation pass (no gradients kept) on a device of that type."""
        return self.batch_for(device_type)

    @property
    def gang_size(self) -> int:
        """Devices the job runs on at once (a data-parallel training job's world size)."""
        return 1

    @property
    def total_epochs(self) -> int:
        """Epochs its progress counts (0: a job without epochs)."""
        return 0
