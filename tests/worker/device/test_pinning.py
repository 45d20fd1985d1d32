"""Pinning and device naming: pure functions over an environment, no CUDA needed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from core.clock import utc_now_iso
from core.schemas import Device
from tests.support import REPO
from worker.device.pinning import (
    PINNED_MARKER,
    DeviceChoice,
    PinningError,
    WorkerDevice,
    is_pinned,
    openmp_environment,
    pinned_environment,
    resolve_worker_device,
)

UUID_A = "GPU-8a1b2c3d-1111-2222-3333-444455556666"
UUID_B = "GPU-0f0e0d0c-aaaa-bbbb-cccc-ddddeeeeffff"
MIG = "MIG-5c3a1f2e-7b6d-5e4f-8a9b-0c1d2e3f4a5b"


def test_parse() -> None:
    assert DeviceChoice.parse("cpu") == DeviceChoice("cpu", None)
    assert DeviceChoice.parse("3") == DeviceChoice("cuda", 3)
    assert DeviceChoice.parse(UUID_A) == DeviceChoice("cuda", None, UUID_A)
    assert DeviceChoice.parse(MIG) == DeviceChoice("cuda", None, MIG)
    for bad in ("cuda:0", "-1", "gpu", "", "MIG-GPU-8a1b2c3d/1/0", "GPU-", "GPU-xyz"):
        with pytest.raises(PinningError):
            DeviceChoice.parse(bad)


@pytest.mark.parametrize(("arg", "outer", "visible"), [
    ("0", None, "0"),
    ("1", None, "1"),
    ("0", "2", "2"),        # `torchyard up` starts GPU 2's worker as CUDA_VISIBLE_DEVICES=2 --device 0
    ("1", "3,5", "5"),      # the N-th entry of an outer CUDA_VISIBLE_DEVICES
    ("1", " 3 , 5 ", "5"),
    ("cpu", "0,1", ""),     # a CPU worker sees no GPU at all
    ("cpu", None, ""),
    ("cpu", "", ""),
    ("1", f"{UUID_A},{UUID_B}", UUID_B),   # UUIDs in the outer list: the N-th one
    (UUID_B, f"{UUID_A},{UUID_B}", UUID_B),
    (MIG, None, MIG),
])
def test_pinned_environment(arg: str, outer: str | None, visible: str) -> None:
    environ = {} if outer is None else {"CUDA_VISIBLE_DEVICES": outer}
    pinned = pinned_environment(DeviceChoice.parse(arg), environ)
    assert pinned == {"CUDA_VISIBLE_DEVICES": visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_openmp_spin_is_capped_unless_the_operator_chose_one() -> None:
    assert openmp_environment({}) == {"GOMP_SPINCOUNT": "30000"}
    assert openmp_environment({"GOMP_SPINCOUNT": "0"}) == {}
    assert openmp_environment({"OMP_WAIT_POLICY": "PASSIVE"}) == {}


def test_index_beyond_outer_visible_devices_is_refused() -> None:
    with pytest.raises(PinningError, match="shows this process only 2 GPU"):
        pinned_environment(DeviceChoice.parse("2"), {"CUDA_VISIBLE_DEVICES": "3,5"})


def test_marker_is_tied_to_argument_and_pin() -> None:
    assert is_pinned("1", {PINNED_MARKER: "1:5", "CUDA_VISIBLE_DEVICES": "5"})
    assert not is_pinned("1", {"CUDA_VISIBLE_DEVICES": "5"})
    assert not is_pinned("0", {PINNED_MARKER: "1:5", "CUDA_VISIBLE_DEVICES": "5"})
    assert not is_pinned("1", {PINNED_MARKER: "1:5", "CUDA_VISIBLE_DEVICES": "4"})


@pytest.mark.parametrize(("arg", "host_index", "environ", "expected_index"), [
    ("0", None, {"CUDA_VISIBLE_DEVICES": "3"}, 3),                      # bare host, pinned by up
    ("0", 2, {"CUDA_VISIBLE_DEVICES": "0"}, 2),                         # container + TORCHYARD_HOST_GPU_INDEX
    ("0", None, {"CUDA_VISIBLE_DEVICES": "0", "NVIDIA_VISIBLE_DEVICES": "1"}, 1),   # docker -e NVIDIA_VISIBLE_DEVICES=1
    ("0", 4, {"CUDA_VISIBLE_DEVICES": "0", "NVIDIA_VISIBLE_DEVICES": "1"}, 4),      # the setting wins
    ("0", None, {"CUDA_VISIBLE_DEVICES": "0", "NVIDIA_VISIBLE_DEVICES": "all"}, 0),
    ("0", None, {"CUDA_VISIBLE_DEVICES": "0", "NVIDIA_VISIBLE_DEVICES": "0,1"}, 0),
    ("1", None, {"CUDA_VISIBLE_DEVICES": "1", "NVIDIA_VISIBLE_DEVICES": "3"}, 1),   # a list of 1 has no index 1
])
def test_resolve_worker_device(arg: str, host_index: int | None, environ: dict, expected_index: int) -> None:
    device = resolve_worker_device(DeviceChoice.parse(arg), "nodea", host_index, environ)
    assert device == WorkerDevice("cuda", expected_index, "nodea")
    assert device.id == f"nodea/cuda:{expected_index}"
    assert device.worker_name == f"gpu{expected_index}@nodea"
    assert device.torch_device == "cuda:0"


def test_cpu_device_names() -> None:
    device = resolve_worker_device(DeviceChoice.parse("cpu"), "nodea", 3, {"NVIDIA_VISIBLE_DEVICES": "1"})
    assert (device.id, device.worker_name, device.torch_device, device.index) == ("nodea/cpu", "cpu@nodea", "cpu", None)


def test_cli_and_supervisor_never_import_torch() -> None:
    """The supervisor must not touch CUDA; importing torch is where that would start."""
    code = ("import sys, app.cli, app.supervisor, worker.device.pinning\n"
            "from core.config import Settings\n"
            "from app.supervisor import Supervisor\n"
            "Supervisor(Settings(devices='0,1', redis_url='redis://127.0.0.1:1/0')).plan('redis://127.0.0.1:1/0')\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_supervisor_plan_pins_one_worker_per_gpu(tmp_path) -> None:
    from app.supervisor import Supervisor
    from core.config import Settings

    children = Supervisor(Settings(devices="0,2", data_dir=tmp_path)).plan("redis://127.0.0.1:1/0")
    workers = {c.name: c for c in children if c.name.startswith("worker")}
    assert set(workers) == {"worker-gpu0", "worker-gpu2"}
    for index, child in (("0", workers["worker-gpu0"]), ("2", workers["worker-gpu2"])):
        assert child.argv[-3:] == ["worker", "--device", "0"]
        assert child.env["CUDA_VISIBLE_DEVICES"] == index and child.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    cpu_only = Supervisor(Settings(devices="cpu", data_dir=tmp_path)).plan("redis://127.0.0.1:1/0")
    [cpu] = [c for c in cpu_only if c.name.startswith("worker")]
    assert cpu.argv[-1] == "cpu" and cpu.env["CUDA_VISIBLE_DEVICES"] == ""


def _record(device: WorkerDevice, pid: int, status: str = "idle") -> Device:
    """A heartbeat record as a worker of `device` with process `pid` publishes it."""
    return Device(id=device.id, type=device.kind, index=device.index, name="CPU", memory_total_bytes=None,
                  memory_used_bytes=None, utilization_percent=None, worker=device.worker_name, status=status,
                  current_job=None, loaded_models=[], last_heartbeat=utc_now_iso(), pid=pid)


def test_device_lock_refuses_a_live_holder_and_takes_over_from_a_crashed_one(clean_redis_url: str) -> None:
    """The registry's alive key is the device lock (real Redis)."""
    import redis as redis_lib

    from core import keys
    from core.devices import DeviceRegistry
    from core.errors import DeviceInUse
    from worker.runtime.main import _crashed_here

    device = WorkerDevice("cpu", None, "hosta")
    client = redis_lib.Redis.from_url(clean_redis_url, decode_responses=True)
    try:
        registry = DeviceRegistry(client, ttl_s=30)
        registry.acquire(device.id, "first")
        crashed = subprocess.Popen([sys.executable, "-c", "pass"])
        crashed.wait()
        registry.publish(device.id, "first", _record(device, crashed.pid))
        alive_pid = {"worker": device.worker_name, "pid": os.getpid()}
        assert _crashed_here({"worker": device.worker_name, "pid": crashed.pid}, device)
        assert not _crashed_here(alive_pid, device)
        assert not _crashed_here({"worker": "cpu@hostb", "pid": crashed.pid}, device)  # another host's worker

        with pytest.raises(DeviceInUse, match=f"already held by cpu@hosta \\(pid {crashed.pid}\\)"):
            registry.acquire(device.id, "second")  # the TTL has not lapsed and nobody says it crashed
        registry.acquire(device.id, "second", holder_is_dead=lambda holder: _crashed_here(holder, device))
        assert client.get(keys.device_alive(device.id)) == "second"
        assert not registry.publish(device.id, "first", _record(device, 1))  # the old one lost it
        assert registry.state(device.id)["pid"] == crashed.pid  # and cannot overwrite the new holder's record
        registry.release(device.id, "first", _record(device, 1, "offline"))
        assert client.get(keys.device_alive(device.id)) == "second" and registry.state(device.id)["pid"] == crashed.pid
        registry.release(device.id, "second", _record(device, 2, "offline"))
        assert client.get(keys.device_alive(device.id)) is None and registry.state(device.id)["pid"] == 2
    finally:
        client.close()


