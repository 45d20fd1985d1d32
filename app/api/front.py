"""The front gate: every HTTP request is judged on its headers, before routing and before a single
body byte is read; then the body it is allowed is counted and timed as it streams.

Why a pure-ASGI layer and not FastAPI dependencies: FastAPI reads (and parses, and spools to
disk) a request's body before it runs a route's dependencies, so a key checked in a dependency
is checked only once the whole body, however large, has been received. Here, in order:

1. Host (400): only localhost names, the bind address and TORCHYARD_ALLOWED_HOSTS are served
   ('*' there: any), on every bind, so a web page cannot reach the server through DNS rebinding.
2. Origin (403): a browser's state-changing request (POST, PUT, PATCH, DELETE) from another
   origin is refused; the dashboard is same-origin; TORCHYARD_ALLOWED_ORIGINS adds others.
3. API key (401 with `WWW-Authenticate: Bearer`), unless the route is open (ROUTES): the bootstrap
   key or one from POST /keys (app/api/access.py); the caller goes into the scope for the routes'
   role check, which the gate makes itself for the routes it serves (/predict, /v2: 403).
4. Declared `Content-Length` against the route's cap (413), then the content type (415).
5. The body as it streams: bytes counted against the cap (chunked bodies declare nothing; 413),
   and a deadline (408) of `body_timeout_s` plus one second per `min_body_rate` bytes received,
   the rule of Apache's mod_reqtimeout, so a client trickling a body cannot hold a request open.

A refusal sent before the body was read carries `Connection: close`: uvicorn would otherwise keep
reading (and discarding) the rest of the body to reach the next request on the connection.
What uvicorn does not time out (slow headers) is handled in app/server.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.exceptions import HTTPException
from starlette.routing import Match, compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.access import PRINCIPAL, Auditor, KeyCheck, PredictRate, acting_for, check
from app.api.origins import HostCheck, OriginCheck
from core.access.keystore import Principal
from core.access.projects import reset_acting, set_acting
from core.config import Settings
from core.errors import Forbidden, OverQuota, Unavailable

JSON = frozenset({"application/json"})
MULTIPART = frozenset({"multipart/form-data"})


@dataclass(frozen=True)
class RoutePolicy:
    """What a route accepts before it runs."""

    open: bool = False  # served without the API key (holds no data)
    max_body: int | None = None  # bytes; None: TORCHYARD_MAX_JSON_BYTES
    content_types: frozenset[str] = field(default_factory=frozenset)  # of a body; empty: any


@dataclass(frozen=True)
class Rule:
    methods: frozenset[str]
    path: str  # a Starlette path template
    policy: RoutePolicy

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", compile_path(self.path)[0])

    def matches(self, method: str, path: str) -> bool:
        return method in self.methods and self._regex.match(path) is not None  # type: ignore[attr-defined]


def route_rules(settings: Settings) -> list[Rule]:
    """THE route table of the gate: which paths are open, which bodies each takes. A route not
    listed needs the key and takes a body of at most TORCHYARD_MAX_JSON_BYTES of any type (the
    routes without a body ignore it). FastAPI's own /docs and /openapi.json need the key."""
    read = frozenset({"GET", "HEAD"})
    return [
        Rule(read, "/healthz", RoutePolicy(open=True)),
        Rule(read, "/", RoutePolicy(open=True)),  # the dashboard page: no data (its calls send the key)
        Rule(read, "/static/{path:path}", RoutePolicy(open=True)),
        Rule(read, "/docs/assets/{path:path}", RoutePolicy(open=True)),  # Swagger UI's files; /docs needs the key
        Rule(frozenset({"POST"}), "/jobs", RoutePolicy(max_body=settings.max_json_bytes, content_types=JSON)),
        Rule(frozenset({"POST"}), "/datasets",
             RoutePolicy(max_body=settings.request_body_limit, content_types=MULTIPART)),
        Rule(frozenset({"POST"}), "/predict", RoutePolicy(max_body=settings.max_predict_request_bytes, content_types=MULTIPART)),
        Rule(frozenset({"PUT"}), "/aliases/{name}", RoutePolicy(max_body=settings.max_json_bytes, content_types=JSON)),
        # The Open Inference Protocol (app/api/oip/): health is open, as /healthz; infer takes /predict's
        # body cap and any type (its clients send none, or application/octet-stream with binary tensors).
        Rule(read, "/v2/health/{probe}", RoutePolicy(open=True)),
        Rule(frozenset({"POST"}), "/v2/models/{name}/infer", RoutePolicy(max_body=settings.max_predict_request_bytes)),
        Rule(frozenset({"POST"}), "/v2/models/{name}/versions/{version}/infer",
             RoutePolicy(max_body=settings.max_predict_request_bytes)),
        Rule(frozenset({"POST"}), "/jobs/{job_id}/evaluate",
             RoutePolicy(max_body=settings.max_json_bytes, content_types=JSON)),
        Rule(frozenset({"POST"}), "/aliases/{name}/rollback",
             RoutePolicy(max_body=settings.max_json_bytes, content_types=JSON)),
        Rule(frozenset({"POST"}), "/sweeps", RoutePolicy(max_body=settings.max_json_bytes, content_types=JSON)),
        Rule(frozenset({"POST"}), "/keys", RoutePolicy(max_body=settings.max_json_bytes, content_types=JSON)),
        Rule(frozenset({"PUT"}), "/projects/{name}", RoutePolicy(max_body=settings.max_json_bytes, content_types=JSON)),
    ]


