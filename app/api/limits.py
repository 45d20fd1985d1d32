"""A cap on request bodies, before any route or parser reads them.

Why here and not in the routes: multipart and JSON parsing happen before a route's code runs,
so a route can only look at a body that has already been received (and spooled to disk). This
pure-ASGI middleware refuses an oversized `Content-Length` at once, and counts the bytes
actually streamed (chunked uploads have no length) so a lying or missing header cannot get
more through. Both answer 413 with the usual JSON `detail`.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    """Raised from inside `receive`: FastAPI lets HTTPException through its body parsing,
    so the app's own error handler renders it."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is over the limit of {limit} bytes")


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int, max_json_bytes: int,
                 per_path: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_json_bytes = max_json_bytes
        self.per_path = per_path or {}  # tighter caps for routes whose bodies are known to be small

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        limit = min(self.max_bytes, self.per_path.get(scope["path"], self.max_bytes))
        if content_type.endswith(b"json"):
            limit = min(limit, self.max_json_bytes)
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await _reply(send, 400, "Content-Length is not a number")
                return
            if length > limit:
                await _reply(send, 413, BodyTooLarge(limit).detail)
                return

        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as exc:  # raised outside the routes' error handling (e.g. by a middleware)
            if started:
                raise
            await _reply(send, 413, exc.detail)


async def _reply(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
