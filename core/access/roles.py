"""Who may do what: the four roles, what each may do, and THE table of every operation's need.

Why one table keyed by (method, route template): the API applies it per route (a FastAPI
dependency in app/api/access.py, and the front gate for the routes it serves itself, /predict and
/v2), docs/security.md describes it, and the role-matrix test walks the OpenAPI document against it
(every route × role: allowed or 403, never 500). A route missing here is refused to every role but
admin (`needed`), and tests/core/test_access.py fails on it, so a new route cannot open by omission.

Pure: no Redis, no web framework.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    admin = "admin"  # every project, keys, audit (and later quotas)
    trainer = "trainer"  # its project: datasets, jobs, sweeps, aliases, exports, predict
    predictor = "predictor"  # its project's /predict and /v2 infer, reading its aliases and models
    viewer = "viewer"  # read-only in its project


class Ability(StrEnum):
    """What an operation needs. A role holds a set of these (ROLE_ABILITIES)."""

    serve_read = "read the serving catalog (devices, models, aliases, /v2 metadata)"
    read = "read datasets, jobs, sweeps and their files"
    predict = "predict"
    write = "change datasets, jobs, sweeps, aliases and exports"
    manage = "manage keys and quotas and read the audit log"


ROLE_ABILITIES: dict[Role, frozenset[Ability]] = {
    Role.admin: frozenset(Ability),
    Role.trainer: frozenset({Ability.serve_read, Ability.read, Ability.predict, Ability.write}),
    Role.predictor: frozenset({Ability.serve_read, Ability.predict}),
    Role.viewer: frozenset({Ability.serve_read, Ability.read}),
}

_R, _S, _P, _W, _M = Ability.read, Ability.serve_read, Ability.predict, Ability.write, Ability.manage

# Every operation the API serves behind the key, by the route template FastAPI and the OpenAPI
# document name it with. A GET that builds something (an export) is a write: it starts a job.
POLICY: dict[tuple[str, str], Ability] = {
    ("GET", "/readyz"): _S,
    ("GET", "/devices"): _S,
    ("GET", "/models"): _S,
    ("GET", "/metrics"): _R,
    ("GET", "/datasets"): _R,
    ("POST", "/datasets"): _W,
    ("GET", "/datasets/{dataset}"): _R,
    ("DELETE", "/datasets/{dataset}"): _W,
    ("POST", "/jobs"): _W,
    ("GET", "/jobs"): _R,
    ("GET", "/jobs/{job_id}"): _R,
    ("DELETE", "/jobs/{job_id}"): _W,
    ("POST", "/jobs/{job_id}/cancel"): _W,
    ("GET", "/jobs/{job_id}/events"): _R,
    ("GET", "/jobs/{job_id}/checkpoint"): _R,
    ("POST", "/jobs/{job_id}/evaluate"): _W,
    ("GET", "/jobs/{job_id}/evaluations/{evaluation_id}"): _R,
    ("GET", "/jobs/{job_id}/results"): _R,
    ("GET", "/jobs/{job_id}/export"): _W,
    ("POST", "/predict"): _P,
    ("GET", "/aliases"): _S,
    ("GET", "/aliases/{name}"): _S,
    ("PUT", "/aliases/{name}"): _W,
    ("DELETE", "/aliases/{name}"): _W,
    ("POST", "/aliases/{name}/rollback"): _W,
    ("GET", "/aliases/{name}/history"): _S,
    ("POST", "/sweeps"): _W,
    ("GET", "/sweeps"): _R,
    ("GET", "/sweeps/{sweep_id}"): _R,
    ("POST", "/sweeps/{sweep_id}/cancel"): _W,
    ("DELETE", "/sweeps/{sweep_id}"): _W,
    ("GET", "/sweeps/{sweep_id}/events"): _R,
    ("POST", "/keys"): _M,
    ("GET", "/keys"): _M,
    ("DELETE", "/keys/{key_id}"): _M,
    ("GET", "/audit"): _M,
    ("GET", "/whoami"): _S,
    ("PUT", "/projects/{name}"): _M,
    ("GET", "/projects/{name}"): _S,
    # The Open Inference Protocol's subtree (app/api/oip/), served by the front gate: its reads
    # (server and model metadata, statistics) are the serving catalog's; every POST infers (or
    # lists the repository, a read of the same catalog: POST by the protocol's choice).
    ("GET", "/v2"): _S,
    ("POST", "/v2"): _P,
}

SUBTREES = ("/v2",)  # a path under one of these is judged by the subtree's entry


def needed(method: str, route: str) -> Ability:
    """What (method, route template) needs; a route the table does not name needs `manage`."""
    method = "GET" if method == "HEAD" else method
    for root in SUBTREES:
        if route == root or route.startswith(root + "/"):
            route = root
    return POLICY.get((method, route), Ability.manage)


def allows(role: Role, method: str, route: str) -> bool:
    return needed(method, route) in ROLE_ABILITIES[role]


def roles_allowed(ability: Ability) -> list[Role]:
    """The roles holding `ability`, most specific first (for a 403's detail)."""
    return [role for role in reversed(Role) if ability in ROLE_ABILITIES[role]]