class RouteTable:
    def __init__(self, settings: Settings) -> None:
        self.rules = route_rules(settings)
        self.default = RoutePolicy()
        self.ceiling = settings.request_body_limit  # no route takes more than TORCHYARD_MAX_REQUEST_BYTES
        self.max_json = settings.max_json_bytes
        # Plain paths by dict (a request costs one lookup: /predict is the hot path), templates by regex.
        self.exact = {(m, r.path): r.policy for r in self.rules if "{" not in r.path for m in r.methods}
        self.templated = [r for r in self.rules if "{" in r.path]

    def policy(self, method: str, path: str) -> RoutePolicy:
        found = self.exact.get((method, path))
        if found is not None:
            return found
        for rule in self.templated:
            if rule.matches(method, path):
                return rule.policy
        return self.default

    def body_cap(self, policy: RoutePolicy) -> int:
        return min(self.ceiling, self.max_json if policy.max_body is None else policy.max_body)


class BodyTooLarge(HTTPException):
    """Raised from inside `receive`: FastAPI lets an HTTPException through its body parsing, so the
    app's own handler renders it."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is over the limit of {limit} bytes", headers={"Connection": "close"})


class BodyTimeout(HTTPException):
    def __init__(self, received: int, seconds: float) -> None:
        super().__init__(408, f"the request body arrived too slowly ({received} bytes in {seconds:.0f} s); "
                              f"send it faster or in one piece", headers={"Connection": "close"})


class _Refusal(Exception):
    def __init__(self, status: int, detail: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers


class DirectRoute:
    """An endpoint the gate serves itself, past FastAPI's routing: /predict, the hot path. FastAPI's
    middleware and routing layers (request objects, dependency solving, exception middleware) cost
    about a quarter of the API's CPU per prediction; the gate has already done what they would
    (key, size, type), so the endpoint is a plain ASGI app. `path` labels it in /metrics."""

    def __init__(self, path: str, endpoint: ASGIApp, *, error_key: str = "detail") -> None:
        self.path = path  # an exact path, or with `subtree` (FrontGate) every path under it
        self.endpoint = endpoint
        self.error_key = error_key  # the gate's own refusals name their reason so (the protocol's "error")


def _label_route(scope: Scope) -> None:
    """The route a refused request was for, so /metrics counts a 401, 413 or 415 under its route
    template (RequestMetricsMiddleware reads `scope["route"]`) rather than as `unmatched`. Run on
    refusals only: the app's declared routes (app/main.py) are matched by Starlette, as routing would."""
    state = getattr(scope.get("app"), "state", None)
    for route in getattr(state, "declared_routes", ()):
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            scope["route"] = route
            return


