"""How the serving engine (worker/serving/) forms batches and gets them onto its device.

Kept apart from the threads and Redis so that every decision here runs in the CPU tests exactly
as it runs on a GPU worker (CI has no GPU): the batching window, the bucketed batch sizes and the
rotation of the host staging buffers. The CUDA calls themselves are the few lines listed in
docs/gpu.md.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.device.pinned_ring import PinnedRing

STAGING_BUFFERS = 2  # one being filled while the previous one's copy to the device completes


class BatchWindow:
    """When the intake hands what it has collected to the device thread.

    - A lone request on a quiet device goes at once: the expected batch starts at one, and a
      batch that had to wait out its window resets the expectation to what did arrive.
    - Under load the expected batch is the largest recent one, so with 32 clients in a closed
      loop the intake waits for the 32nd request instead of sending the first few it sees, as long
      as the wait is worth it (below).
    - The wait is bounded (below), timed from when the API queued the first request or
      from when the device became free, whichever is later: while the device is busy there is
      nothing to gain by handing over (in a closed loop most clients are waiting for the batch
      being computed, and come back only once it is answered), so the intake keeps collecting
      up to `max_batch` and the window opens when the device can take the batch.

    When traffic falls, the first batch that waits out its window brings the expectation down to
    what arrived: at most one window of extra latency, once.

    The window is `max_wait_s` at most, and never longer than the device takes to compute a full
    batch (`note_forward`): waiting longer than that cannot pay, as the stragglers would be served
    sooner by the next batch, computed right after this one, than by holding this one while the
    device idles. So a heavy model's batches still fill, while a light one stops holding requests
    for company, and the API parses one batch's requests while the worker computes another's
    (docs/benchmarks.md has the figures). The average is the worker's, over whichever models its
    batches ran: a device serving a heavy and a light model at once waits somewhere between what
    each alone would.

    Times are this host's wall clock: the intake converts a request's `queued_at` from Redis's
    clock (worker/serving/transport.py) before it opens a window with it.
    """

    FORWARD_WEIGHT = 0.2  # of the newest full batch in the running average of the forward's time

    def __init__(self, max_batch: int, max_wait_s: float) -> None:
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.expected = 1
        self.forward_s: float | None = None  # a full batch's forward, running average; None: none seen yet

    def target(self) -> int:
        return max(1, min(self.max_batch, self.expected))

    def wait_s(self) -> float:
        """How long a batch may wait for the expected company."""
        return self.max_wait_s if self.forward_s is None else min(self.max_wait_s, self.forward_s)

    def deadline(self, opened_at: float) -> float:
        return opened_at + self.wait_s()

    def note_forward(self, seconds: float, images: int) -> None:
        """The device thread's time for a batch of `images` (staging, forward, the copy back). Only a
        batch of the expected size counts: a small one would understate what a full one costs."""
        if images < self.target():
            return
        self.forward_s = seconds if self.forward_s is None else (
            self.forward_s + self.FORWARD_WEIGHT * (seconds - self.forward_s))

    def ready(self, images: int, opened_at: float, now: float, device_busy: bool) -> bool:
        """Whether a batch of `images` should go to the device now. `opened_at` (epoch s): when the
        first request was queued or the device became free, whichever is later."""
        if images >= self.max_batch:
            return True
        if device_busy:
            return False
        return images >= self.target() or now >= self.deadline(opened_at)

    def observe(self, images: int) -> None:
        """The batch just handed over: one that reached the expectation raises it to its size; one
        that waited out its window (fewer arrived) sets it to what did arrive."""
        self.expected = images if images < self.target() else max(self.expected, images)


def bucket_size(n: int, max_batch: int) -> int:
    """The batch size a batch of `n` images is padded to on a GPU: the next power of two, capped at
    `max_batch` (which is a bucket itself). With `torch.backends.cudnn.benchmark` cuDNN tunes its
    kernels once per input shape; serving every size from 1 to 32 would tune 32 times (each a
    slow first batch), six buckets tune six times. A padded row costs a GPU next to nothing; on the
    CPU, where it would cost its full share, batches are not padded."""
    if n <= 0:
        raise ValueError("a batch holds at least one image")
    if n >= max_batch:
        return n
    return min(max_batch, 1 << (n - 1).bit_length())


def buckets(max_batch: int) -> list[int]:
    """Every size `bucket_size` pads a batch to: the shapes a GPU device will run."""
    return sorted({bucket_size(n, max_batch) for n in range(1, max_batch + 1)})


class HostStaging:
    """The host buffers a batch is stacked into before it goes to the device (worker/device/pinned_ring.py),
    a ring per image shape.

    The decoded images are written straight into a buffer (no intermediate `np.stack`), padded rows
    are zeroed, and the copy to the device is asynchronous from pinned memory on a GPU. On the CPU
    the copy is a real copy, so a later batch never overwrites a tensor still in use.
    """

    def __init__(self, device: torch.device, capacity: int, buffers: int = STAGING_BUFFERS) -> None:
        self.device = device
        self.capacity = capacity
        self.count = buffers
        # by the arrays' dtype and shape (C, H, W): uint8 decoded images, float32 preprocessed inputs
        self.rings: dict[tuple[str, tuple[int, ...]], PinnedRing[torch.Tensor]] = {}

    def upload(self, arrays: list[np.ndarray] | list[np.ndarray | torch.Tensor], rows: int) -> torch.Tensor:
        """`arrays` (each C×H×W, one dtype: uint8 images or float32 preprocessed inputs) as one
        `rows`-long batch of that dtype on the device; rows past `len(arrays)` are zeros. Rows
        decoded on the device already (worker/data/device_jpeg.py: torch tensors there) are
        stacked there, with no staging buffer."""
        if rows > self.capacity or rows < len(arrays):
            raise ValueError(f"{len(arrays)} images in {rows} rows; the staging buffers hold {self.capacity}")
        if isinstance(arrays[0], torch.Tensor):
            stacked = torch.stack([a if isinstance(a, torch.Tensor) else torch.from_numpy(a).to(self.device)
                                   for a in arrays])
            if rows > len(arrays):
                stacked = torch.cat([stacked, stacked.new_zeros((rows - len(arrays), *stacked.shape[1:]))])
            return stacked
        host_arrays = [a for a in arrays if isinstance(a, np.ndarray)]
        shape, dtype = tuple(host_arrays[0].shape), host_arrays[0].dtype
        ring = self.rings.get((dtype.str, shape))
        if ring is None:
            torch_dtype = torch.float32 if dtype == np.float32 else torch.uint8
            ring = self.rings[(dtype.str, shape)] = PinnedRing(
                lambda pinned: torch.empty((self.capacity, *shape), dtype=torch_dtype, pin_memory=pinned),
                self.device, self.count)
        buffer = ring.next()
        host = buffer.numpy()
        for row, array in enumerate(host_arrays):
            host[row] = array
        if rows > len(arrays):
            host[len(arrays):rows] = 0
        batch = ring.to_device(buffer[:rows])
        ring.copies_issued()
        return batch
