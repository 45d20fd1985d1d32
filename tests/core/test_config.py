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


DECODE_NEW, DECODE_OLD = "TORCHYARD_PREDICT_DECODE_PROCESSES", "TORCHYARD_PREDICT_DECODE_THREADS"


def test_decode_processes_by_its_name_and_by_its_former_name(monkeypatch, tmp_path) -> None:
    """The setting was named for threads until /predict decoding moved to processes: deployments
    that set the old name keep their value. When both are set in one source, the new name wins
    (pydantic-settings takes the first name of AliasChoices that the source holds); between
    sources the usual order holds: the environment over the .env file, whichever name each uses."""
    monkeypatch.delenv(DECODE_NEW, raising=False)
    monkeypatch.delenv(DECODE_OLD, raising=False)
    assert Settings(_env_file=None).predict_decode_processes is None
    monkeypatch.setenv(DECODE_NEW, "3")
    assert Settings(_env_file=None).predict_decode_processes == 3
    monkeypatch.delenv(DECODE_NEW)
    monkeypatch.setenv(DECODE_OLD, "5")
    assert Settings(_env_file=None).predict_decode_processes == 5
    monkeypatch.setenv(DECODE_NEW, "2")
    assert Settings(_env_file=None).predict_decode_processes == 2
    monkeypatch.setenv(DECODE_NEW, "")  # empty means unset: the old name's value stands
    assert Settings(_env_file=None).predict_decode_processes == 5
    monkeypatch.delenv(DECODE_NEW)
    monkeypatch.delenv(DECODE_OLD)

    dotenv = tmp_path / ".env"
    dotenv.write_text(f"{DECODE_OLD}=6\n{DECODE_NEW}=4\n")
    assert Settings(_env_file=dotenv).predict_decode_processes == 4
    dotenv.write_text(f"{DECODE_OLD}=6\n")
    assert Settings(_env_file=dotenv).predict_decode_processes == 6
    monkeypatch.setenv(DECODE_NEW, "7")
    assert Settings(_env_file=dotenv).predict_decode_processes == 7
    # In code the field is set by its name (a name that were dropped as an extra would leave None).
    assert Settings(_env_file=None, predict_decode_processes=8).predict_decode_processes == 8


def test_a_bad_decode_processes_value_is_refused_naming_the_variable(monkeypatch) -> None:
    import pydantic
    import pytest

    for name in (DECODE_NEW, DECODE_OLD):
        for value in ("0", "-2", "many", "1.5"):
            monkeypatch.delenv(DECODE_NEW, raising=False)
            monkeypatch.delenv(DECODE_OLD, raising=False)
            monkeypatch.setenv(name, value)
            with pytest.raises(pydantic.ValidationError) as refused:
                Settings(_env_file=None)
            said = str(refused.value)
            assert f"{DECODE_NEW} (or its former name {DECODE_OLD})={value!r}" in said, said
            assert "1 or more" in said, said


def test_the_cli_refuses_a_bad_decode_processes_value_in_one_line(tmp_path) -> None:
    """What an operator sees: `torchyard worker` exits 2 with the variable named, no traceback."""
    import os
    import subprocess
    import sys

    from tests.support import REPO

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env.update({DECODE_OLD: "0", "TORCHYARD_DATA_DIR": str(tmp_path)})
    run = subprocess.run([sys.executable, "-m", "app.cli", "worker", "--device", "cpu"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    said = run.stdout + run.stderr
    assert run.returncode == 2, said
    assert "invalid settings" in said and f"(or its former name {DECODE_OLD})='0'" in said, said
    assert "Traceback" not in said, said
