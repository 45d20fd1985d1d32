"""Child processes that cannot outlive their parent: the kernel sends them SIGTERM when it dies."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1
# A process that exits with this status was started wrongly (a setting, a port in use, a device
# held by another worker): starting it again changes nothing, so `up` stops instead of restarting it.
EXIT_CONFIGURATION_ERROR = 2


def die_with_parent() -> None:
    """preexec_fn for Popen (Linux): even a SIGKILLed parent takes its children with it.

    The kernel arms it for the *thread* that forks, not the process: a child started from a thread
    gets SIGTERM when that thread ends. Start children from a thread that outlives them (the
    supervisor's main loop; the chaos soak's spawner thread, scripts/chaos_soak/stack.py)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def prefer_as_oom_victim(score_adj: int) -> None:
    """Raise this process's oom_score_adj (Linux; raising needs no privilege): when the host runs out
    of memory the kernel kills it before Redis, the API or the supervisor, whose score stays 0. A
    job that outgrows memory then costs its own worker (redelivered, then failed), not the service."""
    path = Path("/proc/self/oom_score_adj")
    try:
        if int(path.read_text()) < score_adj:
            path.write_text(str(score_adj))
    except (OSError, ValueError) as exc:
        logging.getLogger(__name__).warning("could not set oom_score_adj to %d: %s", score_adj, exc)
