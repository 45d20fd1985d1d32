"""Fair share between projects in the training queues: a project's job goes ahead of the jobs of
projects that already hold more of the devices and the queue.

How, without a scheduler of our own: kombu's Redis transport keeps a queue as one list per
priority step (0, 3, 6, 9; core/keys.KOMBU_PRIORITY_SUFFIXES) and a worker's BRPOP takes from step
0's lists first (kombu/transport/redis.py, `_brpop_start`), oldest first within a step. So each
message is sent with the step of its project's load when it is sent: its running jobs plus its
jobs queued before this one. A project with nothing running or waiting sends at step 0 and is
taken by the next worker that frees, ahead of another project's backlog (which sits at step 9 past
its first three); within one project the load only grows with each job sent, so its own jobs
keep their submission order. A message sent again (recovery, a worker that gave one back) is
judged again when it is sent. Gangs wait in ty:gangs:waiting (core/gangs/), not in these lists:
they are not reordered; once placed, each rank's message is sent at the first step, ahead of any
project's single jobs, since its device is reserved or held for it.

Within a project, `priority` (POST /jobs: low, normal, high): a job counts only the project's
older queued jobs of its priority or higher, and a high job one less, a low one one more, so a
high job goes ahead of its project's normal ones, a low one behind them.

What it is not: a share of device time. A project whose jobs are long keeps the devices it got;
the order only decides who takes the next free device.
"""

from __future__ import annotations

from typing import Any

from core import keys
from core.access.projects import project_of

STEPS = (0, 3, 6, 9)  # kombu's default priority_steps: the lists a worker reads, in this order
TOP_STEP = STEPS[0]  # a gang rank's message (core/queue.py): its devices wait for it, it never waits


RANK = {"low": 0, "normal": 1, "high": 2}


def share_priority(client: Any, job_id: str) -> int:
    """The priority step `job_id`'s message is sent with: its project's running jobs plus its jobs
    queued before it (of its priority or higher), one less for a high job and one more for a low one;
    0 for none, the last step from three on."""
    project, priority = client.hmget(keys.job(job_id), "project", "priority")
    project, rank = project_of(project), RANK.get(_text(priority) or "normal", 1)
    running = client.zrange(keys.jobs_with_status("running"), 0, -1)
    older = client.zrangebylex(keys.jobs_with_status("queued"), "-", f"({job_id}")
    pipe = client.pipeline(transaction=False)
    for other in (*running, *older):
        pipe.hmget(keys.job(other), "project", "priority")
    replies = pipe.execute()
    load = sum(1 for p, _ in replies[:len(running)] if project_of(p) == project)
    load += sum(1 for p, q in replies[len(running):]
                if project_of(p) == project and RANK.get(_text(q) or "normal", 1) >= rank)
    load += 1 - rank  # high: one less, low: one more
    return STEPS[max(0, min(load, len(STEPS) - 1))]


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
