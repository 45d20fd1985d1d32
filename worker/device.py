"""Pinning a worker to one device, and describing that device.

`pin_process` must run before torch initialises CUDA: CUDA reads CUDA_VISIBLE_DEVICES once,
at initialisation, and renumbers the visible GPUs from 0. After pinning, GPU N of the host is
`cuda:0` in this process, exactly as the tutorials' `CUDA_VISIBLE_DEVICES=1 python train.py`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path


class PinningError(RuntimeError):
    pass


@dataclass(frozen=True)
class DeviceChoice:
    """What `--device` asked for: a GPU index (as the worker's environment numbers it) or the CPU."""

    kind: str  # "cuda" | "cpu"
    local_index: int | None

    @classmethod
    def parse(cls, value: str) -> DeviceChoice:
        if value == "cpu":
            return cls("cpu", None)
        if value.isdigit():
            return cls("cuda", int(value))
        raise PinningError(f"--device takes a GPU index (0, 1, ...) or 'cpu', not {value!r}")


def pin_process(choice: DeviceChoice) -> None:
    """Restrict this process to its one device through the environment, before CUDA starts."""
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and torch_mod.cuda.is_initialized():
        raise PinningError("CUDA was initialised before the worker pinned its device; "
                           "CUDA_VISIBLE_DEVICES would be ignored. Start the worker in a fresh process.")
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if choice.kind == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = _visible_entry(choice.local_index)


def _visible_entry(index: int | None) -> str:
    """Index N within what this process may already see (a container or an outer CUDA_VISIBLE_DEVICES)."""
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    if outer:
        entries = [e.strip() for e in outer.split(",") if e.strip()]
        if index is not None and index < len(entries):
            return entries[index]
    return str(index)


@dataclass(frozen=True)
class WorkerDevice:
    """The device this worker owns, named as the API reports it."""

    kind: str
    index: int | None  # physical GPU index (host numbering); None for the CPU
    node: str

    @property
    def id(self) -> str:
        return f"{self.node}/cpu" if self.kind == "cpu" else f"{self.node}/cuda:{self.index}"

    @property
    def worker_name(self) -> str:
        return f"cpu@{self.node}" if self.kind == "cpu" else f"gpu{self.index}@{self.node}"

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else "cuda:0"


def resolve_worker_device(choice: DeviceChoice, node: str, host_gpu_index: int | None) -> WorkerDevice:
    """The physical index: a setting when a container renumbered the GPU, else what we pinned."""
    if choice.kind == "cpu":
        return WorkerDevice("cpu", None, node)
    if host_gpu_index is not None:
        return WorkerDevice("cuda", host_gpu_index, node)
    pinned = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    index = int(pinned) if pinned.isdigit() else choice.local_index
    return WorkerDevice("cuda", index, node)


def check_cuda(device: WorkerDevice) -> None:
    """Fail loudly if a GPU worker cannot see its GPU (rather than silently training on the CPU)."""
    import torch

    if device.kind == "cuda" and not torch.cuda.is_available():
        raise PinningError(
            f"--device {device.index}: no CUDA device is visible with CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r} (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}). Use --device cpu on a machine without GPUs.")


def describe(device: WorkerDevice) -> dict:
    """Name, memory and utilisation, read live. Never initialises CUDA in a CPU worker."""
    if device.kind == "cpu":
        import psutil

        memory = psutil.virtual_memory()
        return {"name": _cpu_name(), "memory_total_bytes": memory.total,
                "memory_used_bytes": memory.total - memory.available,
                "utilization_percent": psutil.cpu_percent(interval=None)}
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return {"name": torch.cuda.get_device_name(0), "memory_total_bytes": total,
            "memory_used_bytes": total - free, "utilization_percent": _nvml_utilization()}


def _nvml_utilization() -> float | None:
    try:
        import pynvml  # nvidia-ml-py, optional
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = None
        import torch

        props = torch.cuda.get_device_properties(0)
        uuid = getattr(props, "uuid", None)
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}") if uuid else pynvml.nvmlDeviceGetHandleByIndex(0)
        return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU ({line.split(':', 1)[1].strip()}, {os.cpu_count()} cores)"
    except OSError:
        pass
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
