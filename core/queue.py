"""The training queue contract between the API and the workers, owned here.

A training job travels as one Celery message, `torchyard.train(job_id, delivery_token)`
(`TrainDelivery`), on a queue chosen by the job's `device` request (`queue_for_device`). Both
sides build the Celery app here; no task code is imported, so the API sends tasks by name and
never loads the worker's modules. Predictions do not use Celery (see core/wire.py).

A data-parallel job (`world_size` > 1) has a `gang…` queue instead, which no worker consumes:
"sending" its delivery puts it in `ty:gangs:waiting`, where the gang scheduler (core/gangs/scheduler.py)
reserves free devices for all its ranks at once and then sends one message per rank,
`torchyard.train(job_id, token, seat)`, to each reserved device's own queue.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from celery import Celery

from core import keys
from core.access.fair_share import TOP_STEP, share_priority
from core.config import Settings
from core.redis import celery_broker_url

TRAIN_TASK = "torchyard.train"
TRAIN_QUEUE = "train"
# The queues of data-parallel jobs: never consumed, see the module docstring.
GANG_QUEUE = "gang"
# The queues every deployment has; per-device ones (train.dev.<id>) come and go with devices.
SHARED_TRAIN_QUEUES = (TRAIN_QUEUE, f"{TRAIN_QUEUE}.cpu", f"{TRAIN_QUEUE}.cuda")


def queue_for_device(requested: str, world_size: int = 1) -> str:
    """Celery queue for a `device` request: shared (auto), per type (cuda, cpu), or one device's own.
    A data-parallel job's is the gang queue of the same request (rank 0's device, for an id)."""
    base = GANG_QUEUE if world_size > 1 else TRAIN_QUEUE
    if requested == "auto":
        return base
    if requested in ("cuda", "cpu"):
        return f"{base}.{requested}"
    return f"{base}.dev.{requested}"


def is_gang_queue(queue: str) -> bool:
    return queue == GANG_QUEUE or queue.startswith(f"{GANG_QUEUE}.")


def gang_request(queue: str) -> str:
    """The `device` request a gang queue was made from (queue_for_device's inverse)."""
    rest = queue[len(GANG_QUEUE) + 1:]
    return rest[len("dev."):] if rest.startswith("dev.") else (rest or "auto")


@dataclass(frozen=True)
class TrainDelivery:
    """One delivery of a job: the worker runs it only while `token` is the job's current one."""

    job_id: str
    token: str
    queue: str
    # A gang's rank: "<rank>.<attempt id>" (core/gangs/records.Seat), sent to that rank's device queue.
    seat: str | None = None

    def task_args(self) -> list[str]:
        return [self.job_id, self.token] + ([self.seat] if self.seat else [])

    @property
    def task_id(self) -> str:
        """The Celery task id of this delivery's message: how the dispatch reconciler recognises
        it waiting in a queue (`waiting_task_ids`). Ids and tokens are hex, so the dot is unambiguous."""
        return f"{self.job_id}.{self.token}" + (f".{self.seat}" if self.seat else "")


# How the job store sends a delivery; a callable so core/jobs/ never imports Celery.
Dispatch = Callable[[TrainDelivery], None]


def create_celery(settings: Settings, *, with_tasks: bool = False) -> Celery:
    app = Celery("torchyard", broker=celery_broker_url(settings.resolved_redis_url()),
                 include=["worker.runtime.tasks"] if with_tasks else [])
    app.conf.update(
        task_ignore_result=True,  # job state lives in the job store, not in a result backend
        # A job is acknowledged only when its task returns, and one worker takes one job at a time.
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_reject_on_worker_lost=True,
        # Redelivery of a dead worker's job is the job store's lease sweep (tens of seconds); Redis'
        # own visibility timeout is set far beyond any job so it never starts a second copy. If it
        # ever does restore a message, its stale delivery token makes the worker drop it.
        broker_transport_options={"visibility_timeout": 7 * 24 * 3600},
        broker_connection_retry_on_startup=True,
        # Never give up on the broker: a restarted Redis (embedded, AOF) comes back on the same URL,
        # and the consumer must resume by itself rather than exit after 100 tries.
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        task_default_queue="train",
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        # What Celery 6 will do, asked for now so Celery's multi-line deprecation warning is not
        # logged on every broker reconnect. It cancels nothing of ours: a solo pool runs the task in
        # the consumer's own thread, so the consumer sees a lost connection only between tasks,
        # never while a job runs (a job rides out the outage itself, worker/runtime/delivery.py).
        worker_cancel_long_running_tasks_on_connection_loss=True,
    )
    return app


def dispatcher(app: Celery, client: Any = None) -> Dispatch:
    """The JobStore's dispatch callable: one `train(job_id, token)` message on the job's queue, or,
    for a gang queue, the delivery in `ty:gangs:waiting` (through `client`, the job store's Redis)."""

    def dispatch(delivery: TrainDelivery) -> None:
        if is_gang_queue(delivery.queue):
            if client is None:
                raise RuntimeError("this dispatcher cannot queue data-parallel jobs (no Redis client)")
            client.zadd(keys.GANGS_WAITING, {delivery.task_id: 0}, nx=True)
            return
        # A gang's rank goes first: its devices are reserved or held for it, so behind any single job
        # it would leave them idle while those are taken and given back (the starved gang of #33).
        # Any other: fair share between projects (core/access/fair_share.py), its project's load now.
        if delivery.seat:
            priority: int | None = TOP_STEP
        else:
            priority = share_priority(client, delivery.job_id) if client is not None else None
        app.send_task(TRAIN_TASK, args=delivery.task_args(), queue=delivery.queue, task_id=delivery.task_id,
                      priority=priority)

    return dispatch


def waiting_task_ids(client: Any, queues: Iterable[str]) -> set[str]:
    """Task ids of the messages waiting in these Celery queues (not those a worker has taken).

    kombu's Redis transport keeps a queue as lists of JSON messages (one list per priority,
    core/keys.kombu_queue_lists) whose `headers.id` is the Celery task id (protocol 2). One LRANGE
    per list: the reconciler reads them only when some queued job is overdue. A gang queue's waiting
    deliveries are the members of `ty:gangs:waiting`."""
    pipe = client.pipeline(transaction=False)
    gangs = any(is_gang_queue(queue) for queue in queues)
    if gangs:
        pipe.zrange(keys.GANGS_WAITING, 0, -1)
    for queue in queues:
        if not is_gang_queue(queue):
            for name in keys.kombu_queue_lists(queue):
                pipe.lrange(name, 0, -1)
    replies = pipe.execute()
    found: set[str] = set(replies.pop(0)) if gangs else set()
    for messages in replies:
        for raw in messages:
            try:
                task_id = json.loads(raw)["headers"]["id"]
            except (ValueError, KeyError, TypeError):
                continue  # not a Celery protocol-2 message: not one of ours
            if isinstance(task_id, str):
                found.add(task_id)
    return found
