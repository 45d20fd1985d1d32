"""The serving engine's CUDA stream: where all of /predict's device work is queued, and its CPU twin.

A worker's training job queues its kernels on the default stream. Were a model's load (the
checkpoint's copy onto the device), its trace, its probe and its shape-tuning batches queued there
too, a prediction for a model just loaded would wait behind the training step's kernels however
high the forward's own stream stands; and the device-wide synchronisation of that tuning would wait
for them all. So the engine holds one high-priority stream (priorities: lower is higher; a value
out of range is clamped to the highest), and every thread that works for /predict on the device,
the intake as it loads a model and the device loop as it computes a batch, enters it: the
current stream is per thread in PyTorch, so entering it in one thread leaves the training
thread on its default stream. Streams are safe to queue on from several threads; work queued on
one stream runs in the order it was queued, so a model loaded on it needs no synchronisation
before its first forward there.

On a CPU device there is no stream: `ServingStream` is then a null context through the same
calls, and the CPU tests run the engine's code path as a GPU worker runs it. `inside` tells, on
either, whether the calling thread is in the context (on a GPU, whether its current stream is the
engine's): what the tests check the load, trace and probe path by. The CUDA calls here are listed
in docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

HIGH_PRIORITY = -1  # torch.cuda.Stream: lower is higher; out-of-range values clamp to the highest


class ServingStream:
    """The engine's stream: `with stream():` queues the block's device work on it."""

    def __init__(self, device_kind: str, torch_device: str) -> None:
        self.device_kind = device_kind
        self.torch_device = torch_device
        self.cuda: Any = None  # torch.cuda.Stream once opened on a GPU
        self._depth = threading.local()  # the CPU twin's: how deep the calling thread is inside

    def open(self) -> None:
        """Create the CUDA stream (a GPU device; the CPU twin has none). Not at construction: no CUDA
        before the engine starts."""
        if self.device_kind == "cuda" and self.cuda is None:
            self.cuda = torch.cuda.Stream(device=torch.device(self.torch_device), priority=HIGH_PRIORITY)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        depth = getattr(self._depth, "value", 0)
        self._depth.value = depth + 1
        try:
            if self.cuda is not None:
                with torch.cuda.stream(self.cuda):
                    yield
            else:
                yield
        finally:
            self._depth.value = depth

    def inside(self) -> bool:
        """Whether the calling thread's device work goes to this stream now."""
        if self.cuda is not None:
            return bool(torch.cuda.current_stream(self.cuda.device) == self.cuda)
        return getattr(self._depth, "value", 0) > 0

    def synchronize(self) -> None:
        """Wait for the work queued on this stream only (never the training job's)."""
        if self.cuda is not None:
            self.cuda.synchronize()
