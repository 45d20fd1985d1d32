"""The SDK's plumbing: one httpx connection pool to a torchyard server, and the one way a call is
made and its failure told (`ApiError` with the API's `detail`). Apart from client/sdk.py so that
the SDK's calls (sdk.py, teams.py) share it and each module stays readable."""

from __future__ import annotations

import getpass
import json
import os
import socket
from typing import Any, Self

import httpx

from client.events import RETRIABLE_STATUSES

DEFAULT_URL = "http://127.0.0.1:8000"


def user_agent() -> str:
    """`torchyard-client/<version> (<user>@<host>)`: what alias histories record as who moved it."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment (a container without /etc/passwd entry)
        user = "unknown"
    return f"torchyard-client/{_version()} ({user}@{socket.gethostname()})"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchyard")
    except PackageNotFoundError:
        return "dev"


class ApiError(Exception):
    """A failed call: the HTTP status (None when the server could not be reached) and its `detail`."""

    def __init__(self, status: int | None, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.status}: {self.detail}" if self.status else self.detail

    @property
    def retriable(self) -> bool:
        """The server is unreachable, restarting or without its Redis: the same call may succeed later."""
        return self.status is None or self.status in RETRIABLE_STATUSES


def error_detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        return detail if isinstance(detail, str) else json.dumps(detail)
    return response.text.strip() or response.reason_phrase


class Connection:
    """The connection pool and `_request`: private to the SDK's own classes (the commands call
    their public methods; tests/test_layers.py checks)."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = (url or os.environ.get("TORCHYARD_URL") or DEFAULT_URL).rstrip("/")
        key = api_key if api_key is not None else os.environ.get("TORCHYARD_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # Who moved an alias is recorded from this (the API key is shared): the client and the person.
        headers["User-Agent"] = user_agent()
        self._http = httpx.Client(
            base_url=self.url, headers=headers, transport=transport, timeout=httpx.Timeout(timeout, connect=10.0)
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ plumbing
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ApiError(None, f"cannot reach torchyard at {self.url}: {exc}") from exc
        if response.status_code >= 400:
            raise ApiError(response.status_code, error_detail(response))
        return response
