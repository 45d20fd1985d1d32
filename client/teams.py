"""The SDK's calls for a team's work: API keys, projects and their quotas (#38), and sweeps. A base
of `client.sdk.TorchyardClient` (use that), kept in a module of its own so that each stays short.

Typed with the contract's own models: core/access/models.py (keys, projects: pure pydantic) and
core/sweeps/spec.py (a sweep; that module loads no Optuna: core/sweeps/__init__.py imports nothing).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from client.http import Connection
from core.access.models import KeyCreated, KeyInfo, KeyList, ProjectView, Quota
from core.access.roles import Role
from core.sweeps.spec import Sweep, SweepList


class TeamCalls(Connection):
    # ------------------------------------------------------------------ keys (an admin's)
    def api_keys(self) -> list[KeyInfo]:
        """Every key: never a secret (the server keeps only a hash of each)."""
        return KeyList.model_validate(self._request("GET", "/keys").json()).keys

    def create_key(
        self, name: str, role: Role | str, project: str = "default", expires_in_days: float | None = None
    ) -> KeyCreated:
        """A new key; its `secret` is in this answer only. The server checks the body (an ApiError
        422 names what is wrong), as it does every other call's."""
        body: dict[str, Any] = {"name": name, "role": str(role), "project": project}
        if expires_in_days is not None:
            body["expires_in_days"] = expires_in_days
        return KeyCreated.model_validate(self._request("POST", "/keys", json=body).json())

    def revoke_key(self, key_id: str) -> None:
        """Revoked: every API process refuses it within a second (again: the same state)."""
        self._request("DELETE", f"/keys/{quote(key_id, safe='')}")

    # ------------------------------------------------------------------ projects
    def project(self, name: str) -> ProjectView:
        """A project's quotas and what it uses now (its own keys, or an admin)."""
        return ProjectView.model_validate(self._request("GET", f"/projects/{quote(name, safe='')}").json())

    def set_quota(self, name: str, quota: Quota | dict[str, int | None]) -> ProjectView:
        """Set every quota of `name` to `quota`'s (None or absent: no quota); an admin's. `update_quota`
        changes some and keeps the others."""
        body = quota.model_dump(mode="json") if isinstance(quota, Quota) else quota
        return ProjectView.model_validate(self._request("PUT", f"/projects/{quote(name, safe='')}", json=body).json())

    def update_quota(self, name: str, **limits: int | None) -> ProjectView:
        """Change the named quotas of `name` (None: no quota), keeping the others as they are."""
        current: dict[str, int | None] = self.project(name).quota.model_dump(mode="json")
        return self.set_quota(name, {**current, **limits})

    # ------------------------------------------------------------------ sweeps
    def start_sweep(self, body: dict[str, Any], idempotency_key: str | None = None) -> Sweep:
        """POST /sweeps with `body` (a SweepSpec's fields: base, space, trials, ...); a retry with the
        same Idempotency-Key and body gets the same sweep."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return Sweep.model_validate(self._request("POST", "/sweeps", json=body, headers=headers).json())

    def sweep(self, sweep_id: str) -> Sweep:
        return Sweep.model_validate(self._request("GET", f"/sweeps/{quote(sweep_id, safe='')}").json())

    def cancel_sweep(self, sweep_id: str) -> Sweep:
        """Cancel: no trial is asked any more, and its running trials' jobs stop."""
        return Sweep.model_validate(self._request("POST", f"/sweeps/{quote(sweep_id, safe='')}/cancel").json())

    def sweeps(self, limit: int = 20) -> list[Sweep]:
        """Sweeps, newest first."""
        return SweepList.model_validate(self._request("GET", "/sweeps", params={"limit": limit}).json()).sweeps
