"""Is this worker's device still usable? Sticky device errors take the worker out of service.

After some CUDA errors the process's CUDA context is unusable for good: every later kernel
launch, copy or query fails with the same error, so each job that reaches the worker would fail
at once (and the shared `auto` queue would drain into it). Only a fresh process gets a fresh
context. So when one of these errors is seen, or the device cannot even be described several
times in a row, the worker is *out of service*: its heartbeat publishes `broken` (never an old
reading as if idle), the job in hand is requeued (not failed: the job is not at fault), and the
worker stops consuming and exits non-zero, for its supervisor (`torchyard up`, compose's restart
policy) to start a fresh process.

What is CUDA-only here is the *origin* of the errors (the messages below come from the CUDA
runtime through torch, and `describe` queries `torch.cuda.mem_get_info` and NVML). The logic that
classifies them, counts failed probes, requeues, exits and restarts runs on the CPU as well, and
the tests drive it there through `TORCHYARD_DEVICE_FAULT_FILE` (`inject_fault`): the CPU twin of
a device that breaks mid-step. docs/gpu.md lists exactly what a CPU run does not exercise.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

log = logging.getLogger(__name__)

# Substrings of the errors after which a CUDA context is unusable (cudaError_t strings as torch
# reports them: "CUDA error: <string>", and the cuBLAS/cuDNN failures that follow them). Out of
# memory is not among them: it is recoverable, and the job fails with advice instead.
STICKY_DEVICE_ERRORS = (
    "an illegal memory access was encountered",  # cudaErrorIllegalAddress
    "device-side assert triggered",  # cudaErrorAssert
    "uncorrectable ecc error",  # cudaErrorECCUncorrectable
    "unspecified launch failure",  # cudaErrorLaunchFailure
    "misaligned address",  # cudaErrorMisalignedAddress
    "an illegal instruction was encountered",  # cudaErrorIllegalInstruction
    "cuda error: unknown error",  # cudaErrorUnknown
    "the launch timed out and was terminated",  # cudaErrorLaunchTimeout
    "gpu is lost",  # NVML_ERROR_GPU_IS_LOST
    "cublas_status_execution_failed",
    "cudnn_status_execution_failed",
)
# The device could not be described (mem_get_info, NVML) this many beats in a row.
MAX_PROBE_FAILURES = 3
DEFAULT_INJECTED_ERROR = "CUDA error: an illegal memory access was encountered"
# The fault file's content that makes a CUDA worker break its context for real, with a
# device-side assert (an out-of-range index); a CPU worker raises that error's text instead.
PROVOKE_DEVICE_ASSERT = "provoke: device-side assert"
DEVICE_ASSERT_ERROR = "CUDA error: device-side assert triggered"


def sticky_device_error(exc: BaseException) -> str | None:
    """The sticky device error behind `exc` (or its causes), as its first line; None if none is."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if any(pattern in text.lower() for pattern in STICKY_DEVICE_ERRORS):
            line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(current).__name__)
            return line[:500]
        current = current.__cause__ or current.__context__
    return None


def provoke_device_side_assert(device: str) -> None:
    """Index past the end of a tensor on the GPU: the indexing kernel's bounds check fails on the
    device (a device-side assert), after which the process's CUDA context is unusable. The launch
    is asynchronous, so the error surfaces at the synchronisation (RuntimeError "CUDA error:
    device-side assert triggered"), raised here into the job's step like any sticky error."""
    import torch

    values = torch.zeros(1, device=device)
    values[torch.full((1,), 2, dtype=torch.long, device=device)].sum().item()
    torch.cuda.synchronize(device)
    raise RuntimeError(f"{DEVICE_ASSERT_ERROR} (expected: it was provoked, yet CUDA reported nothing)")


class InjectedDeviceFault(RuntimeError):
    """The CPU twin's broken device: raised mid-step when the fault file appears (tests, chaos)."""


class DeviceHealth:
    """The worker's verdict on its device, shared by the job runner and the heartbeat threads."""

    def __init__(self, fault_file: Path | None = None, max_probe_failures: int = MAX_PROBE_FAILURES, *,
                 torch_device: str = "cpu") -> None:
        self.fault_file = fault_file
        self.torch_device = torch_device  # where `inject_fault` provokes a real device-side assert
        self.max_probe_failures = max_probe_failures
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._probe_failures = 0

    @property
    def broken(self) -> str | None:
        """Why this worker is out of service, or None while the device is usable."""
        return self._broken

    def job_failed(self, exc: BaseException) -> str | None:
        """Classify a job's exception: the sticky device error it shows (the device is now broken), or None."""
        reason = sticky_device_error(exc)
        if reason:
            self._mark_broken(reason)
        return reason

    def probe_failed(self, exc: BaseException) -> str | None:
        """The device could not be described; broken after `max_probe_failures` in a row (or at
        once for a sticky error). Returns the reason once broken."""
        with self._lock:
            self._probe_failures += 1
            failures = self._probe_failures
        reason = sticky_device_error(exc)
        if reason is None and failures >= self.max_probe_failures:
            reason = f"the device could not be read {failures} times in a row: {type(exc).__name__}: {exc}"[:500]
        if reason:
            self._mark_broken(reason)
        return self._broken

    def taken_out_of_service(self, reason: str) -> None:
        """Out of service for a reason other than an error of the device itself (its record was
        taken over by another worker instance, worker/runtime/heartbeat.py): the same course, requeue and exit."""
        self._mark_broken(reason)

    def probe_ok(self) -> None:
        with self._lock:
            self._probe_failures = 0

    def inject_fault(self) -> None:
        """Tests and `make chaos` only: if the fault file exists, consume it and raise the CUDA error
        it holds, as a sticky error raised mid-step would (the CPU twin). PROVOKE_DEVICE_ASSERT on a
        CUDA worker breaks its context for real instead (the GPU tests). Off when unset."""
        if self.fault_file is None:
            return
        try:
            message = self.fault_file.read_text().strip() or DEFAULT_INJECTED_ERROR
            self.fault_file.unlink()
        except FileNotFoundError:
            return
        if message == PROVOKE_DEVICE_ASSERT:
            if self.torch_device.startswith("cuda"):
                provoke_device_side_assert(self.torch_device)
            message = DEVICE_ASSERT_ERROR
        raise InjectedDeviceFault(message)

    def _mark_broken(self, reason: str) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = reason
                log.error("device out of service: %s", reason)
