"""Child processes that cannot outlive their parent (app/process.py), with real processes: a child
armed with die_with_parent gets SIGTERM when its parent dies, even SIGKILLed; a worker raises its
own OOM score, never lowers it."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from harness import REPO, wait_until

# A parent that starts a child armed with the parent-death signal, says its pid, and waits.
_PARENT = """
import subprocess, sys, time
from app.process import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_child_dies_with_its_sigkilled_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        assert child.is_running()
        parent.send_signal(signal.SIGKILL)  # no chance to clean up: only the kernel can end the child
        parent.wait(10)
        wait_until(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, timeout=10,
                   what="the child to die with its parent")
    finally:
        if child.is_running():
            child.kill()


def test_a_worker_raises_its_oom_score_and_never_lowers_it() -> None:
    code = ("import sys; from app.process import prefer_as_oom_victim\n"
            "prefer_as_oom_victim(int(sys.argv[1])); prefer_as_oom_victim(int(sys.argv[2]))\n"
            "print(open('/proc/self/oom_score_adj').read().strip())")
    said = subprocess.run([sys.executable, "-c", code, "700", "300"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert said.returncode == 0, said.stderr
    assert said.stdout.strip() == "700"
