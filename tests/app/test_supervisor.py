"""What `torchyard up` hands its workers (app/supervisor.Supervisor.plan), without starting any."""

from __future__ import annotations

from pathlib import Path

from app.supervisor import Supervisor
from core.config import Settings


def _workers_env(settings: Settings) -> list[dict[str, str]]:
    return [c.env for c in Supervisor(settings).plan("unix:///tmp/none.sock") if c.name.startswith("worker")]


def test_with_its_embedded_redis_the_workers_advertise_loopback(tmp_path: Path, monkeypatch) -> None:
    """The embedded Redis is a unix socket, so every rank of a gang is on this host: rank 0's
    rendezvous store listens on loopback, not on what the host name resolves to (often the LAN)."""
    monkeypatch.delenv("TORCHYARD_ADVERTISE_ADDRESS", raising=False)
    embedded = _workers_env(Settings(devices="cpu", data_dir=tmp_path, redis_url=None))
    assert [env["TORCHYARD_ADVERTISE_ADDRESS"] for env in embedded] == ["127.0.0.1"]
    # An operator's own address stands; with a Redis of their own other hosts may join the gangs.
    own = _workers_env(Settings(devices="cpu", data_dir=tmp_path, redis_url=None, advertise_address="10.1.2.3"))
    assert all(env.get("TORCHYARD_ADVERTISE_ADDRESS") != "127.0.0.1" for env in own)
    shared = _workers_env(Settings(devices="cpu", data_dir=tmp_path, redis_url="redis://10.1.2.4:6379/0"))
    assert all("TORCHYARD_ADVERTISE_ADDRESS" not in env for env in shared)
