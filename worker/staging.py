"""Where a split's images live while a job trains, and how a batch reaches the device.

- `ResidentBatches`: the whole split (uint8) on the compute device; a batch is an index there.
  On a GPU this is the fast path when the split fits (worker/trainer.py `plan_training`); on a
  CPU worker the split simply stays in host memory.
- `StagedBatches`: a split too big for the GPU stays in ordinary (pageable) host memory and every
  batch is gathered into one of a few pinned staging buffers, copied to the GPU asynchronously
  (`non_blocking=True`, which is only asynchronous from pinned memory), and an event recorded
  after the copy guards the buffer: it is written again only once its copy has completed. With
  `buffers` = 3 the host gathers the next batches while the GPU still computes the previous one.
  Pinning the whole split instead would double its host memory and page-lock all of it.

On the CPU (no pinned memory, no events: a copy is done when `.to()` returns) `StagedBatches`
runs the same rotation and reuse with plain buffers, which is how the tests exercise it.
"""

from __future__ import annotations

import torch

STAGING_BUFFERS = 3


class ResidentBatches:
    def __init__(self, images: torch.Tensor, labels: torch.Tensor, device: torch.device) -> None:
        self.images = images.to(device)
        self.labels = labels.to(device)
        self.index_device = device  # where batch indices must live

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]

    def slice(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[begin:end], self.labels[begin:end]


class StagedBatches:
    def __init__(self, images: torch.Tensor, labels: torch.Tensor, device: torch.device, capacity: int,
                 buffers: int = STAGING_BUFFERS) -> None:
        self.images = images  # host memory, as loaded: never pinned as a whole
        self.labels = labels
        self.device = device
        self.index_device = torch.device("cpu")
        self.pinned = device.type == "cuda"
        capacity = max(1, min(capacity, len(labels)))
        self.buffers = [(torch.empty((capacity, *images.shape[1:]), dtype=images.dtype, pin_memory=self.pinned),
                         torch.empty(capacity, dtype=labels.dtype, pin_memory=self.pinned)) for _ in range(buffers)]
        self._copied: list[torch.cuda.Event | None] = [None] * buffers
        self.slot = -1  # the buffer the last batch went through

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather `index` (on the host) into the next staging buffer and copy it to the device."""
        self.slot = (self.slot + 1) % len(self.buffers)
        copied = self._copied[self.slot]
        if copied is not None:
            copied.synchronize()  # the copy out of this buffer, `buffers` batches ago, has finished
        image_buffer, label_buffer = self.buffers[self.slot]
        n = len(index)
        if n > len(label_buffer):
            raise ValueError(f"a batch of {n} exceeds the staging buffers' {len(label_buffer)}")
        torch.index_select(self.images, 0, index, out=image_buffer[:n])
        torch.index_select(self.labels, 0, index, out=label_buffer[:n])
        # copy=True: on the CPU `.to()` would otherwise hand back the buffer itself, which the batch
        # after next overwrites; on a GPU it is a new device tensor either way.
        images = image_buffer[:n].to(self.device, non_blocking=self.pinned, copy=True)
        labels = label_buffer[:n].to(self.device, non_blocking=self.pinned, copy=True)
        if self.pinned:
            event = torch.cuda.Event()
            event.record()  # on the current stream, after the two copies
            self._copied[self.slot] = event
        return images, labels

    def slice(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.take(torch.arange(begin, end))


Batches = ResidentBatches | StagedBatches
