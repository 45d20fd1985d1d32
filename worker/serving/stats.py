"""What the serving engine has done, for the heartbeat (GET /devices → device.inference) and /metrics."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class InferenceStats:
    """Batches served and failed, by the stages that serve and fail them (from several threads)."""

    def __init__(self, cache_stats: Callable[[], dict[str, Any]]) -> None:
        self.cache_stats = cache_stats
        self._lock = threading.Lock()
        self.batches = 0
        self.images = 0
        self.max_batch = 0
        self.errors = 0
        self.histogram: dict[int, int] = defaultdict(int)
        self.forward_threads = 0  # a CPU device's torch threads for the forward now (0: not a CPU device)

    def failed(self) -> None:
        """A batch that could not be served (the intake and the device loop both count them)."""
        with self._lock:
            self.errors += 1

    def record(self, size: int) -> None:
        with self._lock:
            self.batches += 1
            self.images += size
            self.max_batch = max(self.max_batch, size)
            self.histogram[size] += 1

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"batches": self.batches, "images": self.images, "max_batch": self.max_batch,
                    "errors": self.errors, "forward_threads": self.forward_threads,
                    "batch_size_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
                    "cache": self.cache_stats()}
