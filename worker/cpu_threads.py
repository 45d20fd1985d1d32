"""Who gets the cores of a worker process: OpenMP teams, one at a time.

torch runs its CPU ops on OpenMP, and libgomp (torch's OpenMP) gives every thread that starts a
parallel op a team of its own, which stays alive, idle, as long as that thread does. Once a
process holds more OpenMP threads than the machine has cores, libgomp "throttles": its threads
spin at most 1,000 iterations between parallel regions (libgomp's do_spin, when
gomp_managed_threads > gomp_available_cpus) and then sleep and wake through futexes, at every op.
Measured on this 2-core host, resnet18 at batch 1 from a second thread: 5.9-7.0 ms on two threads
while no other thread had a team, 9.4-10.5 ms once the main thread had one, 7.5-8.3 ms on one
thread. So a worker keeps one team at a time:

- While a job runs, its thread has the cores, and the /predict forward of a CPU device runs on one
  thread (no team). The job runs in a thread of its own (`run_in_own_thread`), so its team ends
  with it instead of living on, idle, in Celery's main thread.
- While no job runs, the CPU device thread's forward has `predict_cpu_threads` (half the cores)
  (worker/inference.py). A team cannot be shrunk, so when a job starts the device thread hands
  over to a fresh one-thread device thread (`ForwardThreads.must_hand_over`) and the job waits for
  that (`InferenceServer.release_cores`).
- Every other thread that touches torch (intake, decode pool) is pinned to one thread
  (`pin_to_one_thread`).

Why half the cores and not all, measured on this 2-core host where the API, Redis and the load
client share the cores with the worker: with one team the forward's second thread is no longer
throttled, so it spins between ops as libgomp means it to, and takes the core the API and Redis
need. resnet18 alone, alternating runs of bench/predict.py's stack, looked better on two threads
(one client p50 9.6-9.8 against 11.6-12.0 ms; 32 clients 731-832 against 661-684 images/s), but
the full bench/predict.py run had the worker's CPU per request doubled and every cell slower:
resnet18 one client 10.4 ms (worker CPU 19.2 ms per request, against 8.8 on one thread), 32
clients 639 against 727 images/s; cifar_net one client 2.7 against 1.8 ms, 32 clients 1,519
against 1,734 images/s. A host with cores to spare (or a CPU worker alone on its machine) sets
TORCHYARD_PREDICT_CPU_THREADS higher; one team at a time is what keeps that from throttling the
jobs. (Before the pinning, the intake thread's model load made a second team in every worker.)
"""

from __future__ import annotations

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


class ForwardThreads:
    """How many torch threads a CPU device's forward uses, and when its thread must be replaced.

    `cores`: the forward's threads while no job runs (all the cores unless configured); during a
    job, one. A thread that has run with more than one thread holds a team for good, so going down
    to one means handing over to a fresh thread."""

    def __init__(self, cores: int) -> None:
        self.cores = max(1, cores)

    def wanted(self, job_running: bool) -> int:
        return 1 if job_running else self.cores

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
