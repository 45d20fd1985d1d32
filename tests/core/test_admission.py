"""core/admission.py: the memory estimate of a job and the refusal that says what would fit, against
device records like those the workers publish (no worker needed: the check is arithmetic)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from core.admission import JobShape, activation_bytes_per_image, check_admission, estimate
from core.config import Settings
from core.datasets import BUILTINS, DatasetRecord
from core.errors import InvalidInput
from core.schemas import Device
from models.registry import MODELS, trace_activation_bytes

GiB = 1024**3


def _device(kind: str, memory: int, host: int | None, name: str = "h") -> Device:
    return Device(id=f"{name}/{'cpu' if kind == 'cpu' else 'cuda:0'}", type=kind, index=None if kind == "cpu" else 0,
                  name="x", memory_total_bytes=memory, memory_used_bytes=0, utilization_percent=None, worker="w",
                  status="idle", current_job=None, loaded_models=[], last_heartbeat=datetime.now(UTC),
                  host_memory_total_bytes=host)


def _shape(model: str = "resnet18", size: int = 32, batch: int | None = 128, dataset: str = "fake") -> JobShape:
    return JobShape(MODELS[model], BUILTINS[dataset], 1 if model == "catdog_net" else 3, size, batch, "adam", 0.1)


def test_activations_grow_with_the_input_area_as_traced() -> None:
    resnet18 = MODELS["resnet18"]
    small, large = activation_bytes_per_image(resnet18, 64, 64), activation_bytes_per_image(resnet18, 128, 128)
    assert 3.8 < large / small < 4.2  # four times the pixels, about four times the activations
    assert activation_bytes_per_image(MODELS["cifar_net"], 32, 32) > 0


@pytest.mark.parametrize("model", ["resnet18", "mobilenet_v3_small"])
@pytest.mark.parametrize("size", [48, 224])
def test_interpolated_activations_are_near_a_trace_at_that_size(model: str, size: int) -> None:
    traced = trace_activation_bytes(model, size, size)
    assert abs(activation_bytes_per_image(MODELS[model], size, size) / traced - 1) < 0.1


def test_the_estimate_grows_with_image_size_batch_and_data() -> None:
    base = estimate(_shape(size=64), "cpu").host_bytes
    assert estimate(_shape(size=128), "cpu").host_bytes > base
    assert estimate(_shape(size=64, batch=512), "cpu").host_bytes > base
    upload = DatasetRecord(id="u", name="u", kind="upload", num_images=100_000)
    bigger = JobShape(MODELS["resnet18"], upload, 3, 64, 128, "adam", 0.1)
    assert estimate(bigger, "cpu").host_bytes > base
    # On a GPU worker the batches are the GPU's; the data stays on the host.
    gpu = estimate(_shape(size=64), "cuda")
    assert gpu.device_bytes > 0 and gpu.host_bytes < estimate(_shape(size=64), "cpu").host_bytes


def test_a_job_that_fits_is_admitted_and_no_worker_means_no_judgement() -> None:
    settings = Settings(_env_file=None)
    check_admission(_shape(), [_device("cpu", 16 * GiB, 16 * GiB)], settings)
    check_admission(_shape(model="resnet18", size=512, batch=8192), [], settings)  # nothing to measure against
    check_admission(_shape(model="resnet18", size=512, batch=8192), [_device("cpu", GiB, GiB)],
                    Settings(_env_file=None, admission_check=False))


def test_too_large_is_refused_with_the_largest_size_and_batch_that_fit() -> None:
    settings = Settings(_env_file=None)
    with pytest.raises(InvalidInput) as refused:
        check_admission(_shape(size=512, batch=128), [_device("cpu", 16 * GiB, 16 * GiB)], settings)
    detail = refused.value.detail
    assert "does not fit in memory" in detail and "h/cpu" in detail and "TORCHYARD_ADMISSION_HEADROOM=0.2" in detail
    assert "image_size up to" in detail
    size = int(detail.split("image_size up to ")[1].split(" ")[0])
    check_admission(_shape(size=size, batch=128), [_device("cpu", 16 * GiB, 16 * GiB)], settings)  # and it does fit
    with pytest.raises(InvalidInput):
        check_admission(_shape(size=size + 1, batch=128), [_device("cpu", 16 * GiB, 16 * GiB)], settings)


def test_a_gpu_too_small_for_the_batches_and_a_fleet_where_only_some_fit() -> None:
    settings = Settings(_env_file=None)
    small = _device("cuda", 4 * GiB, 64 * GiB, "small")
    big = _device("cuda", 80 * GiB, 512 * GiB, "big")
    shape = _shape(size=224, batch=512)
    with pytest.raises(InvalidInput) as refused:
        check_admission(shape, [small, big], settings)
    assert "GPU memory on small/cuda:0" in refused.value.detail
    assert "It fits on big/cuda:0" in refused.value.detail  # `auto` could land on either: pin it
    check_admission(shape, [big], settings)
    # The host of a GPU worker holds the data: cifar10 at 512 is 39 GB of uint8, twice.
    with pytest.raises(InvalidInput) as refused:
        check_admission(_shape(size=512, batch=64, dataset="cifar10"), [_device("cuda", 80 * GiB, 64 * GiB)], settings)
    assert "host RAM" in refused.value.detail
