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
    assert unsafe_bind_refusal(Settings(_env_file=None, host="0.0.0.0", api_key="k")) is None
    refusal = unsafe_bind_refusal(Settings(_env_file=None, host="0.0.0.0"))
    assert refusal and "TORCHYARD_API_KEY" in refusal and "TORCHYARD_ALLOW_UNAUTHENTICATED" in refusal
    allowed = Settings(_env_file=None, host="0.0.0.0", allow_unauthenticated=True)
    assert unsafe_bind_refusal(allowed) is None
    with caplog.at_level(logging.WARNING, logger="torchyard.api"):
        warn_if_open(allowed)
        warn_if_open(Settings(_env_file=None, host="127.0.0.1"))  # loopback: nothing to say
    assert sum("NO AUTHENTICATION" in r.message for r in caplog.records) == 1
