"""Host buffers used in turn to stage data for a device: the one ring both training
(worker/staging.py) and serving (worker/serving/batching.py) copy through.

On a GPU the buffers are pinned (page-locked), so the copy to the device can be asynchronous
(`non_blocking=True` is only asynchronous from pinned memory), and an event recorded after each
copy guards its buffer: a buffer is handed out again only once the copy out of it has completed,
`count` uses later, so the host fills the next buffers while the device still reads the previous
one. On a CPU (no pinned memory, no events) the same rotation runs with plain buffers; a copy is
done when `.to()` returns. The CUDA calls (pin_memory, Event.record, Event.synchronize) are
listed in docs/gpu.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class PinnedRing(Generic[T]):
    def __init__(self, make: Callable[[bool], T], pinned: bool, count: int) -> None:
        """`make(pinned)` builds one slot's buffers (allocated pinned when `pinned`)."""
        self.pinned = pinned
        self.slots = [make(pinned) for _ in range(count)]
        self._copied: list[torch.cuda.Event | None] = [None] * count
        self._slot = -1

    def next(self) -> T:
        """The next slot's buffers, once the copy out of them, `count` uses ago, has completed."""
        self._slot = (self._slot + 1) % len(self.slots)
        copied = self._copied[self._slot]
        if copied is not None:
            copied.synchronize()
        return self.slots[self._slot]

    def copies_issued(self) -> None:
        """The copies out of the current slot are queued (on the current stream): guard it until done."""
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
            self._copied[self._slot] = event
