"""The worker's forkserver: what its decoding processes find imported, and what they never import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]

# A worker in miniature, run as a module as the worker is (`python -m app.cli`): app/cli.py's imports,
# torch imported by the parent; a pool from the worker's forkserver reports its processes' pids.
PROBE = """
import app.cli  # noqa: F401
import os, sys
from concurrent.futures import ProcessPoolExecutor
from worker import forkserver

if __name__ == "__main__":
    import torch  # noqa: F401  (a worker has it; its decoding processes must not)
    forkserver.start()
    with ProcessPoolExecutor(2, mp_context=forkserver.context()) as pool:
        print(pool.submit(os.getpid).result(), flush=True)
        sys.stdin.readline()  # inspected meanwhile
"""


def mapped(pid: int, name: str) -> bool:
    return any(name in m.path for m in psutil.Process(pid).memory_maps())


def test_decoding_processes_fork_with_the_main_modules_imports_and_never_load_torch(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.Popen([sys.executable, "-m", "probe"], cwd=tmp_path, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout is not None and probe.stdin is not None
        decoder = int(probe.stdout.readline())
        server = psutil.Process(decoder).ppid()
        assert server != probe.pid and psutil.Process(server).ppid() == probe.pid  # forked from the server
        assert mapped(probe.pid, "libtorch")  # the check can see torch where it is loaded
        assert not mapped(server, "libtorch") and not mapped(decoder, "libtorch")
        # The main module's imports (pydantic's compiled core, for the settings) were preloaded by the
        # server, so a decoding process inherits them instead of importing them before its first task.
        assert mapped(server, "_pydantic_core")
        probe.stdin.write("\n")
        probe.stdin.flush()
        assert probe.wait(timeout=60) == 0
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()
