"""What a worker reads live about its device and host, for its heartbeat and its plans: the device's
name, memory and utilisation (NVML where available), the host memory this process may use, and the
CPU's feature flags. Never initialises CUDA in a CPU worker.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.device.pinning import WorkerDevice


@dataclass(frozen=True)
class DeviceInfo:
    """What a heartbeat reads live about its device (the rest of its record is fixed)."""

    name: str
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    utilization_percent: float | None


def describe(device: WorkerDevice) -> DeviceInfo:
    """Name, memory and utilisation, read live. Never initialises CUDA in a CPU worker."""
    if device.kind == "cpu":
        import psutil

        memory = psutil.virtual_memory()
        return DeviceInfo(_cpu_name(), memory.total, memory.total - memory.available, _own_cpu_percent())
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return DeviceInfo(torch.cuda.get_device_name(0), total, total - free, _nvml_utilization())


# The worker's processes (itself, its decode processes) as psutil measures them: cpu_percent is the
# use since the same Process object's previous call, so the objects are kept between heartbeats.
_MEASURED: dict[int, Any] = {}


def _own_cpu_percent() -> float:
    """What this worker uses of the host's CPUs, in percent of all of them: its process and its
    children. The host's figure (psutil.cpu_percent) counted every other program's load as the
    device's, so an idle CPU worker on a busy host showed 100 %."""
    import psutil

    me = psutil.Process()
    try:
        processes = [me, *me.children(recursive=True)]
    except psutil.Error:
        processes = [me]
    total = 0.0
    alive = set()
    for process in processes:
        measured = _MEASURED.setdefault(process.pid, process)
        alive.add(process.pid)
        try:
            total += measured.cpu_percent(interval=None)
        except psutil.Error:
            continue
    for gone in set(_MEASURED) - alive:
        del _MEASURED[gone]
    return round(min(100.0, total / (psutil.cpu_count() or 1)), 1)


_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def host_memory_total() -> int:
    """RAM this process may use: the host's, or less when a cgroup (a container's memory limit) says so."""
    import psutil

    total = psutil.virtual_memory().total
    for path in _CGROUP_LIMITS:
        try:
            limit = path.read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


# After NVML could not be read, it is tried again this much later (a driver reloaded, a transient
# NVML error): never once per heartbeat, never given up for the process's life.
NVML_RETRY_S = 60.0


class NvmlUtilization:
    """GPU utilisation from NVML (the optional `gpu` extra, nvidia-ml-py); None where unavailable.

    NVML numbers GPUs its own way, so the handle is found by the UUID torch reports for cuda:0.
    A failure (no pynvml, no driver library, MIG, a transient NVML error) answers None and is
    retried `retry_after_s` later, with a fresh handle: it does not latch for the process's life."""

    def __init__(self, retry_after_s: float = NVML_RETRY_S) -> None:
        self.retry_after_s = retry_after_s
        self.attempts = 0  # reads tried, failed ones included (the retry rule's test counts them)
        self._handle: Any = None
        self._retry_at = 0.0

    def __call__(self) -> float | None:
        if time.monotonic() < self._retry_at:
            return None
        self.attempts += 1
        try:
            import pynvml  # nvidia-ml-py, optional

            if self._handle is None:
                import torch

                pynvml.nvmlInit()
                uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", "") or "")
                if uuid:
                    self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-"))
                                                                    else f"GPU-{uuid}")
                else:
                    self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            return float(pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        except Exception:
            self._handle = None
            self._retry_at = time.monotonic() + self.retry_after_s
            return None


_nvml_utilization = NvmlUtilization()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (/proc/cpuinfo); none where it does not."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU ({line.split(':', 1)[1].strip()}, {os.cpu_count()} cores)"
    except OSError:
        pass
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
