"""Where a split's images live while a job trains, and how a batch reaches the device.

- `ResidentBatches`: the whole split (uint8) on the compute device; a batch is an index there.
  On a GPU this is the fast path when the split fits (worker/training/trainer.py `plan_training`); on a
  CPU worker the split simply stays in host memory.
- `StagedBatches`: a split too big for the GPU stays in ordinary (pageable) host memory and every
  batch is gathered into the next slot of a ring of staging buffers (worker/device/pinned_ring.py: an
  (images, labels) pair per slot, pinned on a GPU, each guarded by the event of its copy), then
  copied to the device. With `buffers` = 3 the host gathers the next batches while the GPU still
  computes the previous one. Pinning the whole split instead would double its host memory and
  page-lock all of it.

On the CPU the ring runs the same rotation and reuse with plain buffers, which is how the tests
exercise it.
"""

from __future__ import annotations

import torch

from worker.device.pinned_ring import PinnedRing

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
        self.index_device = torch.device("cpu")
        capacity = max(1, min(capacity, len(labels)))
        self.ring: PinnedRing[tuple[torch.Tensor, torch.Tensor]] = PinnedRing(
            lambda pinned: (torch.empty((capacity, *images.shape[1:]), dtype=images.dtype, pin_memory=pinned),
                            torch.empty(capacity, dtype=labels.dtype, pin_memory=pinned)),
            device, buffers)

    @property
    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ring's (images, labels) buffers, one pair per slot."""
        return self.ring.slots

    @property
    def slot(self) -> int:
        """The buffer the last batch went through."""
        return self.ring.slot

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather `index` (on the host) into the next staging buffers and copy them to the device."""
        image_buffer, label_buffer = self.ring.next()
        n = len(index)
        if n > len(label_buffer):
            raise ValueError(f"a batch of {n} exceeds the staging buffers' {len(label_buffer)}")
        torch.index_select(self.images, 0, index, out=image_buffer[:n])
        torch.index_select(self.labels, 0, index, out=label_buffer[:n])
        images, labels = self.ring.to_device(image_buffer[:n]), self.ring.to_device(label_buffer[:n])
        self.ring.copies_issued()
        return images, labels

    def slice(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.take(torch.arange(begin, end))


Batches = ResidentBatches | StagedBatches
