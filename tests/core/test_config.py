from pathlib import Path

from core.config import Settings


def test_defaults(monkeypatch) -> None:
    for key in ("TORCHYARD_REDIS_URL", "TORCHYARD_DATA_DIR", "TORCHYARD_PORT", "TORCHYARD_HOST", "TORCHYARD_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    settings = Settings(_env_file=None)
    assert settings.redis_url is None and settings.api_key is None
    assert settings.data_dir == Path("./var") and (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert settings.resolved_redis_url().startswith("unix://") and settings.resolved_redis_url().endswith("redis.sock?db=0")


def test_environment_with_prefix(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TORCHYARD_REDIS_URL", "redis://example:6380/2")
    monkeypatch.setenv("TORCHYARD_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHYARD_PORT", "9000")
    monkeypatch.setenv("TORCHYARD_API_KEY", "s3cret")
    settings = Settings(_env_file=None)
    assert settings.resolved_redis_url() == "redis://example:6380/2"
    assert settings.checkpoints_dir == tmp_path / "checkpoints" and settings.port == 9000
    assert settings.api_key.get_secret_value() == "s3cret" and "s3cret" not in repr(settings)


def test_empty_values_mean_unset(monkeypatch) -> None:
    monkeypatch.setenv("TORCHYARD_API_KEY", "")
    monkeypatch.setenv("TORCHYARD_HOST_GPU_INDEX", "")
    settings = Settings(_env_file=None)
    assert settings.api_key is None and settings.host_gpu_index is None


def test_api_workers_default_is_half_the_cores_from_1_to_4(monkeypatch) -> None:
    import pydantic
    import pytest

    monkeypatch.delenv("TORCHYARD_API_WORKERS", raising=False)
    for cores, expected in ((1, 1), (2, 1), (3, 1), (4, 2), (8, 4), (64, 4)):
        monkeypatch.setattr("os.sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert Settings(_env_file=None).api_workers == expected, cores
    monkeypatch.setenv("TORCHYARD_API_WORKERS", "6")
    assert Settings(_env_file=None).api_workers == 6
    monkeypatch.setenv("TORCHYARD_API_WORKERS", "0")
    with pytest.raises(pydantic.ValidationError):
        Settings(_env_file=None)
