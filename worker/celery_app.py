"""The Celery app: training jobs only (predictions use a lighter per-device Redis queue, see
worker/inference.py). No task code is imported here, so the API can send tasks by name."""

from __future__ import annotations

from celery import Celery

from app.core.config import Settings
from app.core.redis import celery_broker_url

TRAIN_TASK = "torchyard.train"


def create_celery(settings: Settings, *, with_tasks: bool = False) -> Celery:
    app = Celery("torchyard", broker=celery_broker_url(settings.resolved_redis_url()),
                 include=["worker.tasks"] if with_tasks else [])
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
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    return app


def dispatcher(app: Celery):
    """The JobStore's dispatch callable: one `train(job_id, token)` message on the job's queue."""

    def dispatch(job_id: str, token: str, queue: str) -> None:
        app.send_task(TRAIN_TASK, args=[job_id, token], queue=queue)

    return dispatch
