"""Host buffers used in turn to stage data for a device: the one ring both training
(worker/training/staging.StagedBatches) and serving (worker/serving/batching.HostStaging) copy through.

Whether copies run behind the host is decided here, once, from the device (`copies_run_behind`):
only a copy to a CUDA device can, and only from pinned (page-locked) memory, since
`non_blocking=True` is asynchronous from pinned memory alone. So on a CUDA device the buffers are
pinned, and an event recorded after each copy guards its buffer: a buffer is handed out again only
once the copy out of it has completed, `count` uses later, so the host fills the next buffers while
the device still reads the previous one. Elsewhere (the CPU) a copy is done when `.to()` returns:
the same rotation runs with plain buffers and no events, which is how the CPU tests exercise it.
The CUDA calls (pin_memory, Event.record, Event.synchronize) are listed in docs/gpu.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


def copies_run_behind(device: torch.device) -> bool:
    """Whether a copy from host memory to `device` can run behind the host (asynchronously): on a
    CUDA device, from pinned memory. What pins the buffers and arms their events."""
    return device.type == "cuda"


class PinnedRing(Generic[T]):
    def __init__(self, make: Callable[[bool], T], device: torch.device, count: int) -> None:
        """`make(pinned)` builds one slot's buffers (allocated pinned when `pinned`)."""
        self.device = device
        self.behind = copies_run_behind(device)  # the copies out of a slot may still run when it comes round
        self.slots = [make(self.behind) for _ in range(count)]
        # Per slot, the event recorded after the copies out of it (None: nothing to wait for).
        self.copied: list[torch.cuda.Event | None] = [None] * count
        self.slot = -1  # the slot handed out last

    def next(self) -> T:
        """The next slot's buffers, once the copy out of them, `count` uses ago, has completed."""
        self.slot = (self.slot + 1) % len(self.slots)
        copied = self.copied[self.slot]
        if copied is not None:
            copied.synchronize()
        return self.slots[self.slot]

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A copy on the device of `host` (a view of the current slot's buffers): asynchronous when
        copies run behind, and a real copy on the CPU too (`copy=True`: `.to()` would otherwise hand
        back the buffer itself, which a later use of the slot overwrites)."""
        return host.to(self.device, non_blocking=self.behind, copy=True)

    def copies_issued(self) -> None:
        """The copies out of the current slot are queued (on the current stream): guard it until done."""
        if self.behind:
            event = torch.cuda.Event()
            event.record()
            self.copied[self.slot] = event
