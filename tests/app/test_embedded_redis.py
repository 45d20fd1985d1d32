"""The embedded Redis refuses to start over a live one on the same files."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from app.embedded_redis import EmbeddedRedis


def test_a_second_server_on_the_same_directory_refuses_and_the_first_goes_on(tmp_path: Path) -> None:
    first = EmbeddedRedis(tmp_path / "redis")
    url = first.start()
    try:
        redis.Redis.from_url(url).set("kept", 1)
        with pytest.raises(RuntimeError, match="already listens"):
            EmbeddedRedis(tmp_path / "redis").start()
        assert redis.Redis.from_url(url).get("kept") == b"1"
    finally:
        first.stop()
