"""Warnings caught by the thread that raised them.

The `warnings` module's filters and `warnings.catch_warnings` are process-global: a worker traces
serving graphs on its intake thread (worker/checkpoints/forward_graph.py) while a job's thread may export a
model (worker/kinds/export.py), and a filter one of them set (or restored on leaving
`catch_warnings`) decided what the other's warnings became. A serving trace could then miss the
TracerWarning that makes it fall back to eager, and serve a graph that does not generalise.

So nothing here changes the filters per call. Once per process (and again if someone, pytest for
one, put back the warnings module's state), `torch.jit.TracerWarning` is set to always reach
`warnings.showwarning`, which is wrapped: a warning raised on a thread that is inside `caught()`
goes to that thread's own list, any other to the previous `showwarning` as before. Each caller
then decides with what it caught (threading.local: nothing is shared between the threads).
The deprecation notices of torch.jit itself are ignored process-wide, once, for the same reason.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_local = threading.local()
_install = threading.Lock()
_previous: Callable[..., Any] | None = None


def _show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
          file: Any = None, line: str | None = None) -> None:
    caught: list[warnings.WarningMessage] | None = getattr(_local, "caught", None)
    if caught is not None:
        caught.append(warnings.WarningMessage(message, category, filename, lineno, file, line))
    elif _previous is not None:
        _previous(message, category, filename, lineno, file, line)


def _ensure_installed() -> None:
    global _previous
    with _install:
        if warnings.showwarning is not _show:
            _previous = warnings.showwarning
            warnings.showwarning = _show
        # Idempotent: added only where missing (never removed, never saved and restored).
        if not _has_filter("always", torch.jit.TracerWarning, ""):
            warnings.filterwarnings("always", category=torch.jit.TracerWarning)
        for category in (FutureWarning, DeprecationWarning):
            if not _has_filter("ignore", category, r"torch\.jit"):
                warnings.filterwarnings("ignore", category=category, module=r"torch\.jit")


def _has_filter(action: str, category: type[Warning], module: str) -> bool:
    return any(f[0] == action and f[2] is category and getattr(f[3], "pattern", f[3] or "") == module
               for f in warnings.filters)


@contextmanager
def caught() -> Iterator[list[warnings.WarningMessage]]:
    """The warnings this thread raises inside the block (those the filters let through; a
    TracerWarning always is), instead of their being printed. Nests: an inner block's warnings
    are the inner block's."""
    _ensure_installed()
    outer = getattr(_local, "caught", None)
    mine: list[warnings.WarningMessage] = []
    _local.caught = mine
    try:
        yield mine
    finally:
        _local.caught = outer


def tracer_warnings(found: list[warnings.WarningMessage]) -> list[str]:
    """The TracerWarnings among `found`, as text."""
    return [str(w.message) for w in found if issubclass(w.category, torch.jit.TracerWarning)]
