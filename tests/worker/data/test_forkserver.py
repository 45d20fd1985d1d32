"""The worker's forkserver: what its decoding processes find imported, and what they never import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support import REPO

# A worker in miniature, run as a module as `up` runs the worker (`python -m app.cli`): app/cli.py's
# imports, torch imported by the parent; a pool from the worker's forkserver reports its processes' pids.
PROBE = """
import app.cli  # noqa: F401
import os, sys
from concurrent.futures import ProcessPoolExecutor
from worker.data import forkserver

def main() -> None:
    import torch  # noqa: F401  (a worker has it; its decoding processes must not)
    forkserver.start()
    with ProcessPoolExecutor(2, mp_context=forkserver.context()) as pool:
        print(pool.submit(os.getpid).result(), flush=True)
        sys.stdin.readline()  # inspected meanwhile

if __name__ == "__main__":
    main()
"""


def mapped(pid: int, name: str) -> bool:
    return any(name in m.path for m in psutil.Process(pid).memory_maps())


# The same worker started as a container starts one: by a console script's path (`torchyard`, which pip
# writes as below), whose `main` comes from the module that holds the work.
CONSOLE_SCRIPT = """import sys
from probe import main
if __name__ == "__main__":
    sys.exit(main())
"""


@pytest.mark.parametrize("started", ["as a module", "by a console script"])
def test_decoding_processes_fork_with_the_main_modules_imports_and_never_load_torch(tmp_path: Path,
                                                                                    started: str) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "torchyard-probe").write_text(CONSOLE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = ["-m", "probe"] if started == "as a module" else [str(tmp_path / "torchyard-probe")]
    probe = subprocess.Popen([sys.executable, *command], cwd=tmp_path, env=env, stdin=subprocess.PIPE,
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
