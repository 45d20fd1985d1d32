"""docker-compose.yml as written: the services and their profiles, one distinct NVIDIA GPU per GPU
worker (renumbered GPU 0 inside, the host index reported), torchyard commands the installed CLI
accepts, one data volume and one Redis shared by the API and the workers, Redis's AOF, the API's
port and health check, the workers' stop grace and restart policy. (As Compose renders it:
test_compose_rendered.py.)"""

from __future__ import annotations

import os
import subprocess

from tests.deploy.support import (
    as_argv,
    device_arg,
    duration_seconds,
    gpu_worker_services,
    installed_tool,
    load_compose,
    reserved_devices,
    service_env,
    size_bytes,
    torchyard_services,
    unset_default,
    volume_mounts,
    worker_services,
)

TORCHYARD_SUBCOMMANDS = {"up", "api", "worker"}
MIN_WORKER_STOP_GRACE_S = 60


def test_compose_has_the_expected_services_and_profiles():
    services = load_compose()["services"]
    for name in ("redis", "api", "worker-gpu0", "worker-gpu1", "worker-cpu", "flower", "mlflow"):
        assert name in services, f"service {name} missing"
    # Default set on an NVIDIA host: redis, api and the GPU workers (no profile).
    for name in ("redis", "api", "worker-gpu0", "worker-gpu1"):
        assert not services[name].get("profiles"), f"{name} must start by default"
    assert services["worker-cpu"].get("profiles") == ["cpu"]
    assert services["flower"].get("profiles") == ["flower"]
    assert services["mlflow"].get("profiles") == ["mlflow"]  # the tracking server, optional


def test_every_gpu_worker_reserves_exactly_one_distinct_nvidia_gpu():
    compose = load_compose()
    gpu_workers = gpu_worker_services(compose)
    assert len(gpu_workers) >= 2, "expected worker-gpu0 and worker-gpu1"
    seen: dict[str, str] = {}
    for name, svc in gpu_workers.items():
        devices = reserved_devices(svc)
        assert len(devices) == 1, f"{name}: exactly one device reservation expected"
        dev = devices[0]
        assert dev.get("driver") == "nvidia", name
        assert list(dev.get("capabilities") or []) == ["gpu"], name
        ids = [str(i) for i in dev.get("device_ids") or []]
        assert len(ids) == 1 and ids[0].isdigit(), f"{name}: one GPU index in device_ids, got {ids}"
        assert "count" not in dev, f"{name}: `count` next to `device_ids` is rejected by Docker"
        assert ids[0] not in seen, f"{name} and {seen.get(ids[0])} reserve the same GPU {ids[0]}"
        seen[ids[0]] = name


def test_no_service_combines_count_with_device_ids():
    for name, svc in load_compose()["services"].items():
        for dev in reserved_devices(svc):
            assert not ("count" in dev and "device_ids" in dev), name


def test_gpu_workers_use_renumbered_gpu_zero_and_report_the_host_index():
    for name, svc in gpu_worker_services(load_compose()).items():
        argv = as_argv(svc["command"])
        assert device_arg(argv) == "0", f"{name}: the reserved GPU is GPU 0 inside the container"
        host_index = service_env(svc).get("TORCHYARD_HOST_GPU_INDEX")
        reserved = str(reserved_devices(svc)[0]["device_ids"][0])
        assert host_index == reserved, (
            f"{name}: TORCHYARD_HOST_GPU_INDEX={host_index!r} but device_ids={reserved!r}"
        )


def test_only_gpu_workers_get_gpus_and_the_cpu_worker_runs_on_cpu():
    compose = load_compose()
    gpu_workers = gpu_worker_services(compose)
    for name, svc in worker_services(compose).items():
        device = device_arg(as_argv(svc["command"]))
        assert device is not None, f"{name}: worker without --device"
        if name in gpu_workers:
            assert device.isdigit(), name
        else:
            assert device == "cpu", f"{name}: a worker without a GPU reservation must use the cpu"
            assert "TORCHYARD_HOST_GPU_INDEX" not in service_env(svc), name
    for name in ("api", "redis", "flower"):
        assert not reserved_devices(compose["services"][name]), f"{name} needs no GPU"
    cpu = compose["services"]["worker-cpu"]
    assert as_argv(cpu["command"]) == ["torchyard", "worker", "--device", "cpu"]


def test_torchyard_services_run_torchyard_subcommands():
    services = load_compose()["services"]
    assert as_argv(services["api"]["command"]) == ["torchyard", "api"]
    for name, svc in torchyard_services(load_compose()).items():
        argv = as_argv(svc["command"])
        assert argv[1] in TORCHYARD_SUBCOMMANDS, f"{name}: unknown subcommand {argv[1]!r}"


