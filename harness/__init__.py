"""The stack's processes as the tests, the benchmarks and the scripts start, wait for and stop them.

One home for what the three do with torchyard's processes, so each does it one way:
`harness.processes` launches one (`spawn`: a session and process group of its own, its output in a
log), waits for one (`wait_until`, `wait_http`) and stops one (`stop`: a signal, a grace, then
SIGKILL to its whole group; `end_group`, `kill_group` for what outlived it); `harness.stack`
starts the stack: torchyard's processes on one Redis (`Processes`) or a host as a user runs it
(`UpStack`, `torchyard up`).

It sits beside the product, not in it: tests/, bench/ and scripts/ import it, and no module of
app/, core/, worker/, models/ or client/ may (tests/test_layers.py). It is not installed with the
product (pyproject's packages): its users run from a checkout, with the repository's root on the
path (pytest's rootdir, the scripts' own sys.path entry), where it lies. It imports app/ as they
do (the embedded Redis, the parent-death signal), never tests/.
"""

from harness.processes import (
    REPO,
    cli,
    end_group,
    free_port,
    kill_group,
    spawn,
    stop,
    wait_http,
    wait_until,
    without_settings,
)
from harness.stack import TEST_SETTINGS, Processes, UpStack, wait_for_job, with_db

__all__ = ["REPO", "TEST_SETTINGS", "Processes", "UpStack", "cli", "end_group", "free_port", "kill_group", "spawn",
           "stop", "wait_for_job", "wait_http", "wait_until", "with_db", "without_settings"]
