"""The front gate's checks of where a request comes from: the Host it names (DNS rebinding) and a
browser's Origin (cross-site requests). Pure functions of the headers and Settings; the gate
(app/api/front.py) runs them first, before the key."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from core.config import Settings

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOCAL_HOST_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class HostCheck:
    """DNS rebinding: a page on evil.example whose name now resolves to the server's address reaches
    it with `Host: evil.example`. Only localhost names, the bind address and TORCHYARD_ALLOWED_HOSTS
    are served, on any bind; '*' in that list, said explicitly, serves any Host. `torchyard api`
    and `up` refuse to start beyond loopback without the list (app/server.unsafe_bind_refusal);
    an app served some other way (`uvicorn app.main:create_app --factory --host 0.0.0.0`) skips
    that check, and still serves no other name."""

    def __init__(self, settings: Settings) -> None:
        names = settings.allowed_host_names
        self.enforced = "*" not in names
        self.allowed = LOCAL_HOST_NAMES | {settings.host.strip("[]").lower()} | set(names)
        self._seen: dict[bytes, bool] = {}

    def allows(self, host: bytes | None) -> bool:
        if not self.enforced or host is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        known = self._seen.get(host)
        if known is None:
            name = _host_name(host.decode("latin-1"))
            known = name in self.allowed or name.endswith(".localhost")  # *.localhost is loopback (RFC 6761)
            if len(self._seen) < 256:  # the few names a server is called by; never a client-sized cache
                self._seen[host] = known
        return known


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _without_default_port(netloc: str) -> str:
    return re.sub(r":(80|443)$", "", netloc.strip().lower())


class OriginCheck:
    """A browser sends `Origin` with every cross-origin (and same-origin) POST/PUT/PATCH/DELETE; a
    request whose Origin is not this server's own (the Host it was sent to) nor an allowed origin
    is refused, so a page elsewhere cannot submit jobs or uploads with a user's browser."""

    def __init__(self, settings: Settings) -> None:
        self.allowed = set(settings.allowed_origin_list)

    def allows(self, method: str, origin: bytes | None, host: bytes | None) -> bool:
        if method in SAFE_METHODS or origin is None:
            return True
        value = origin.decode("latin-1").strip().lower().rstrip("/")
        if value in self.allowed:
            return True
        if value == "null" or host is None:  # sandboxed frames, file:// pages
            return False
        try:
            netloc = urlsplit(value).netloc
        except ValueError:  # `http://[::1` and the like: not an origin, so not this server's
            return False
        return _without_default_port(netloc) == _without_default_port(host.decode("latin-1"))
