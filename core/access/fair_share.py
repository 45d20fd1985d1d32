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
they are not reordered.

What it is not: a share of device time. A project whose jobs are long keeps the devices it got;
the order only decides who takes the next free device.
"""

from __future__ import annotations

from typing import Any

from core import keys
from core.access.projects import project_of

STEPS = (0, 3, 6, 9)  # kombu's default priority_steps: the lists a worker reads, in this order


def share_priority(client: Any, job_id: str) -> int:
    """The priority step `job_id`'s message is sent with: its project's running jobs plus its jobs
    queued before it, 0 for none, the last step from three on."""
    project = project_of(client.hget(keys.job(job_id), "project"))
    running = client.zrange(keys.jobs_with_status("running"), 0, -1)
    older = client.zrangebylex(keys.jobs_with_status("queued"), "-", f"({job_id}")
    pipe = client.pipeline(transaction=False)
    for other in (*running, *older):
        pipe.hget(keys.job(other), "project")
    load = sum(1 for p in pipe.execute() if project_of(p) == project)
    return STEPS[min(load, len(STEPS) - 1)]
