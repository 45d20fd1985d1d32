"""Celery tasks: thin entry points into the worker runtime."""

from __future__ import annotations

from celery import shared_task

from core.queue import TRAIN_TASK
from worker.runtime.main import current_runtime


@shared_task(name=TRAIN_TASK, ignore_result=True)
def train(job_id: str, token: str, seat: str | None = None) -> None:
    """A job's delivery; with `seat`, one rank of a data-parallel job (core/gangs/scheduler.py)."""
    current_runtime().runner.run(job_id, token, seat)
