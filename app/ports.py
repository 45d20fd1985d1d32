"""Is the API's port free, and if not, who holds it: asked before `up` starts anything and before
`torchyard api` starts serving, so a second `make run` on a port in use says so and exits, instead
of starting a second Redis and worker and restarting an API that can never bind."""

from __future__ import annotations

import errno
import socket

import psutil


def port_in_use(host: str, port: int) -> str | None:
    """None when `host:port` can be bound now (as uvicorn binds it: SO_REUSEADDR), else what a
    person needs to know: the address and, when this user may see it, the process holding it."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot bind {host}:{port}: {exc.strerror}"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return f"port {port} on {host} is already in use{holder_of(port)}"
                return f"cannot bind {host}:{port}: {exc.strerror}"
    return None


def holder_of(port: int) -> str:
    """' by pid N (its command line)' for the process listening on `port`, or '' when it cannot
    be seen (another user's process, or a platform that does not tell)."""
    try:
        listeners = [c for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    except (psutil.Error, OSError):
        return ""
    for conn in listeners:
        if conn.pid is None:
            continue
        try:
            command = " ".join(" ".join(psutil.Process(conn.pid).cmdline()).split()) or psutil.Process(conn.pid).name()
        except psutil.Error:
            return f" by pid {conn.pid}"
        return f" by pid {conn.pid} ({command[:200]})"
    return ""
