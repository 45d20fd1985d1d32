"""A worker process: one device, its heartbeat and inference threads, and a solo-pool Celery
consumer for training jobs.

Why the solo pool. The task runs in this process, on its main thread, in the same CUDA context
as the inference thread: one context per GPU (each costs hundreds of MiB), and models resident
for /predict stay shared. A prefork pool would run jobs in forked children instead, and it is
unsafe here: the heartbeat and inference threads initialise CUDA in the parent, CUDA does not
survive fork ("Cannot re-initialize CUDA in forked subprocess"), and Celery re-forks children at
any time (a child died, max-tasks-per-child). A device trains one job at a time anyway, so
concurrency 1 loses nothing; with acks_late and prefetch multiplier 1 the worker holds no second
job while it trains, so an `auto` job goes to an idle worker instead of queueing behind a busy one.

The price: while a task runs, the main thread answers no Celery ping or remote control. Liveness
therefore comes from the heartbeat thread (GET /devices), and shutdown from a flag: SIGTERM sets
`state.shutdown`, which the trainer checks every step, so the job stops, checkpoints and requeues.

A sticky device error (worker/device/health.py) takes the worker out of service the same way: the
job in hand is requeued, the inference thread stops, the process sends itself SIGTERM (Celery's
warm shutdown: no further message is taken) and exits with `EXIT_OUT_OF_SERVICE`, so that its
supervisor starts a fresh process, with a fresh CUDA context.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, NoReturn

from core.config import Settings
from core.datasets import DatasetCatalog
from core.devices import DeviceRegistry, instance_pid, new_instance
from core.jobs import JobStore
from core.queue import TRAIN_QUEUE, queue_for_device
from core.redis import connect
from core.storage import CheckpointPaths
from worker.data import forkserver
from worker.device.pinning import WorkerDevice
from worker.runtime.job_runner import JobRunner
from worker.runtime.state import WorkerState

log = logging.getLogger(__name__)

# The exit status of a worker whose device broke: its supervisor restarts it (any non-zero status).
EXIT_OUT_OF_SERVICE = 3

_current: WorkerRuntime | None = None


def current_runtime() -> WorkerRuntime:
    if _current is None:
        raise RuntimeError("no worker runtime in this process (tasks run inside `torchyard worker`)")
    return _current


@dataclass
class WorkerRuntime:
    settings: Settings
    device: WorkerDevice
    runner: JobRunner

    def queues(self) -> list[str]:
        return [TRAIN_QUEUE, queue_for_device(self.device.kind), queue_for_device(self.device.id)]


def run_worker(settings: Settings, device: WorkerDevice) -> int:
    """Serve until SIGTERM/SIGINT; the job in hand is stopped at its next step and requeued."""
    global _current
    import torch  # after pinning: the caller set CUDA_VISIBLE_DEVICES before this import
    from celery.signals import worker_shutting_down

    from core.devices import DeviceSlots
    from core.gangs import GangRecords, GangScheduler
    from core.gangs.policy import reservation_s
    from core.queue import create_celery, dispatcher
    from worker.data.device_jpeg import device_decodes
    from worker.device.health import DeviceHealth
    from worker.device.pinning import check_cuda
    from worker.gang.member import GangServices
    from worker.runtime.heartbeat import Heartbeat, Sweeper
    from worker.serving.engine import InferenceServer
    from worker.serving.model_cache import ModelCache

    check_cuda(device)
    # The jobs' torch threads: the process's default (all the cores, or OMP_NUM_THREADS), read here
    # in the main thread before any other thread sets a count (worker/device/cpu_threads.py).
    job_threads = torch.get_num_threads()
    client = connect(settings.resolved_redis_url())
    celery = create_celery(settings, with_tasks=True)
    dispatch = dispatcher(celery, client)
    store = JobStore(client, dispatch, lease_ttl_s=settings.lease_ttl_s,
                     max_attempts=settings.max_attempts, dispatch_grace_s=settings.dispatch_grace_s)
    registry = DeviceRegistry(client, settings.heartbeat_ttl_s)
    instance = new_instance(os.getpid())
    registry.acquire(device.id, instance, holder_is_dead=lambda holder: _crashed_here(holder, device))
    # A predecessor of this worker (same name: same device, same host) that crashed held its job
    # until the lease expires; its pid is gone, so that job runs again now (docs/reliability.md).
    for job_id in store.take_back_from_dead(device.worker_name, instance, _instance_gone):
        log.warning("job %s: its worker process here died; taken back without waiting for its lease", job_id)
    slots = DeviceSlots(client, device.id)
    slots.reset()  # what a predecessor on this device was busy with is over (core/devices/slots.py)
    gangs = GangScheduler(client, dispatch, registry.all, reservation_s=reservation_s(settings), instance=instance)

    state = WorkerState()
    paths = CheckpointPaths(settings.checkpoints_dir)
    health = DeviceHealth(settings.device_fault_file, torch_device=device.torch_device)
    cache = ModelCache(paths, device.torch_device, settings.model_cache_count, settings.model_cache_bytes)
    out_of_service_once = threading.Lock()

    def take_out_of_service(reason: str) -> None:
        """Stop serving on a broken device; the warm shutdown lets the job in hand requeue itself."""
        state.out_of_service.set()
        if not out_of_service_once.acquire(blocking=False):
            return
        log.error("taking %s out of service: %s; exiting for a fresh process", device.id, reason)
        inference.stop()
        os.kill(os.getpid(), signal.SIGTERM)

    # Its own connection, which does not decode responses: prediction requests are binary frames.
    inference = InferenceServer(connect(settings.resolved_redis_url(), decode_responses=False), device, cache,
                                max_batch=settings.predict_max_batch, max_wait_ms=settings.predict_max_wait_ms,
                                max_pixels=settings.max_image_pixels, cpu_threads=settings.predict_cpu_threads,
                                decode_processes=settings.predict_decode_processes,
                                decode_timeout_s=settings.predict_decode_timeout_s,
                                device_decode=device_decodes(settings.decode, device.kind),
                                decode_batch_pixels=settings.decode_batch_pixels,
                                job_running=lambda: state.current_job is not None, health=health,
                                on_broken=take_out_of_service)

    heartbeat = Heartbeat(device, instance, registry, store, state, cache.resident, settings.heartbeat_interval_s,
                          inference_stats=inference.stats.as_dict,
                          sweeper=Sweeper(store, paths, instance, settings.lease_ttl_s), health=health,
                          take_out_of_service=take_out_of_service, gangs=gangs)
    runner = JobRunner(settings, device, store, DatasetCatalog(client, settings, store), state, health=health,
                       instance=instance, take_out_of_service=take_out_of_service, torch_threads=job_threads,
                       release_cores=inference.release_cores,
                       gangs=GangServices(slots, GangRecords(client), gangs.resend))
    _current = WorkerRuntime(settings, device, runner)

    worker_shutting_down.connect(lambda **_: state.shutdown.set(), weak=False)
    _sigterm_before_celery(state)
    threading.Thread(target=_prepare_for_jobs, name="prepare-for-jobs", daemon=True).start()
    # Said before the first heartbeat: from that beat on the stack is ready (/readyz), and `up`'s
    # banner, which waits for it, comes after this line in its log.
    log.info("worker %s on %s (torch %s, CUDA_VISIBLE_DEVICES=%r)", device.worker_name, device.id,
             torch.__version__, os.environ.get("CUDA_VISIBLE_DEVICES"))
    heartbeat.beat()
    heartbeat.start()
    inference.start()
    tracker = None
    if settings.mlflow_tracking_uri:  # jobs' runs on an MLflow server, off the training loop
        from worker.tracking.tracker import Tracker, client_missing

        if client_missing():
            log.error("TORCHYARD_MLFLOW_TRACKING_URI is set but MLflow's client is not installed "
                      "(pip install '.[mlflow]'): jobs run, nothing is tracked")
        else:
            tracker = Tracker(client, settings)
            tracker.start()
    _quiet_celery_root_warning(celery.conf.accept_content)
    worker = celery.Worker(hostname=device.worker_name, pool="solo", concurrency=1,
                           queues=_current.queues(), without_gossip=True, without_mingle=True,
                           optimization="fair", loglevel="INFO")
    try:
        worker.start()
    finally:
        state.shutdown.set()
        inference.stop()
        heartbeat.stop()
        if tracker is not None:
            tracker.stop()
        _current = None
    if state.out_of_service.is_set():
        _exit_out_of_service()
    return worker.exitcode or 0


def _quiet_celery_root_warning(accept_content: Any) -> None:
    """Celery warns a worker run as root, at every start, that it is "absolutely not recommended". The
    danger it means is a pickled message run as root, and this worker accepts JSON only (with pickle
    accepted Celery refuses to start as root by itself); `make run` as root and a root container do
    so on purpose (the image runs as a user of its own). Nothing is hidden when pickle is accepted."""
    if any("pickle" in str(content) or "serialize" in str(content) for content in accept_content or ()):
        return
    import warnings

    from celery.exceptions import SecurityWarning

    warnings.filterwarnings("ignore", message="You're running the worker with superuser privileges",
                            category=SecurityWarning)


def _sigterm_before_celery(state: WorkerState) -> None:
    """Until Celery installs its own handler (as the worker starts consuming, so no job is in hand
    yet), a SIGTERM would end the process by the default action. That is right for an operator's
    stop, but not for this worker's own after its device broke while it already served /predict:
    the supervisor must see EXIT_OUT_OF_SERVICE, not a death by signal."""

    def before_celery(signum: int, frame: object) -> None:
        if state.out_of_service.is_set():
            _exit_out_of_service()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, before_celery)


def _prepare_for_jobs() -> None:
    """What a worker's first job would otherwise pay on its own clock, done beside the worker's
    start: the forkserver its decoding pools fork from (worker/data/forkserver.py), and torchvision, which
    builds the zoo's models and imports torch._dynamo with it (seconds of imports; docs/benchmarks.md,
    "A first job's fixed cost"). A job that needs either before this thread is done waits for it
    (the import lock), never does it twice."""
    try:
        forkserver.start()
        import models.torchvision_nets  # noqa: F401  (the import is the point)
    except Exception:  # the first job would meet the same error, where it is reported
        log.exception("preparing for the first job failed")


def _exit_out_of_service() -> NoReturn:
    """A worker whose device broke ends here, without the interpreter's finalizers. Everything it
    owes is done by now (the job requeued, Celery stopped, the device released as broken); what is
    left are torch's CUDA objects (the caching allocator, events, streams, library handles), whose
    destructors at exit run on a context that is now unusable and can abort the process
    ("terminate called after throwing an instance of 'c10::Error'") or block. The supervisor must
    see EXIT_OUT_OF_SERVICE, at once, to start a fresh process."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_OUT_OF_SERVICE)


def _instance_gone(instance: str) -> bool:
    """The worker process of this host that `instance` names no longer exists (asked only about
    instances of this worker's own name, so of this host: another host's pids mean nothing here).
    A token without a pid is never taken for dead: its job waits for its lease."""
    import psutil

    pid = instance_pid(instance)
    return pid is not None and (pid == os.getpid() or not psutil.pid_exists(pid))


def _crashed_here(holder: dict, device: WorkerDevice) -> bool:
    """The holder was a worker for this device on this host whose process no longer exists."""
    import psutil

    pid = holder.get("pid")
    return holder.get("worker") == device.worker_name and isinstance(pid, int) and not psutil.pid_exists(pid)