def test_a_lapsed_heartbeat_takes_its_free_device_back(clean_redis_url: str) -> None:
    import redis as redis_lib

    from core import keys
    from core.devices import DeviceRegistry

    client = redis_lib.Redis.from_url(clean_redis_url, decode_responses=True)
    try:
        registry = DeviceRegistry(client, ttl_s=30)
        registry.acquire("hosta/cpu", "first")
        client.delete(keys.device_alive("hosta/cpu"))  # as if the TTL lapsed while the worker stalled
        assert registry.publish("hosta/cpu", "first", _record(WorkerDevice("cpu", None, "hosta"), 1))
        assert client.get(keys.device_alive("hosta/cpu")) == "first" and client.pttl(keys.device_alive("hosta/cpu")) > 0
    finally:
        client.close()


@pytest.mark.parametrize(("arg", "outer", "message"), [
    ("0", "", "shows this process no GPU"),          # empty is not unset: it hides every GPU
    ("0", " , ", "shows this process no GPU"),
    ("0", "-1", "shows this process no GPU"),
    (UUID_B, UUID_A, "not among CUDA_VISIBLE_DEVICES"),
    ("0", "MIG-GPU-8a1b2c3d/1/0", "older MIG-GPU"),
])
def test_a_pin_that_cannot_work_is_refused_with_why(arg: str, outer: str, message: str) -> None:
    with pytest.raises(PinningError, match=message):
        pinned_environment(DeviceChoice.parse(arg), {"CUDA_VISIBLE_DEVICES": outer})


