"""Pinning a worker to one device, and naming that device (what it reads live is worker/device/info.py).

The pin must be in place before torch initialises CUDA: CUDA reads CUDA_VISIBLE_DEVICES once,
at initialisation, and renumbers the visible GPUs from 0. After pinning, GPU N of the host is
`cuda:0` in this process, exactly as the tutorials' `CUDA_VISIBLE_DEVICES=1 python train.py`.
`torchyard worker` pins with `exec_pinned` (a fresh interpreter started with the pin);
`pin_process` does the same in-process, for code that embeds a worker.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from core.config import gpu_selector


class PinningError(RuntimeError):
    """A device choice that cannot work: the worker says why and exits 2 (never a restart loop)."""


def _check_entry(entry: str, where: str) -> str:
    """An entry of CUDA_VISIBLE_DEVICES this worker can be pinned to and named by: an index or a UUID."""
    if entry.isdigit() or gpu_selector(entry):
        return entry
    raise PinningError(f"{where}: {entry!r} is neither a GPU index nor a GPU-/MIG- UUID (see `nvidia-smi -L`; "
                       f"the older MIG-GPU-<uuid>/<gi>/<ci> form is not supported: use the MIG UUID)")


@dataclass(frozen=True)
class DeviceChoice:
    """What `--device` asked for: a GPU index (as the worker's environment numbers it), a GPU or MIG
    UUID (`selector`), or the CPU."""

    kind: Literal["cuda", "cpu"]
    local_index: int | None
    selector: str | None = None

    @classmethod
    def parse(cls, value: str) -> DeviceChoice:
        if value == "cpu":
            return cls("cpu", None)
        if value.isdigit():
            return cls("cuda", int(value))
        if selector := gpu_selector(value):
            return cls("cuda", None, selector)
        raise PinningError(f"--device takes a GPU index (0, 1, ...), a GPU-/MIG- UUID (`nvidia-smi -L`) or "
                           f"'cpu', not {value!r}")


PINNED_MARKER = "TORCHYARD_PINNED"


def pinned_environment(choice: DeviceChoice, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables that pin a process to `choice`, given what it may already see."""
    if choice.kind == "cpu":
        visible = ""
    else:
        visible = _visible_entry(choice, environ.get("CUDA_VISIBLE_DEVICES"))
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": visible}


# libgomp's spin before an idle OpenMP thread sleeps, in iterations of its wait loop (libgomp's
# default: 300,000); one of the settings bench/predict.py's floors try.
SPIN_COUNT = "30000"


def openmp_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a worker process starts with for OpenMP: a capped spin, unless the operator chose a wait
    policy or a spin count of their own. libgomp reads it once, when torch loads it, so it goes
    into the environment the pinned worker is exec'd with (`exec_pinned`).

    After a forward on all the cores, the team's other threads spin for libgomp's default before
    sleeping, and on a CPU device the cores they spin on are the ones the replies, Redis and the
    API need next: with the spin capped, a heavy model's /predict serves more images per second
    for less worker CPU per image, and its replies reach Redis sooner. Training, whose team waits
    only in the gaps between operators, does not notice the cap. (PASSIVE, which sleeps at once,
    costs training about a third.) It costs a `predict` job on a CPU device a little of its speed
    where its two forward threads share the cores with the decode process (likely: a thread the
    decoder preempts keeps the other waiting past the capped spin, and it sleeps); cifar_net's
    forward there runs on one thread, with no team. The figures of each: docs/benchmarks.md
    ("Prediction", "Batch prediction jobs" and "Figures that were quoted in code comments")."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return {"GOMP_SPINCOUNT": SPIN_COUNT}


def is_pinned(device_arg: str, environ: Mapping[str, str]) -> bool:
    """True in the process `exec_pinned` started: its environment is already the pinned one."""
    return environ.get(PINNED_MARKER) == f"{device_arg}:{environ.get('CUDA_VISIBLE_DEVICES')}"


def pin_process(choice: DeviceChoice) -> None:
    """Restrict this process to its one device through the environment, before CUDA starts."""
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and torch_mod.cuda.is_initialized():
        raise PinningError("CUDA was initialised before the worker pinned its device; "
                           "CUDA_VISIBLE_DEVICES would be ignored. Start the worker in a fresh process.")
    os.environ.update(pinned_environment(choice, os.environ))


def exec_pinned(device_arg: str, choice: DeviceChoice) -> None:
    """Replace this process (same pid) by a fresh interpreter that starts with the pinned environment.

    Setting os.environ in a running process is enough for CUDA, but it is invisible from outside:
    /proc/<pid>/environ and `ps e` show the environment a process was started with. Exec'ing makes the pin a fact anyone can check, and guarantees nothing in this process
    touched CUDA first. The marker stops the new process from pinning (and exec'ing) again."""
    env = {**os.environ, **pinned_environment(choice, os.environ), **openmp_environment(os.environ)}
    env[PINNED_MARKER] = f"{device_arg}:{env['CUDA_VISIBLE_DEVICES']}"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "app.cli", "worker", "--device", device_arg], env)