class FrontGate:
    def __init__(self, app: ASGIApp, settings: Settings,
                 direct: dict[tuple[str, str], DirectRoute] | None = None,
                 subtrees: tuple[DirectRoute, ...] = ()) -> None:
        self.app = app
        self.direct = direct or {}
        self.subtrees = subtrees  # each serves its path and every path under it, any method (/v2)
        self.routes = RouteTable(settings)
        self.hosts = HostCheck(settings)
        self.origins = OriginCheck(settings)
        self.keys = KeyCheck(settings)
        self.auditor = Auditor(settings)
        self.predict_rate = PredictRate()
        self.body_timeout_s = settings.body_timeout_s
        self.min_body_rate = settings.min_body_rate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = _Head.read(scope["headers"])
        policy = self.routes.policy(scope["method"], scope["path"])
        cap = self.routes.body_cap(policy)
        direct = self.direct.get((scope["method"], scope["path"])) or self._subtree(scope["path"])
        key = direct.error_key if direct is not None else "detail"
        principal, acting = None, None
        try:
            self._judge_source(scope["method"], head)
            if not policy.open:
                principal = await self._identify(scope, head, direct)
                acting = set_acting(acting_for(principal))  # whose objects it sees (core/access/projects.py)
            self._judge_body(head, policy, cap)
        except _Refusal as refusal:
            _label_route(scope)
            await _reply(send, refusal.status, refusal.detail, close=head.has_body, headers=refusal.headers, key=key)
            who = scope.get(PRINCIPAL)  # set once the key was known: a 403 of the gate's is audited too
            if isinstance(who, Principal) and refusal.status == 403:
                await self.auditor.record(_redis(scope), scope, who, 403, None)
            if acting is not None:
                reset_acting(acting)
            return
        try:
            await self._serve(scope, receive, send, head, cap, direct, key, principal)
        finally:
            if acting is not None:
                reset_acting(acting)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, head: _Head, cap: int,
                     direct: DirectRoute | None, key: str, principal: Principal | None) -> None:
        guard = _BodyGuard(receive, cap, self.body_timeout_s, self.min_body_rate)
        started = False
        answered: dict[str, Any] = {}

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = message.get("headers", [])
                answered.update(status=message["status"], headers=headers)
                if head.has_body and not guard.done and not any(name.lower() == b"connection" for name, _ in headers):
                    # Answered before the body was read (an error mid-upload): close the connection,
                    # or uvicorn reads and discards the rest of the body to reach the next request.
                    # (A 408 or 413 of the body guard says so itself: one `connection` header, not two.)
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        if direct is not None:
            scope["route"] = direct  # what RequestMetricsMiddleware labels the request with
        try:
            await (direct.endpoint if direct is not None else self.app)(scope, guard.receive, tracking_send)
        except (BodyTooLarge, BodyTimeout) as exc:  # raised outside the routes' error handling
            if started:
                raise
            await _reply(send, exc.status_code, exc.detail, close=True, key=key)
            answered.update(status=exc.status_code, headers=[])
        if principal is not None and answered and self.auditor.wanted(scope["method"], scope["path"], answered["status"]):
            location = next((v.decode("latin-1") for n, v in answered["headers"] if n.lower() == b"location"), None)
            await self.auditor.record(_redis(scope), scope, principal, answered["status"], location)

    def _subtree(self, path: str) -> DirectRoute | None:
        for route in self.subtrees:
            if path.startswith(route.path) and (len(path) == len(route.path) or path[len(route.path)] == "/"):
                return route
        return None

    def _judge_source(self, method: str, head: _Head) -> None:
        if not self.hosts.allows(head.host):
            raise _Refusal(400, f"Host {head.text('host')!r} is not served here: only localhost names and "
                                f"TORCHYARD_ALLOWED_HOSTS (DNS-rebinding guard)")
        if not self.origins.allows(method, head.origin, head.host):
            raise _Refusal(403, f"cross-origin request refused: Origin {head.text('origin')!r} is not this server; "
                                f"add it to TORCHYARD_ALLOWED_ORIGINS to allow it")

    async def _identify(self, scope: Scope, head: _Head, direct: DirectRoute | None) -> Principal:
        """The caller (401 for no key, a wrong, expired or revoked one), put in the scope for the
        routes; the routes the gate serves itself get their role checked here too (403)."""
        try:
            principal = await self.keys.principal(head.authorization, lambda: scope["app"].state.services.aredis)
        except Unavailable as exc:
            raise _Refusal(503, exc.detail, ((b"retry-after", b"2"),)) from exc
        if principal is None:
            raise _Refusal(401, "missing, wrong, expired or revoked API key: send `Authorization: Bearer <key>` "
                                "(TORCHYARD_API_KEY, or a key from POST /keys)", ((b"www-authenticate", b"Bearer"),))
        scope[PRINCIPAL] = principal
        if direct is not None:
            try:
                check(principal, scope["method"], scope["path"])
                if scope["method"] == "POST":  # a prediction: its project's predict_per_second
                    await self.predict_rate.admit(acting_for(principal).home, scope["app"].state.services.aredis)
            except Forbidden as exc:
                raise _Refusal(403, exc.detail) from exc
            except OverQuota as exc:
                raise _Refusal(429, exc.detail, ((b"retry-after", b"1"),)) from exc
        return principal

    def _judge_body(self, head: _Head, policy: RoutePolicy, cap: int) -> None:
        if head.content_length is not None:
            if not head.content_length.isdigit():
                raise _Refusal(400, "Content-Length is not a number")
            if int(head.content_length) > cap:
                raise _Refusal(413, f"request body is over the limit of {cap} bytes")
        if head.has_body and policy.content_types and not _type_allowed(head.content_type, policy.content_types):
            wanted = " or ".join(sorted(policy.content_types))
            raise _Refusal(415, f"Content-Type {head.text('content-type') or '(none)'!r} is not accepted here; "
                                f"send {wanted}")


