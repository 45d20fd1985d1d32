""".env.example documents every variable: each one docker-compose.yml reads, each setting the
deployment is built against (docs/deployment.md) and each field of core/config.Settings, every
one with a comment line above its (commented-out) assignment."""

from __future__ import annotations

import re
import sys

import pytest

from tests.deploy.support import COMPOSE_FILE, ENV_EXAMPLE, ROOT

# The settings the deployment is built against (see docs/deployment.md and core/config.py).
DOCUMENTED_SETTINGS = [
    "TORCHYARD_REDIS_URL",
    "TORCHYARD_DATA_DIR",
    "TORCHYARD_HOST",
    "TORCHYARD_PORT",
    "TORCHYARD_API_KEY",
    "TORCHYARD_NODE_NAME",
    "TORCHYARD_HOST_GPU_INDEX",
    "TORCHYARD_ALLOW_DOWNLOAD",
    "TORCHYARD_LEASE_TTL_S",
    "TORCHYARD_MAX_ATTEMPTS",
    "TORCHYARD_HEARTBEAT_INTERVAL_S",
    "TORCHYARD_HEARTBEAT_TTL_S",
    "TORCHYARD_PREDICT_TIMEOUT_S",
    "TORCHYARD_PREDICT_MAX_BATCH",
    "TORCHYARD_PREDICT_MAX_WAIT_MS",
    "TORCHYARD_MODEL_CACHE_COUNT",
    "TORCHYARD_MODEL_CACHE_BYTES",
    "TORCHYARD_MAX_IMAGE_BYTES",
    "TORCHYARD_MAX_IMAGE_PIXELS",
    "TORCHYARD_MAX_UPLOAD_BYTES",
    "TORCHYARD_DEVICES",
]


def test_compose_variables_are_documented_in_env_example():
    text = COMPOSE_FILE.read_text()
    documented = ENV_EXAMPLE.read_text()
    for var in set(re.findall(r"\$\{([A-Z0-9_]+)", text)):
        assert re.search(rf"^#?\s*{var}=", documented, re.M), f"{var} missing in .env.example"


def _settings_fields() -> list[str]:
    sys.path.insert(0, str(ROOT))
    try:
        from core.config import Settings
    finally:
        sys.path.remove(str(ROOT))
    return [f"TORCHYARD_{name.upper()}" for name in Settings.model_fields]


@pytest.mark.parametrize("source", ["deployment", "settings"])
def test_env_example_documents_every_setting(source):
    names = DOCUMENTED_SETTINGS if source == "deployment" else _settings_fields()
    lines = ENV_EXAMPLE.read_text().splitlines()
    for var in names:
        idx = next(
            (i for i, line in enumerate(lines) if re.match(rf"^#?\s*{var}=", line)), None
        )
        assert idx is not None, f"{var} has no (commented-out) assignment in .env.example"
        assert idx > 0 and lines[idx - 1].startswith("#") and len(lines[idx - 1]) > 3, (
            f"{var}: a comment line explaining it must precede it"
        )
