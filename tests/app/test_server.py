"""app/server.py's start-up rule: no key on a non-loopback address is refused unless the operator
opts out explicitly, and then it says so loudly. (The refusal through the real `torchyard api` and
`up` processes: tests/e2e/test_security.py.)"""

from __future__ import annotations

import logging

import pytest

from app.server import unsafe_bind_refusal, warn_if_open
from core.config import Settings


def test_refused_only_without_a_key_beyond_loopback_unless_allowed(caplog: pytest.LogCaptureFixture) -> None:
    assert unsafe_bind_refusal(Settings(_env_file=None, host="127.0.0.1")) is None
    assert unsafe_bind_refusal(Settings(_env_file=None, host="0.0.0.0", api_key="k", allowed_hosts="gpu-box")) is None
    refusal = unsafe_bind_refusal(Settings(_env_file=None, host="0.0.0.0"))
    assert refusal and "TORCHYARD_API_KEY" in refusal and "TORCHYARD_ALLOW_UNAUTHENTICATED" in refusal
    allowed = Settings(_env_file=None, host="0.0.0.0", allow_unauthenticated=True, allowed_hosts="*")
    assert unsafe_bind_refusal(allowed) is None
    with caplog.at_level(logging.WARNING, logger="torchyard.api"):
        warn_if_open(allowed)
        warn_if_open(Settings(_env_file=None, host="127.0.0.1"))  # loopback: nothing to say
    assert sum("NO AUTHENTICATION" in r.message for r in caplog.records) == 1


def test_beyond_loopback_the_host_names_must_be_said() -> None:
    """The Host check (DNS rebinding) was off on a non-loopback bind unless TORCHYARD_ALLOWED_HOSTS
    was set: now such a bind needs the names, or '*' said explicitly (key or no key)."""
    for opened in ({"api_key": "k"}, {"allow_unauthenticated": True}):
        for host in ("0.0.0.0", "192.168.1.10", "gpu-box"):
            refusal = unsafe_bind_refusal(Settings(_env_file=None, host=host, **opened))
            assert refusal and "TORCHYARD_ALLOWED_HOSTS" in refusal and "'*'" in refusal, (host, opened)
        for names in ("*", "torchyard.internal, 10.0.0.5"):
            assert unsafe_bind_refusal(Settings(_env_file=None, host="0.0.0.0", allowed_hosts=names, **opened)) is None
    assert unsafe_bind_refusal(Settings(_env_file=None, host="127.0.0.1", api_key="k")) is None


def test_metrics_dirs_of_gone_parents_are_removed_and_a_fresh_one_is_made(tmp_path) -> None:
    """Files an earlier API parent left (SIGKILL: no clean-up) would be summed into the new one's
    counters: they go, a live parent's stay, and each start gets an empty directory it removes."""
    import os
    import subprocess
    import sys

    from app.api import metrics
    from app.server import METRICS_DIR_PREFIX, MULTIPROC_ENV, private_metrics_dir

    assert MULTIPROC_ENV == metrics.MULTIPROC_ENV == "PROMETHEUS_MULTIPROC_DIR"  # one variable, two readers

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tmp_path / f"{METRICS_DIR_PREFIX}{dead}-abc"
    ours = tmp_path / f"{METRICS_DIR_PREFIX}{os.getpid()}-old"  # a restarted container reuses pids
    live = tmp_path / f"{METRICS_DIR_PREFIX}1-xyz"  # pid 1 is always running
    unrelated = tmp_path / "torchyard-other"
    for path in (stale, ours, live, unrelated):
        path.mkdir()
        (path / "counter_123.db").write_bytes(b"x")
    with private_metrics_dir(tmp_path) as fresh:
        assert fresh.is_dir() and list(fresh.iterdir()) == []
        assert fresh.name.startswith(f"{METRICS_DIR_PREFIX}{os.getpid()}-")
        assert not stale.exists() and not ours.exists()
        assert live.exists() and unrelated.exists()
    assert not fresh.exists()
