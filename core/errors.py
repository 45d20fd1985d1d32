"""The error tree. Raised anywhere in the core; mapped to HTTP once, in app.api.errors."""

from __future__ import annotations


class TorchyardError(Exception):
    """Base of every error torchyard reports to a user."""

    status_code = 500

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class InvalidInput(TorchyardError):
    status_code = 422


class Unauthorized(TorchyardError):
    status_code = 401


class Forbidden(TorchyardError):
    """A valid key whose role may not do this (core/access/roles.py): 403, naming the roles that may."""

    status_code = 403


class NotFound(TorchyardError):
    status_code = 404


class Conflict(TorchyardError):
    status_code = 409


class TooLarge(TorchyardError):
    status_code = 413


class UnsupportedMedia(TorchyardError):
    status_code = 415


class Unavailable(TorchyardError):
    """No worker can take the request (none alive, or it did not answer in time), or the service is
    at a limit of its own for now: `retry_after_s`, when known, is sent as Retry-After."""

    status_code = 503

    def __init__(self, detail: str, retry_after_s: int | None = None) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class OverQuota(TorchyardError):
    """A project's quota reached (core/access/quotas.py): 429, naming the quota and its value;
    `retry_after_s` when waiting helps (queued jobs end), None when it does not (stored bytes)."""

    status_code = 429

    def __init__(self, detail: str, retry_after_s: int | None = None) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class DeviceInUse(TorchyardError):
    """A worker tried to pin a device another live worker already holds."""

    status_code = 409


class NotAvailableHere(TorchyardError):
    """A feature this deployment was installed without (e.g. the `export` extra on a worker): 501."""

    status_code = 501