def test_compose_commands_are_accepted_by_the_installed_torchyard_cli(tmp_path):
    """Each api/worker command, plus --help, through the real console script: the subcommand
    exists and its arguments parse (e.g. `--device 0` and `--device cpu`)."""
    exe = installed_tool("torchyard")
    assert exe, "the `torchyard` console script is not installed (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    env["TORCHYARD_DATA_DIR"] = str(tmp_path / "var")
    argvs = {tuple(as_argv(svc["command"])) for svc in torchyard_services(load_compose()).values()}
    for argv in sorted(argvs):
        proc = subprocess.run(
            [exe, *argv[1:], "--help"],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=tmp_path,
            env=env,
        )
        assert proc.returncode == 0, f"{' '.join(argv)} --help: {proc.stdout}{proc.stderr}"
        assert "usage" in (proc.stdout + proc.stderr).lower(), proc.stdout


def test_api_and_workers_share_one_named_data_volume_at_the_data_dir():
    compose = load_compose()
    named_volumes = set((compose.get("volumes") or {}).keys())
    mounts_seen = set()
    for name, svc in torchyard_services(compose).items():
        data_dir = service_env(svc).get("TORCHYARD_DATA_DIR")
        assert data_dir, f"{name}: TORCHYARD_DATA_DIR not set"
        mounts = [(src, kind) for src, target, kind in volume_mounts(svc) if target == data_dir]
        assert len(mounts) == 1, f"{name}: one volume must be mounted at {data_dir}"
        source, kind = mounts[0]
        assert kind == "volume" and source in named_volumes, f"{name}: {source} is not a named volume"
        mounts_seen.add((source, data_dir))
    assert len(mounts_seen) == 1, f"api and workers must share one volume and path: {mounts_seen}"


def test_api_and_workers_share_redis_and_settings():
    compose = load_compose()
    for name, svc in torchyard_services(compose).items():
        env = service_env(svc)
        assert env.get("TORCHYARD_REDIS_URL") == "redis://redis:6379/0", name
        assert env.get("TORCHYARD_API_KEY", "").startswith("${TORCHYARD_API_KEY:?"), name  # required: no open API beyond loopback
        assert svc.get("build", {}).get("dockerfile") == "docker/Dockerfile", name
        assert svc.get("image") == compose["services"]["api"]["image"], f"{name}: one image for all"
        depends = svc.get("depends_on") or {}
        assert isinstance(depends, dict), f"{name}: depends_on needs the long form with a condition"
        assert depends.get("redis", {}).get("condition") == "service_healthy", name


def test_redis_persists_with_aof_on_a_named_volume():
    compose = load_compose()
    redis = compose["services"]["redis"]
    assert unset_default(redis["image"]).startswith("redis:7")
    argv = as_argv(redis["command"])
    text = " ".join(argv)
    assert "--appendonly yes" in text, argv
    assert "--appendfsync everysec" in text, argv
    data = [(src, kind) for src, target, kind in volume_mounts(redis) if target == "/data"]
    assert data and data[0][1] == "volume" and data[0][0] in (compose.get("volumes") or {}), data
    assert "redis-cli ping" in " ".join(as_argv(redis["healthcheck"]["test"]))


def test_api_binds_all_interfaces_publishes_8000_and_checks_healthz():
    api = load_compose()["services"]["api"]
    env = service_env(api)
    assert env.get("TORCHYARD_HOST") == "0.0.0.0"
    port = env.get("TORCHYARD_PORT", "8000")
    published = [str(p) for p in api.get("ports") or []]
    assert any(p.endswith(f":{port}") for p in published), published
    test = " ".join(as_argv(api["healthcheck"]["test"]))
    assert "/healthz" in test and f":{port}/" in test, test
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"


def test_workers_get_a_long_stop_grace_period_and_restart():
    workers = worker_services(load_compose())
    assert workers
    for name, svc in workers.items():
        assert "stop_grace_period" in svc, name
        assert duration_seconds(svc["stop_grace_period"]) >= MIN_WORKER_STOP_GRACE_S, name
        assert svc.get("restart") in ("always", "unless-stopped", "on-failure"), name
        assert svc.get("stop_signal", "SIGTERM") in ("SIGTERM", "TERM", "15"), name
        # DataLoader workers pass batches through /dev/shm; Docker's default 64 MB is too small.
        assert size_bytes(svc.get("shm_size", "64m")) >= 1024**3, f"{name}: shm_size below 1 GiB"
        assert svc.get("healthcheck", {}).get("disable") is True, (
            f"{name}: the image's HEALTHCHECK probes the API; workers must override it"
        )