def _redis(scope: Scope) -> Any:
    """The app's asyncio Redis client (the audit log's), or None before the lifespan built it."""
    services = getattr(getattr(scope.get("app"), "state", None), "services", None)
    return getattr(services, "aredis", None)


def _type_allowed(content_type: bytes | None, allowed: frozenset[str]) -> bool:
    if content_type is None:
        return allowed == JSON  # FastAPI reads a body without a type as JSON (curl --data-binary)
    media = content_type.split(b";", 1)[0].strip().lower().decode("latin-1")
    if allowed == JSON and media.startswith("application/") and media.endswith("+json"):
        return True
    return media in allowed


@dataclass
class _Head:
    """The request headers the gate reads, taken in one pass."""

    host: bytes | None = None
    origin: bytes | None = None
    authorization: bytes | None = None
    content_length: bytes | None = None
    content_type: bytes | None = None
    chunked: bool = False

    @classmethod
    def read(cls, headers: list[tuple[bytes, bytes]]) -> _Head:
        head = cls()
        for name, value in headers:
            if name == b"host" and head.host is None:
                head.host = value
            elif name == b"origin" and head.origin is None:
                head.origin = value
            elif name == b"authorization" and head.authorization is None:
                head.authorization = value
            elif name == b"content-length" and head.content_length is None:
                head.content_length = value.strip()
            elif name == b"content-type" and head.content_type is None:
                head.content_type = value
            elif name == b"transfer-encoding":
                head.chunked = head.chunked or b"chunked" in value.lower()
        return head

    @property
    def has_body(self) -> bool:
        return self.chunked or (self.content_length is not None and self.content_length not in (b"", b"0"))

    def text(self, name: str) -> str:
        value = {"host": self.host, "origin": self.origin, "content-type": self.content_type}[name]
        return value.decode("latin-1")[:200] if value is not None else ""


class _BodyGuard:
    """`receive` with the body counted against its cap and timed against its deadline. Once the
    body is complete it steps aside: a streaming response (SSE) waits on `receive` for the
    client's disconnect, which no deadline may cut."""

    def __init__(self, receive: Receive, cap: int, timeout_s: float, min_rate: int) -> None:
        self._receive = receive
        self.cap = cap
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.received = 0
        self.started = time.monotonic()
        self.done = False

    async def receive(self) -> Message:
        if self.done:
            return await self._receive()
        deadline = self.started + self.timeout_s + self.received / self.min_rate
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                message = await self._receive()
        except TimeoutError:
            raise BodyTimeout(self.received, time.monotonic() - self.started) from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.cap:
                raise BodyTooLarge(self.cap)
            self.done = not message.get("more_body", False)
        else:
            self.done = True
        return message


async def _reply(send: Send, status: int, detail: str, *, close: bool,
                 headers: tuple[tuple[bytes, bytes], ...] = (), key: str = "detail") -> None:
    body = json.dumps({key: detail}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