def _visible_entry(choice: DeviceChoice, outer: str | None) -> str:
    """The GPU `choice` names within what this process may already see (a container or an outer
    CUDA_VISIBLE_DEVICES): the N-th entry for index N, the UUID itself when it is among them.
    An empty CUDA_VISIBLE_DEVICES is not "unset": it shows this process no GPU at all."""
    if outer is None:
        return choice.selector or str(choice.local_index)
    entries = [e.strip() for e in outer.split(",") if e.strip()]
    asked = f"--device {choice.selector or choice.local_index}"
    if not entries or entries == ["-1"]:
        raise PinningError(f"{asked}: CUDA_VISIBLE_DEVICES={outer!r} shows this process no GPU; unset it, or "
                           f"run a CPU worker (--device cpu)")
    if choice.selector is not None:
        if choice.selector not in entries:
            raise PinningError(f"{asked}: that GPU is not among CUDA_VISIBLE_DEVICES={outer!r}, which this "
                               f"process may see; name it by its index there (0 to {len(entries) - 1})")
        return choice.selector
    assert choice.local_index is not None
    if choice.local_index >= len(entries):
        raise PinningError(f"{asked}: CUDA_VISIBLE_DEVICES={outer!r} shows this process only "
                           f"{len(entries)} GPU(s), numbered from 0")
    return _check_entry(entries[choice.local_index], f"{asked}: CUDA_VISIBLE_DEVICES={outer!r}")


@dataclass(frozen=True)
class WorkerDevice:
    """The device this worker owns, named as the API reports it."""

    kind: Literal["cuda", "cpu"]
    index: int | None  # physical GPU index (host numbering); None for the CPU, or a GPU known by its UUID
    node: str
    selector: str | None = None  # the GPU-/MIG- UUID that names a GPU whose host index is not known

    @property
    def id(self) -> str:
        if self.kind == "cpu":
            return f"{self.node}/cpu"
        return f"{self.node}/cuda:{self.index if self.index is not None else self.selector}"

    @property
    def worker_name(self) -> str:
        if self.kind == "cpu":
            return f"cpu@{self.node}"
        return f"gpu{self.index}@{self.node}" if self.index is not None else f"{self.selector}@{self.node}"

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else "cuda:0"


def resolve_worker_device(choice: DeviceChoice, node: str, host_gpu_index: int | None,
                          environ: Mapping[str, str] | None = None) -> WorkerDevice:
    """The physical (host) index of the pinned GPU, or its UUID, which names the device and the worker.

    In order: TORCHYARD_HOST_GPU_INDEX (a container runtime renumbered the GPU to 0); else a single
    integer or UUID in NVIDIA_VISIBLE_DEVICES for `--device 0` (how the NVIDIA runtime was told
    which host GPU to show, e.g. `docker run -e NVIDIA_VISIBLE_DEVICES=2`); else the pinned
    CUDA_VISIBLE_DEVICES entry (an index, or a GPU-/MIG- UUID: `up` pins each worker to one entry of
    an outer CUDA_VISIBLE_DEVICES, and UUIDs there gave every worker the name cuda:0 before);
    else the `--device` index itself."""
    environ = os.environ if environ is None else environ
    if choice.kind == "cpu":
        return WorkerDevice("cpu", None, node)
    if host_gpu_index is not None:
        return WorkerDevice("cuda", host_gpu_index, node)
    nvidia = environ.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if choice.local_index == 0 and nvidia.isdigit():
        return WorkerDevice("cuda", int(nvidia), node)
    if choice.local_index == 0 and gpu_selector(nvidia):
        return WorkerDevice("cuda", None, node, selector=nvidia)
    pinned = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if pinned.isdigit():
        return WorkerDevice("cuda", int(pinned), node)
    if gpu_selector(pinned):
        return WorkerDevice("cuda", None, node, selector=pinned)
    if choice.selector is not None:
        return WorkerDevice("cuda", None, node, selector=choice.selector)
    return WorkerDevice("cuda", choice.local_index, node)


def check_cuda(device: WorkerDevice) -> None:
    """Fail loudly if a GPU worker cannot see its GPU (rather than silently training on the CPU)."""
    import torch

    if device.kind == "cuda" and not torch.cuda.is_available():
        raise PinningError(
            f"GPU worker for GPU {device.index if device.index is not None else device.selector}: no CUDA device is visible with CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r} (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}); refusing to fall back to the CPU. "
            f"Use --device cpu on a machine without GPUs.")
