"""Shared fixtures. Tests talk to a real Redis: TORCHYARD_REDIS_URL when set (database 13 of it,
the only one they flush), else an embedded redis-server started for the session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.embedded_redis import EmbeddedRedis
from tests.support import TEST_DB, Processes, flush, free_port, wait_until, with_db


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked `gpu` need CUDA: skipped, saying so, where torch sees no GPU (torch is imported
    only for them, so a run without any stays light)."""
    if item.get_closest_marker("gpu") is None:
        return
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: no GPU is visible to torch here (docs/gpu.md: the GPU tests)")


@pytest.fixture(scope="session")
def redis_base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    configured = os.environ.get("TORCHYARD_REDIS_URL")
    if configured:
        yield configured
        return
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_base_url: str) -> str:
    url = with_db(redis_base_url, TEST_DB)
    flush(url)
    return url


@pytest.fixture
def clean_redis_url(redis_base_url: str) -> str:
    """A database of its own, flushed, for tests that must not see the shared stack's keys."""
    url = with_db(redis_base_url, TEST_DB + 1)
    flush(url)
    return url


@pytest.fixture(scope="session")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One CPU worker and the API, as real processes, shared by the end-to-end tests."""
    data_dir = tmp_path_factory.mktemp("data")
    procs = Processes(redis_url, data_dir, data_dir / "logs")
    port = free_port()
    worker = procs.worker("cpu")
    api = procs.api(port)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        wait_until(lambda: client.get("/healthz").status_code == 200, timeout=60, what="the API")
        wait_until(lambda: client.get("/readyz").status_code == 200, timeout=90, what="a worker heartbeat")
        yield {"client": client, "procs": procs, "worker": worker, "api": api, "data_dir": Path(data_dir),
               "redis_url": redis_url, "port": port}
    finally:
        client.close()
        procs.stop_all()
