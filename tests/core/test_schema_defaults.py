"""The OpenAPI descriptions of the defaults say what the code decides (#28: the schedule's said
onecycle and the CPU batch of a predict job 64, while jobs ran cosine/constant and 128)."""

from core.params import DEFAULT_BATCH_SIZE, DEFAULT_WEIGHT_DECAY, RECIPE
from core.schemas import JobSpec, PredictSpec


def _says(model: type, field: str) -> str:
    return model.model_fields[field].description or ""


def test_training_defaults_described_as_resolved() -> None:
    assert f"Default: {RECIPE.schedule}" in _says(JobSpec, "schedule")
    assert f"at least {RECIPE.min_schedule_steps} optimizer steps" in _says(JobSpec, "schedule")
    assert f"{RECIPE.warmup_fraction['cosine']:g} (cosine)" in _says(JobSpec, "warmup_fraction")
    assert f"{RECIPE.warmup_fraction['onecycle']:g} (onecycle)" in _says(JobSpec, "warmup_fraction")
    assert f"Default: {RECIPE.label_smoothing:g} (off)" in _says(JobSpec, "label_smoothing")
    assert f"Default: {RECIPE.patience}." in _says(JobSpec, "patience")
    assert f"Default: {RECIPE.optimizer}." in _says(JobSpec, "optimizer")
    assert f"{DEFAULT_BATCH_SIZE['cuda']} on a GPU, {DEFAULT_BATCH_SIZE['cpu']} on a CPU" in _says(JobSpec, "batch_size")
    assert set(DEFAULT_WEIGHT_DECAY) == {"sgd", "adam", "adamw"}  # "per optimizer"


def test_predict_job_batch_described_as_the_worker_picks_it() -> None:
    from worker.predict_job import DEFAULT_CPU_BATCH, DEFAULT_GPU_BATCH

    assert f"{DEFAULT_CPU_BATCH} on a CPU, {DEFAULT_GPU_BATCH} on a GPU" in _says(PredictSpec, "batch_size")
