"""A batch prediction's images decoded beside its forward: in DataLoader worker processes a few
batches ahead, and the cores shared between those processes and the forward's torch threads.

Decoding a small image is mostly Python holding the GIL, so a decode thread in the job's process
would take the GIL from the forward's own Python; a process has a GIL of its own. Forked: cheap to
start, and the child only decodes (no CUDA, no Redis). Each batch crosses back as one tensor in
shared memory. Each image goes through the one image → array transform /predict uses
(worker/data/image_array.decode_image), so a line's probabilities are /predict's for that image. How the cores are split (`thread_split`,
`ForwardThreadChoice`) lives here because it is decided by how much decoding costs beside the
forward. docs/benchmarks.md ("Batch prediction jobs", and "Figures that were quoted in code
comments") holds the measurements behind each choice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from worker.checkpoints.format import ModelMeta
from worker.data.dataset_decode import DECODE_NICE
from worker.data.image_array import BadImage, InputSpec, decode_image

# Batches decoded ahead of the forward pass: enough to hide a slow file, little memory.
PREFETCH_BATCHES = 4


@dataclass
class DecodedBatch:
    start: int  # index of its first file in the job's order
    files: list[str]
    images: torch.Tensor | None  # uint8 N×C×H×W of the files that decoded, in order (None: none did)
    errors: dict[int, str]  # position in `files` → why it did not decode
    decode_cpu_s: float = 0.0  # CPU seconds its decoding took (read, decode, convert, stack)


class _BatchFiles(Dataset[DecodedBatch]):
    """Batch k of the job's files from `start` on, decoded (runs in a DataLoader worker process)."""

    def __init__(self, root: Path, files: Sequence[str], meta: ModelMeta, max_pixels: int, batch_size: int,
                 start: int) -> None:
        self.root = root
        self.files = files
        self.spec = InputSpec.of(meta.preprocessing)
        self.max_pixels = max_pixels
        self.batch_size = batch_size
        self.start = start

    def __len__(self) -> int:
        return max(0, -(-(len(self.files) - self.start) // self.batch_size))

    def __getitem__(self, k: int) -> DecodedBatch:
        began = time.thread_time()
        first = self.start + k * self.batch_size
        files = list(self.files[first:first + self.batch_size])
        arrays: list[np.ndarray] = []
        errors: dict[int, str] = {}
        prefix = f"{self.root}{os.sep}"
        for position, name in enumerate(files):
            try:
                arrays.append(decode_image(read_file(prefix + name), self.spec, self.max_pixels))
            except OSError as exc:  # the file went away or cannot be read: say so without the server's path
                errors[position] = f"cannot read the file: {exc.strerror or type(exc).__name__}"
            except BadImage as bad:  # its message says why
                errors[position] = bad.detail
        # One tensor per batch: it crosses to the job's process in shared memory, not pickled.
        images = torch.from_numpy(np.stack(arrays)) if arrays else None
        return DecodedBatch(first, files, images, errors, time.thread_time() - began)


def read_file(path: str) -> bytes:
    """A file's bytes with two system calls and no Python file object: Path.read_bytes wraps the same
    reads in a buffered file object, which for a small image costs a fair share of decoding it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _as_is(batch: Any) -> Any:
    """No collation: each item already is a whole batch (the DataLoader's batch_size is None)."""
    return batch


def decoded_batches(root: Path, files: Sequence[str], meta: ModelMeta, max_pixels: int, batch_size: int,
                    start: int, workers: int) -> DataLoader[DecodedBatch]:
    """The batches from file `start` on, in order, decoded by `workers` DataLoader processes a few
    batches ahead of the forward pass (never on the thread that runs it; processes, not threads:
    the module's docstring says why)."""
    dataset = _BatchFiles(root, files, meta, max_pixels, batch_size, start)
    return DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=_as_is,
                      prefetch_factor=PREFETCH_BATCHES if workers else None, persistent_workers=False,
                      worker_init_fn=_decode_at_lower_priority)


def _decode_at_lower_priority(_: int) -> None:
    """A decode process yields the cores to the forward's threads when both want them: it runs a few
    batches ahead (PREFETCH_BATCHES), so it can afford to wait, while a forward thread it preempts
    stalls its whole OpenMP team at the next barrier. A light model's job gains most; a heavy one's
    forward leaves the decoder little to take either way."""
    os.nice(DECODE_NICE)


def thread_split(cuda: bool, cores: int | None = None) -> tuple[int, int]:
    """(decode worker processes, torch threads for the forward). On a CPU the cores are shared:
    half decode, the rest run the forward (2 cores: 1 and 1), until ForwardThreadChoice sees that
    decoding is light and gives the forward every core. On a GPU the forward needs one core to
    launch kernels; the others decode."""
    cores = cores or os.cpu_count() or 1
    if cuda:
        return max(1, min(8, cores - 1)), 1
    decode = max(1, min(8, cores // 2))
    return decode, max(1, cores - decode)


class ForwardThreadChoice:
    """A CPU job's torch threads, chosen once from its own second batch (the first warms up).

    thread_split leaves the decoders their cores; that is right when decoding is a fair share of
    the work and wastes them when the forward dwarfs it. A light model (cifar_net, whose forward
    per image costs a few times its decoding) is faster on one torch thread: on two, the decoder
    preempts the spinning team. A heavy one (resnet18, whose forward costs tens of times its
    decoding) leaves the decoder's core mostly idle, and is faster on every core. So when decoding,
    at the forward's pace, needs under DECODE_LIGHT of one core, the forward takes every core."""

    # Of one core: between a light model's need (cifar_net's keeps the split) and a heavy one's
    # (resnet18's takes every core), far from both.
    DECODE_LIGHT = 0.15

    def __init__(self, cores: int, split_threads: int) -> None:
        self.cores = cores
        self.threads = split_threads
        self._seen = 0

    def observe(self, decode_cpu_s: float, forward_s: float) -> int | None:
        """After a batch: the thread count to switch to, once, or None to keep the current one."""
        self._seen += 1
        if self._seen != 2 or self.threads >= self.cores or forward_s <= 0:
            return None
        decoder_cores = decode_cpu_s / forward_s  # the decoders' demand while the forward runs at this pace
        if decoder_cores < self.DECODE_LIGHT:
            self.threads = self.cores
            return self.threads
        return None