def test_gpus_chosen_by_uuid_get_device_ids_of_their_own() -> None:
    """`up` under CUDA_VISIBLE_DEVICES=<uuid>,<uuid> pins each worker to one entry and starts it as
    --device 0: each worker names its device by its UUID. Before, every one was cuda:0, the second
    was refused the device lock (gpu0@node held) and restarted forever."""
    named = set()
    for entry in (UUID_A, UUID_B, MIG):
        choice = DeviceChoice.parse("0")
        pinned = pinned_environment(choice, {"CUDA_VISIBLE_DEVICES": entry})
        device = resolve_worker_device(choice, "nodea", None, pinned)
        assert device == WorkerDevice("cuda", None, "nodea", selector=entry) and device.torch_device == "cuda:0"
        assert device.id == f"nodea/cuda:{entry}" and device.worker_name == f"{entry}@nodea"
        named.add(device.id)
    assert len(named) == 3
    in_container = resolve_worker_device(DeviceChoice.parse("0"), "nodea", None,
                                         {"CUDA_VISIBLE_DEVICES": "0", "NVIDIA_VISIBLE_DEVICES": UUID_B})
    assert in_container.id == f"nodea/cuda:{UUID_B}"


def test_devices_setting_takes_indices_and_uuids_and_refuses_the_rest() -> None:
    from pydantic import ValidationError

    from core.config import Settings

    assert Settings(_env_file=None, devices=f"0, {UUID_A}").devices == f"0,{UUID_A}"
    for bad in ("cuda:0", "0,,1", "MIG-GPU-8a1b2c3d/1/0", "all"):
        with pytest.raises(ValidationError, match="TORCHYARD_DEVICES"):
            Settings(_env_file=None, devices=bad)


@pytest.mark.parametrize(("args", "env", "message"), [
    (["worker", "--device", "0"], {"CUDA_VISIBLE_DEVICES": ""}, "shows this process no GPU"),
    (["up"], {"TORCHYARD_DEVICES": "gpu0"}, "TORCHYARD_DEVICES"),
])
def test_the_cli_refuses_a_device_that_cannot_work_with_status_2(args: list[str], env: dict, message: str,
                                                                   tmp_path) -> None:
    """One message and exit status 2 (before any torch import), not a worker restarted forever."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    environ.update(env, TORCHYARD_DATA_DIR=str(tmp_path), TORCHYARD_REDIS_URL="redis://127.0.0.1:1/0")
    result = subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=REPO, env=environ, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_nvml_failure_is_retried_later_not_latched() -> None:
    """No GPU here, so NVML cannot be read (no pynvml, or no driver): the read answers None, and is
    tried again once `retry_after_s` has passed; it used to give up for the process's life."""
    import torch

    from worker.device.info import NvmlUtilization

    if torch.cuda.is_available():
        pytest.skip("a GPU host reads NVML; this is the CPU twin of a failing read")
    retrying = NvmlUtilization(retry_after_s=0.0)
    assert retrying() is None and retrying() is None and retrying.attempts == 2
    waiting = NvmlUtilization(retry_after_s=3600.0)
    assert waiting() is None and waiting() is None and waiting.attempts == 1
