"""Projects: whose objects a request may see, and which project what it makes belongs to.

Every dataset, job, sweep and alias records the project of the key that made it (the bootstrap
key's, and everything made before projects existed: "default"). A key sees its own project's
objects only: another's do not exist for it (404 on ids, absent from lists and streams); built-in
datasets are shared, read-only. An admin sees every project, or one with `?project=`.

Why a context variable and not an argument: a job id alone is looked up in some thirty places
(lineage, evaluations, exports, batch predictions, the checkpoint and results downloads, the
alias checks), and an argument threaded through each would make one missed call a leak. The API
sets the acting project once per request (the front gate from the key; `?project=` of an admin in
app/api/access.authorize), in the request's task, whose thread-pool calls inherit it
(run_in_threadpool copies the context); the stores read it where they read a record. A process
that serves no request (a worker, the sweeps' tick, the retention cleanup) acts for no project:
it sees everything, as before projects existed, and what it creates for a request's object
(a sweep's trials, an export) takes that object's project explicitly (`acting_as`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from core.access.models import DEFAULT_PROJECT


@dataclass(frozen=True)
class Acting:
    """The project a request acts in: `home` is where what it makes goes; `sees` is the one project
    whose objects it sees, or None for every project (an admin without `?project=`)."""

    home: str
    sees: str | None


EVERYWHERE = Acting(DEFAULT_PROJECT, None)  # no request: a worker, a background task, a test's store
_acting: ContextVar[Acting] = ContextVar("torchyard_acting_project", default=EVERYWHERE)


def acting() -> Acting:
    return _acting.get()


def set_acting(value: Acting) -> object:
    """Set for the rest of this context (a request's task); returns the token `reset_acting` takes."""
    return _acting.set(value)


def reset_acting(token: object) -> None:
    _acting.reset(token)  # type: ignore[arg-type]


@contextmanager
def acting_as(project: str) -> Iterator[None]:
    """Act in `project` (seeing only it) for the block: a background task working for one object."""
    token = _acting.set(Acting(project, project))
    try:
        yield
    finally:
        _acting.reset(token)


def project_of(stored: str | bytes | None) -> str:
    """A record's project field as stored; a record from before projects: "default"."""
    if isinstance(stored, bytes):
        stored = stored.decode()
    return stored or DEFAULT_PROJECT


def visible(project: str | None) -> bool:
    """Whether the acting request sees an object of `project` (None: shared, a built-in)."""
    sees = _acting.get().sees
    return project is None or sees is None or project == sees


def home() -> str:
    """The project what the acting request makes belongs to."""
    return _acting.get().home


def scoped_name(name: str, project: str | None = None) -> str:
    """A per-project name's stored form (an alias's, an Idempotency-Key's): the name itself in
    "default" (so everything made before projects keeps its name), else `<project>:<name>`; a
    user's names never hold ':' (aliases refuse it; idempotency keys of other projects are
    prefixed), so two projects' names cannot meet."""
    project = home() if project is None else project
    return name if project == DEFAULT_PROJECT else f"{project}:{name}"


def unscoped_name(stored: str) -> tuple[str, str]:
    """(project, name) of a stored per-project name."""
    project, sep, name = stored.partition(":")
    return (project, name) if sep else (DEFAULT_PROJECT, stored)
