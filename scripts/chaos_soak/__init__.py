"""The chaos soak's parts (scripts/chaos.py is its command line and describes the run): the stack
it starts and breaks (`stack`), the careful client's workload (`workload`), the faults
(`faults`), the checks of every acknowledged job and the verdict (`checks`), and the run that
drives them (`soak`). A package so that each part reads on its own and the tests can start a
part (tests/scripts/test_chaos.py starts a `Stack`'s worker) without the rest.

Its modules import each other relatively: `python scripts/chaos.py` finds this package beside
it, and the tests import it as `scripts.chaos_soak`."""

from __future__ import annotations

import time

# The states a job ends in; the soak waits for them and counts them.
TERMINAL = {"succeeded", "failed", "cancelled"}


def log(message: str) -> None:
    """One line of the soak's own log (stdout), with the time of day."""
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)
