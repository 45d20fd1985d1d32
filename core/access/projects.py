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
(run_in_threadpool copies the context); the stores read it where they read a record.

Outside a request, what acts is the process's default. A worker's is EVERYWHERE: it serves no
request, and sees everything, as before projects existed. An API process's is NOWHERE (set by
`fail_closed` in its lifespan, app/main.py): a code path that lost its request's context (a thread
started by hand, a task made before the gate ran) then finds no object and may make none
(`home()` raises) rather than seeing every project's. So the API's own background tasks say what
they act for: the retention cleanup and the sweeps' tick `acting_everywhere()`, and what they make
for a request's object (a sweep's trials, an export) takes that object's project (`acting_as`).
The /predict engine's watcher acts for no one: each request in flight carries its project.
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


EVERYWHERE = Acting(DEFAULT_PROJECT, None)  # a worker, a background task that must see all, a test's store
# No request: sees no project's objects (the name breaks PROJECT_PATTERN, so no object has it).
NOWHERE = Acting("(no request)", "(no request)")


class NoActingProject(RuntimeError):
    """Something is being made outside a request in an API process: whose it is, nobody said."""


_process_default = EVERYWHERE  # what acts where no context set one: `fail_closed` makes it NOWHERE
_acting: ContextVar[Acting | None] = ContextVar("torchyard_acting_project", default=None)


def acting() -> Acting:
    value = _acting.get()
    return _process_default if value is None else value


def fail_closed() -> Acting:
    """Make NOWHERE this process's default (an API process, at startup); returns the previous
    default, for `restore_default` when the app stops (a test's process lives on)."""
    global _process_default
    previous, _process_default = _process_default, NOWHERE
    return previous


def restore_default(previous: Acting) -> None:
    global _process_default
    _process_default = previous


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


@contextmanager
def acting_everywhere() -> Iterator[None]:
    """See every project for the block: a background task of the API's that works for no request
    and must see everything (the retention cleanup, the sweeps' tick), said where it runs."""
    token = _acting.set(EVERYWHERE)
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
    now = acting()
    if now is NOWHERE:
        return False  # outside a request in an API process: nothing, the shared built-ins neither
    return project is None or now.sees is None or project == now.sees


def home() -> str:
    """The project what the acting request makes belongs to; NoActingProject outside a request in
    an API process (nobody said whose it would be)."""
    now = acting()
    if now is NOWHERE:
        raise NoActingProject(
            "nothing may be made outside a request in the API process without saying whose "
            "(core/access/projects.py: acting_as, acting_everywhere)"
        )
    return now.home


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
