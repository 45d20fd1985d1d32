"""Is the API's port free (app/ports.py), as `up` and `api` ask before they start anything: a free
port is; one a process listens on is not, and the answer names that process."""

from __future__ import annotations

import os
import socket

from app.ports import holder_of, port_in_use
from harness import free_port


def test_a_free_port_is_free() -> None:
    assert port_in_use("127.0.0.1", free_port()) is None


def test_a_port_in_use_names_the_process_that_listens_on_it() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        said = port_in_use("127.0.0.1", port)
        assert said is not None and said.startswith(f"port {port} on 127.0.0.1 is already in use")
        assert holder_of(port).startswith(f" by pid {os.getpid()} (")  # this test's own process, its command line
    assert port_in_use("127.0.0.1", port) is None  # closed: free again
