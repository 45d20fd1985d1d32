"""docker-compose.yml as Compose itself makes of it, no engine needed: the file matches the
Compose Specification's schema, and `docker-compose config` (anchors, merges, interpolation,
profiles) gives each GPU worker exactly its own GPU and nothing else one, renders the official
images by default and lets the variables `make compose-test` sets swap in stand-ins."""

from __future__ import annotations

import subprocess

from tests.deploy.support import COMPOSE_FILE, installed_tool, render_compose


def test_compose_file_matches_the_compose_specification():
    exe = installed_tool("check-jsonschema")
    assert exe, "check-jsonschema is not installed (it is in the `dev` extra)"
    proc = subprocess.run(
        [exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rendered_config_gives_each_gpu_worker_exactly_its_own_gpu():
    """What Docker receives: exactly one device_ids entry per GPU worker, equal to the
    TORCHYARD_HOST_GPU_INDEX that worker reports, and no GPU for anything else."""
    services = render_compose()["services"]
    gpu_workers = {name for name in services if name.startswith("worker-gpu")}
    assert gpu_workers >= {"worker-gpu0", "worker-gpu1"}, sorted(services)
    assert "worker-cpu" not in services and "flower" not in services, "profiles must keep them out"
    seen = {}
    for name, svc in services.items():
        devices = ((svc.get("deploy") or {}).get("resources", {}).get("reservations") or {}).get("devices") or []
        if name not in gpu_workers:
            assert not devices, f"{name} reserves {devices}"
            continue
        assert len(devices) == 1, f"{name}: {devices}"
        device = devices[0]
        assert device.get("driver") == "nvidia" and device.get("capabilities") == ["gpu"], device
        assert "count" not in device, f"{name}: count next to device_ids"
        ids = device.get("device_ids")
        assert isinstance(ids, list) and len(ids) == 1, f"{name}: device_ids {ids}"
        assert svc["environment"].get("TORCHYARD_HOST_GPU_INDEX") == ids[0], (name, svc["environment"], ids)
        assert svc["command"] == ["torchyard", "worker", "--device", "0"], svc["command"]
        assert ids[0] not in seen, f"{name} and {seen.get(ids[0])} share GPU {ids[0]}"
        seen[ids[0]] = name
    cpu = render_compose("--profile", "cpu")["services"]["worker-cpu"]
    assert "deploy" not in cpu or not cpu["deploy"].get("resources"), cpu.get("deploy")
    assert "TORCHYARD_HOST_GPU_INDEX" not in cpu["environment"]


def test_rendered_defaults_are_the_official_images_and_variables_override_them():
    """A user with internet gets exactly the official bases (`docker compose up -d --build`);
    the variables make-compose-test sets swap in stand-ins without touching the file."""
    services = render_compose()["services"]
    assert services["redis"]["image"] == "redis:7.4-alpine"
    args = services["api"]["build"]["args"]
    assert args["PYTHON_IMAGE"] == "python:3.11-slim-bookworm" and args["PIP_CERT"] == "", args
    assert services["api"]["image"] == "torchyard:latest"
    assert services["api"]["ports"][0]["published"] == "8000"
    env = {"TORCHYARD_PYTHON_IMAGE": "local/python:x", "TORCHYARD_PIP_CERT": "/ca.pem",
           "TORCHYARD_REDIS_IMAGE": "local/redis:x", "TORCHYARD_IMAGE": "torchyard:ci", "TORCHYARD_PORT": "18000",
           "TORCHYARD_API_KEY": "k"}
    services = render_compose("--profile", "cpu", env=env)["services"]
    assert services["redis"]["image"] == "local/redis:x"
    for name in ("api", "worker-cpu", "worker-gpu0"):
        assert services[name]["build"]["args"] == {"PYTHON_IMAGE": "local/python:x", "PIP_CERT": "/ca.pem"}, name
        assert services[name]["image"] == "torchyard:ci"
        assert services[name]["environment"]["TORCHYARD_API_KEY"] == "k"
    assert services["api"]["ports"][0]["published"] == "18000"
