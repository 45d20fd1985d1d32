"""Out-of-memory back-off (worker/training/backoff.py): the micro-batch halves down to its floor, then
the step is retried at the floor with growing pauses, then the job fails saying what it tried; a
step that succeeds starts the retries afresh."""

from __future__ import annotations

from typing import Any

import pytest

from worker.runtime.job_context import JobFailed
from worker.training.backoff import BatchBackoff


def _backoff(size: int, notices: list[tuple[str, dict[str, Any]]], released: list[int]) -> BatchBackoff:
    return BatchBackoff(size, "training", notify=lambda message, data: notices.append((message, data)),
                        release=lambda: released.append(1), floor=8, retries_at_floor=2, pause_s=0.0)


def test_the_micro_batch_halves_to_its_floor_then_retries_then_fails() -> None:
    notices: list[tuple[str, dict[str, Any]]] = []
    released: list[int] = []
    backoff = _backoff(48, notices, released)
    sizes = []
    for _ in range(3):
        backoff.out_of_memory("CUDA out of memory")
        sizes.append(backoff.size)
    assert sizes == [24, 12, 8]  # halved, never below the floor
    backoff.out_of_memory("CUDA out of memory")
    backoff.out_of_memory("CUDA out of memory")
    assert backoff.size == 8 and backoff.retries == 2
    with pytest.raises(JobFailed, match="out of memory in training even at 8 images per pass after 2 retries"):
        backoff.out_of_memory("CUDA out of memory")
    assert len(released) == 6  # the allocator's cache released before each decision
    assert [data.get("micro_batch") for _, data in notices] == [24, 12, 8, 8, 8]
    assert "retry 2/2" in notices[-1][0]


def test_a_step_that_succeeds_starts_the_retries_afresh_and_a_small_batch_is_its_own_floor() -> None:
    backoff = _backoff(8, [], [])
    backoff.out_of_memory("oom")
    backoff.out_of_memory("oom")
    backoff.succeeded()
    backoff.out_of_memory("oom")
    assert backoff.retries == 1 and backoff.size == 8
    assert _backoff(5, [], []).floor == 5
