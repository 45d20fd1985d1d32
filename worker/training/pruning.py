"""A sweep's trial judged after each epoch: the epoch's value of the sweep's metric is reported to
the study as the trial's intermediate value, and the sweep's pruner (made again from the sweep's
record: Optuna does not store it with the study) says whether the trial stops here.

A pruned trial stops like early stopping does (worker/training/trainer.py): its job ends
`succeeded` with the best epoch's weights and a `stop_reason` that says it was pruned, which is how
the coordinator (core/sweeps/coordinator.py) knows to tell the study PRUNED; its device is free for
the next trial. Optuna is loaded only for a trial's job. A study that cannot be reached (a Redis
outage) prunes nothing: the trial trains on and is judged whole."""

from __future__ import annotations

import logging

import redis

from core.schemas import Job
from worker.training.trainer import EpochJudge

log = logging.getLogger(__name__)


def trial_judge(job: Job, redis_url: str, client: redis.Redis) -> EpochJudge | None:
    """The judge of a sweep's trial, or None for any other job (and for a sweep without a pruner)."""
    if job.sweep_id is None or job.trial is None:
        return None
    from core.errors import NotFound
    from core.sweeps.records import SweepRecords
    from core.sweeps.spec import SweepSpec, pruned_reason

    try:
        spec = SweepSpec.model_validate_json(SweepRecords(client).get(job.sweep_id)["spec"])
    except NotFound:
        return None
    if spec.pruner == "none":
        return None
    sweep_id, number = job.sweep_id, job.trial

    def judge(epoch: int, values: dict[str, float | None]) -> str | None:
        from core.sweeps import study

        value = values.get(spec.metric)
        if value is None:
            return None
        try:
            prune = study.should_prune(redis_url, sweep_id, spec, number, epoch, value)
        except Exception as exc:  # the study is away: train on, the trial is judged when it ends
            log.warning("job %s: trial %d of sweep %s not judged after epoch %d (%s: %s)", job.id, number,
                        sweep_id, epoch, type(exc).__name__, exc)
            return None
        return pruned_reason(spec.pruner, epoch, spec.metric, value) if prune else None

    return judge
