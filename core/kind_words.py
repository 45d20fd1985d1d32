"""A job's kind in a sentence: `a training job`, `an evaluation of job X`. Error messages name what
a job is in the user's words (never `a evaluate job`), and for a job made from a trained one, which
job that is, so the user knows the id to use instead."""

from __future__ import annotations

from typing import Any

from core.schemas import JobKind

_NOUNS = {JobKind.train: "a training job", JobKind.evaluate: "an evaluation job",
          JobKind.batch_predict: "a batch prediction job", JobKind.export: "an export job"}
_OF = {JobKind.evaluate: "an evaluation", JobKind.batch_predict: "a batch prediction", JobKind.export: "an export"}


def kind_noun(kind: JobKind | str) -> str:
    """`a training job`, `an evaluation job`, ... for a kind (its enum or its wire value)."""
    return _NOUNS[JobKind(kind)]


def job_phrase(kind: JobKind | str, params: dict[str, Any] | None) -> str:
    """What a job is, with the trained job it was made from when its params name one:
    `an evaluation of job j123`, else `kind_noun`."""
    kind = JobKind(kind)
    params = params or {}
    source = params.get("trained_job") or params.get("source_job_id")
    if kind in _OF and isinstance(source, str):
        return f"{_OF[kind]} of job {source}"
    return kind_noun(kind)
