"""Device health on the CPU: which errors take a worker out of service, probe failures, the
fault-file twin. (The end-to-end path, requeue, exit 3 and restart by `up`, is in
tests/e2e/test_supervisor.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.device.health import (
    DEFAULT_INJECTED_ERROR,
    DEVICE_ASSERT_ERROR,
    PROVOKE_DEVICE_ASSERT,
    DeviceHealth,
    InjectedDeviceFault,
    sticky_device_error,
)


@pytest.mark.parametrize("message", [
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported",
    "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "CUDA error: unspecified launch failure",
    "CUDA error: uncorrectable ECC error encountered",
    "CUDA error: misaligned address",
    "CUDA error: an illegal instruction was encountered",
    "CUDA error: the launch timed out and was terminated",
    "CUDA error: unknown error",
    "CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc)`",
])
def test_sticky_cuda_errors_break_the_device(message: str) -> None:
    health = DeviceHealth()
    assert health.job_failed(RuntimeError(message)) == message.splitlines()[0]
    assert health.broken == message.splitlines()[0]


def test_an_error_caused_by_a_sticky_one_is_sticky_and_others_are_not() -> None:
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as inner:
            raise ValueError("checkpoint could not be written") from inner
    except ValueError as outer:
        assert sticky_device_error(outer) == "CUDA error: an illegal memory access was encountered"
    health = DeviceHealth()
    for harmless in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                     RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x10 and 3x2)"),
                     ValueError("the training loss became nan in epoch 1")):
        assert health.job_failed(harmless) is None
    assert health.broken is None


def test_the_device_breaks_after_repeated_probe_failures_only() -> None:
    health = DeviceHealth(max_probe_failures=3)
    assert health.probe_failed(RuntimeError("NVML: driver not loaded")) is None
    assert health.probe_failed(RuntimeError("NVML: driver not loaded")) is None
    health.probe_ok()  # a good reading in between starts the count again
    assert health.probe_failed(RuntimeError("NVML: driver not loaded")) is None
    assert health.probe_failed(RuntimeError("NVML: driver not loaded")) is None
    reason = health.probe_failed(RuntimeError("NVML: driver not loaded"))
    assert reason and "3 times in a row" in reason and health.broken == reason
    # A sticky error from the probe breaks it at once.
    assert DeviceHealth().probe_failed(RuntimeError("CUDA error: unspecified launch failure"))


def test_the_fault_file_raises_once(tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    health = DeviceHealth(fault)
    health.inject_fault()  # no file: nothing happens
    fault.write_text("")
    with pytest.raises(InjectedDeviceFault, match=DEFAULT_INJECTED_ERROR) as raised:
        health.inject_fault()
    assert not fault.exists()
    health.inject_fault()  # consumed
    assert health.job_failed(raised.value) == DEFAULT_INJECTED_ERROR


def test_a_provoked_device_side_assert_is_its_error_text_on_the_cpu(tmp_path: Path) -> None:
    """The GPU tests provoke a real device-side assert through the fault file (tests/e2e/test_gpu.py);
    on a CPU worker the same request raises that error's text, which breaks the device the same way."""
    fault = tmp_path / "fault"
    fault.write_text(PROVOKE_DEVICE_ASSERT)
    health = DeviceHealth(fault, torch_device="cpu")
    with pytest.raises(InjectedDeviceFault, match=DEVICE_ASSERT_ERROR) as raised:
        health.inject_fault()
    assert health.job_failed(raised.value) == DEVICE_ASSERT_ERROR
