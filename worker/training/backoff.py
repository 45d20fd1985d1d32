"""Running out of memory on a GPU: fewer images per forward pass, then a pause, then giving up.

A training step's batch is split into micro-batches of `size` images whose gradients accumulate
into one optimizer step, so a smaller micro-batch changes memory, not the training: the batch, the
number of steps and the learning-rate schedule stay what the job asked for. On each
`torch.OutOfMemoryError` the micro-batch halves, down to `floor`. At the floor the step is retried
after a pause a few times: the memory may have been held for a moment by something else on the
same GPU (the worker's own /predict thread shares the device and its caching allocator); only then
does the job fail, with a message that says what it tried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from worker.runtime.job_context import JobFailed

log = logging.getLogger(__name__)

MICRO_BATCH_FLOOR = 8  # below this, BatchNorm statistics get noisy and the GPU idles
RETRIES_AT_FLOOR = 3
PAUSE_S = 1.0  # × the retry number: 1 s, 2 s, 3 s


class BatchBackoff:
    def __init__(self, size: int, what: str, *, notify: Callable[[str, dict[str, Any]], None],
                 release: Callable[[], None], floor: int = MICRO_BATCH_FLOOR, retries_at_floor: int = RETRIES_AT_FLOOR,
                 pause_s: float = PAUSE_S) -> None:
        self.size = size
        self.what = what  # "training" or "evaluation": said in the messages
        self.floor = min(floor, size)
        self.retries_at_floor = retries_at_floor
        self.pause_s = pause_s
        self.retries = 0
        self._notify = notify
        self._release = release

    def out_of_memory(self, error: str) -> None:
        """Called after a step failed with torch.OutOfMemoryError (outside the `except`, so the failed
        step's tensors are already freed): shrink or pause, or raise JobFailed when nothing is left."""
        self._release()
        if self.size > self.floor:
            before, self.size = self.size, max(self.floor, self.size // 2)
            self.retries = 0
            self._notify(f"out of memory in {self.what} at {before} images per pass: retrying with {self.size}",
                         {"micro_batch": self.size, "was": before, "error": error[:300]})
            return
        if self.retries < self.retries_at_floor:
            self.retries += 1
            pause = self.pause_s * self.retries
            self._notify(f"out of memory in {self.what} at {self.size} images per pass (the floor): retry "
                         f"{self.retries}/{self.retries_at_floor} in {pause:.0f} s",
                         {"micro_batch": self.size, "retry": self.retries, "error": error[:300]})
            time.sleep(pause)
            return
        raise JobFailed(f"out of memory in {self.what} even at {self.size} images per pass after "
                        f"{self.retries_at_floor} retries: lower batch_size or image_size, or free the GPU "
                        f"({error[:500]})")

    def succeeded(self) -> None:
        self.retries = 0
