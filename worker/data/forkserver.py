"""The worker's forkserver: where its decoding processes (an upload's, worker/data/dataset_decode.py,
and /predict's, worker/serving/decode_processes.py) fork from, started once per worker process.

Why a forkserver: a worker runs threads (heartbeat, /predict intake and decode, the job) and holds
a CUDA context on a GPU. Forking such a process copies locks other threads may hold and a CUDA
context the child must never touch; spawn starts clean but pays a fresh interpreter per process.
The forkserver is a clean process (fork + exec, safe with threads); a child forks from it in
milliseconds with what the server preloaded already imported.

What it preloads, and why all of it at once: both decoding modules (numpy, Pillow, the transform;
none imports torch), and the worker's main module (app/cli.py, the entry point: pydantic settings,
the Redis client). multiprocessing makes every child import the parent's main module before its
first task; preloaded, that import finds its modules in place and costs milliseconds, where each
of a 16-process pool would otherwise spend a fraction of a second of CPU importing them, on the
first job's clock. Preloads are read when the server starts, so they must all be named by the one
place that starts it: this module.

`start` runs when the worker starts (worker/runtime/main.py, on a thread of its own, beside the other
set-up), so a first job's decode finds the server running instead of starting it. Where there is
no forkserver (not Linux), spawn is the fallback and `start` does nothing. Every decoding
process ends with its worker, however the worker ends (`end_with`, each pool's initializer).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import sys
import threading
import time
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

# The modules whose functions run in the server's children: imported by the server, once.
DECODING_MODULES = ("worker.data.dataset_decode", "worker.serving.decode_processes")


def context() -> BaseContext:
    """The context every decoding pool of the worker starts its processes with."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload([*DECODING_MODULES, *_main_module()])
    return forkserver


def start() -> None:
    """Start the server now (if not running already), so that no pool waits for it."""
    ctx = context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _main_module() -> list[str]:
    """The module whose imports each child would otherwise import itself before its first task.

    Run as a module (`python -m app.cli`, as `up` starts a worker): its name; each child runs it
    again under that name, its imports already in place. Run by its path (the `torchyard` console
    script, as a container starts a worker: it imports `main` from the CLI's module and calls it): each child
    runs that script again, so the module its `main` comes from; the script itself cannot be
    preloaded (multiprocessing's server is not given its path). Run from `-c`, or a script with a
    `main` of its own: nothing."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name:
        return [name] if name != "__main__" and not name.endswith(".__main__") else []
    entry = getattr(getattr(main, "main", None), "__module__", None)
    return [entry] if isinstance(entry, str) and entry not in ("__main__", "__mp_main__") else []


def end_with(worker: int) -> None:
    """In a decoding process (a pool's initializer): end this process when process `worker` ends.
    Its parent is the forkserver, which outlives a SIGKILLed worker as long as the pool processes
    hold its pipe, and they would wait for work forever: a thread waits for the worker's end."""
    threading.Thread(target=_exit_after, args=(worker,), name="exit-with-worker", daemon=True).start()


def _exit_after(pid: int) -> None:
    """Wait until process `pid` has ended, then end this one."""
    try:
        select.select([os.pidfd_open(pid)], [], [])  # Linux 5.3 and later: readable once `pid` has ended
    except (AttributeError, OSError):  # no pidfd on this platform, or `pid` is gone already
        with contextlib.suppress(ProcessLookupError):
            while True:
                os.kill(pid, 0)
                time.sleep(1.0)
    os._exit(1)


def kill_processes(pool: ProcessPoolExecutor) -> None:
    """SIGKILL every process of `pool`, started or starting. For a pool that broke, before its
    shutdown: the executor's own clean-up SIGTERMs the processes it knows of and then waits for each
    for ever, which hangs on a stopped process (SIGTERM waits for a SIGCONT), and on one that
    `submit` started while the clean-up ran (Python 3.11 spawns on demand, from the submitting
    thread): that one is never terminated, takes a chunk from the call queue and blocks writing its
    result to a pipe nobody reads any more (a dataset's decode hung so in a full test run)."""
    kill_workers = getattr(pool, "kill_workers", None)  # Python 3.14 and later
    if kill_workers is not None:
        with contextlib.suppress(Exception):
            kill_workers()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):  # named nowhere public before 3.14
        with contextlib.suppress(Exception):
            process.kill()
