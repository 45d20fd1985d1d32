"""Who gets the cores of a worker process: OpenMP teams, one at a time.

torch runs its CPU ops on OpenMP, and libgomp (torch's OpenMP) gives every thread that starts a
parallel op a team of its own, which stays alive, idle, as long as that thread does. Once a
process holds more OpenMP threads than the machine has cores, libgomp "throttles": its threads
spin at most 1,000 iterations between parallel regions (libgomp's do_spin, when
gomp_managed_threads > gomp_available_cpus) and then sleep and wake through futexes, at every op.
A second team makes a two-thread forward slower than the same forward on one thread (the
figures: docs/benchmarks.md, "Figures that were quoted in code comments"). So a worker keeps one
team at a time:

- While a job runs, its thread has the cores, and the /predict forward of a CPU device runs on one
  thread (no team). The job runs in a thread of its own (`run_in_own_thread`), so its team ends
  with it instead of living on, idle, in Celery's main thread.
- While no job runs, the CPU device thread's forward of a heavy model has all the cores (or
  `predict_cpu_threads`), a light model's one (`ForwardThreads`, worker/serving/device_loop.py). A team
  cannot be shrunk, so when a job starts the device thread hands over to a fresh one-thread
  device thread (`ForwardThreads.must_hand_over`) and the job waits for that
  (`InferenceServer.release_cores`).
- Every other thread that touches torch (intake, decode pool) is pinned to one thread
  (`pin_to_one_thread`).

Why not all the cores for every model, where the API, Redis and the load client share the cores
with the worker: with one team the forward's second thread is no longer throttled, so it spins
between ops and after the forward as libgomp means it to, and takes the core the API and Redis
need. For a short forward (cifar_net's) that spinning is most of what the second thread does, and
a light model is slower on two threads than on one, in latency and in throughput. For a long one
(resnet18's) the split pays, once the forward holds no GIL (worker/checkpoints/forward_graph.py; before, an
eager forward waited for the decoding threads at every operator, and two threads lost there too).
Hence the rule in `ForwardThreads`; TORCHYARD_PREDICT_CPU_THREADS sets one count for every model
instead. One team at a time is what keeps either from throttling the jobs. (Before the pinning,
the intake thread's model load made a second team in every worker.) The figures behind each
sentence: docs/benchmarks.md, "Figures that were quoted in code comments".
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def pin_to_one_thread() -> None:
    """This thread runs torch ops on itself only: no OpenMP team, ever.

    `torch.get_num_threads()` first: torch sets a thread's count lazily, at its first parallel op,
    to the count *any* thread set last, which would undo a `set_num_threads(1)` made before it."""
    torch.get_num_threads()
    torch.set_num_threads(1)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's cpuset, `taskset`), not
    the machine's count, which a container limited to 2 of 64 cores would otherwise take for its own."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


# A one-image forward on one thread at least this long is split over the cores: well above a light
# model's (cifar_net's) and well below a heavy one's (resnet18's), so neither sits near the line.
HEAVY_FORWARD_S = 0.004


class ForwardThreads:
    """How many torch threads a CPU device's forward uses, and when its thread must be replaced.

    While a job runs on the worker: one, always (the job has the cores). Otherwise, unless the
    operator set a count for every model (TORCHYARD_PREDICT_CPU_THREADS), it depends on the model:
    one whose one-image forward takes HEAVY_FORWARD_S or more on one thread (resnet18) runs on all
    the cores, a lighter one (cifar_net) on one: an OpenMP team costs a wake-up per operator and
    spins on the other cores after the forward, which a long forward repays and a short one does
    not (the module's docstring).

    A thread that has run with more than one thread holds a team for good, so going down to one
    while a job runs means handing over to a fresh thread (a light model's forward on one thread
    in the same thread is fine: the team sleeps, unused)."""

    def __init__(self, cores: int, every_model: bool = False) -> None:
        self.cores = max(1, cores)
        self.every_model = every_model  # the operator's count: for light models too

    def wanted(self, job_running: bool, heavy: bool = True) -> int:
        if job_running:
            return 1
        return self.cores if heavy or self.every_model else 1

    @staticmethod
    def must_hand_over(wanted: int, most_used: int) -> bool:
        """Whether the thread that ran with up to `most_used` threads can no longer serve `wanted`."""
        return wanted == 1 and most_used > 1


def run_in_own_thread(work: Callable[[], T], threads: int, name: str) -> T:
    """`work()` in a fresh thread on `threads` torch threads; its result or its exception here.

    The thread's OpenMP team ends with the thread (libgomp frees a thread's pool when it exits),
    so the cores are free again for the /predict forward once the job is done. The thread is a
    daemon: a process that must exit does not wait for it (the job's delivery is fenced and
    resumes elsewhere)."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outcome.append(work())
        except BaseException as exc:  # re-raised in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
