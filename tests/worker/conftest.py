"""Fixtures shared by the worker's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from models.cifar_net import CifarNet


@pytest.fixture
def gpu_memory_budget() -> Iterator[dict]:
    """Raise torch.OutOfMemoryError as the CUDA caching allocator does, from a global forward hook:
    for any CifarNet pass over more than `images` images, and for the next `transient` passes
    whatever their size (memory held for a moment by something else on the GPU)."""
    budget = {"images": 10_000, "transient": 0, "raised": 0}

    def hook(module: torch.nn.Module, args: tuple) -> None:
        if not isinstance(module, CifarNet) or not module.training:
            return
        if args[0].shape[0] > budget["images"] or budget["transient"] > 0:
            budget["transient"] = max(0, budget["transient"] - 1)
            budget["raised"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total "
                                         "capacity of 15.74 GiB of which 12.56 MiB is free.")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield budget
    finally:
        handle.remove()
