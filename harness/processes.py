"""One process of the stack: launched in a group of its own, waited for, stopped with its group.

Every process the tests, the benchmarks and the scripts start runs in a session (and so a process
group) of its own, from the repository's root, its output appended to a log of its own: a signal
meant for it never reaches the process that started it, and its whole group can be ended at once,
since uvicorn, LitServe and a worker's decoding processes leave children behind a plain signal to
their parent. A process started from a thread that ends before it (the chaos soak's supervisor)
must not die with that thread: `dies_with_parent` arms app/process.die_with_parent, whose signal
the kernel sends when the *thread* that forked ends, so such a caller spawns from a thread that
lives as long as the stack (scripts/chaos_soak/stack.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def free_port() -> int:
    """A TCP port free on loopback now (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], T | None], timeout: float = 30.0, interval: float = 0.1,
               what: str = "condition") -> T:
    """`predicate()`'s first true value, asked every `interval` seconds (an exception counts as not
    yet); TimeoutError naming `what` and the last answer after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except Exception as exc:
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def wait_http(port: int, path: str, timeout: float = 90, proc: subprocess.Popen | None = None) -> None:
    """Until GET `path` on loopback answers 200; a `proc` that exits meanwhile ends the wait at once."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server on :{port} exited with {proc.returncode} before answering {path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"nothing answered 200 on :{port}{path}")


def without_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environ` (default: ours) less every TORCHYARD_ variable: a stack of its own, with no setting
    of the caller's leaking into it (its Redis, its key, its data dir)."""
    return {k: v for k, v in (os.environ if environ is None else environ).items() if not k.startswith("TORCHYARD_")}


def cli(*args: str) -> list[str]:
    """The command line of a torchyard process (`up`, `api`, `worker --device ...`) as a checkout runs it."""
    return [sys.executable, "-m", "app.cli", *args]


def spawn(argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None, *, cwd: Path = REPO,
          dies_with_parent: bool = False) -> subprocess.Popen:
    """`argv` in a session and process group of its own, from `cwd`, its output appended to
    `log_path`, with exactly `env` (default: ours); with `dies_with_parent`, SIGTERM when the thread
    that spawned it ends (see the module's docstring)."""
    from app.process import die_with_parent

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the child holds its own descriptor
        return subprocess.Popen(list(argv), cwd=cwd, env=dict(os.environ if env is None else env), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent if dies_with_parent else None)


def kill_group(pgid: int) -> None:
    """SIGKILL to what is left of a process group (nothing when it is gone)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen, sig: int | None = signal.SIGTERM, grace: float = 30.0, *,
         group: bool = False) -> int:
    """Stop `proc`, the leader of a group of its own (`spawn`): `sig` to it, or to its whole group
    with `group` (None: it was signalled already); past `grace` seconds without its exit, SIGKILL
    to the whole group. Its exit status.

    What else of its group is still alive once it exited is the caller's to end (`kill_group`): a
    fault a test injects (SIGKILL to a worker) reaches that process alone, as a real one would."""
    if proc.poll() is None:
        try:
            if sig is not None and group:
                os.killpg(proc.pid, sig)
            elif sig is not None:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
    return proc.returncode


def end_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """`proc` and everything of its group gone, however they were doing: SIGTERM to the group,
    SIGKILL past `grace`, and SIGKILL to whatever outlived its leader."""
    stop(proc, grace=grace, group=True)
    kill_group(proc.pid)
