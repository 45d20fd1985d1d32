"""Training jobs: their records in Redis, their transitions, leases, cancellation and dispatch.

This package is the one place that knows how a job moves between states; `JobStore` is its face,
one object composed of the parts below, each a concept of its own. Every transition is a Redis
transaction (WATCH/MULTI, or one Lua script) that also appends an event to the job's stream, so
the record and the SSE history never disagree.

- `records`: how a job is stored (its id, its hash fields, the base every part shares);
- `intake`: what a user's request does (create with its Idempotency-Key, replay, cancel);
- `delivery`: what the delivery that owns a running job does (claim, lease, fenced writes, finish);
- `recovery`: how a job outlives a delivery that ended without finishing (requeue, the sweeps);
- `listing`: reading many jobs, and retiring finished ones (core/retention.py's side).

The promise: a job that was accepted runs to completion exactly once, unless cancelled, whatever
dies meanwhile. How each part of it is kept (docs/reliability.md has the faults and the tests):

- **Delivery tokens and fencing** (`delivery`). Each delivery of a job carries a fresh token; only
  the current token of a `queued` job can claim it. Every write a worker makes (progress, metrics,
  params, classes, resumed, finish, requeue) checks, inside the same script or transaction, that
  its token is still the job's and the job is `running`; otherwise nothing is written and
  `NotOwner` is raised. A stale delivery (a frozen worker, a message Redis restored) can change
  nothing a user sees. Its files are its own too (core/storage.CheckpointPaths).
- **The dispatch outbox** (`intake`, `recovery`). The record and the intent to dispatch
  (`ty:dispatch`, due one `dispatch_grace_s` later on Redis's clock) are written in one
  transaction; the message is sent after it. Claiming removes the intent. Any worker's sweep
  (`reconcile_dispatch`) re-sends the same delivery of a queued job that is overdue and whose
  message is not waiting in its queue: a process that died between record and message, a send or
  a claim that raised, a message a dead worker had taken. A job waiting behind busy workers is
  left alone (its message is in the list), so the reconciler never floods a queue; a duplicate
  message is dropped at claim.
- **Leases on Redis's clock** (`delivery`, `recovery`). A running job's lease expiry is Redis
  TIME + `lease_ttl_s`; the sweep compares it with Redis TIME, so hosts' clocks never matter. An
  expired lease is redelivered with a fresh token; after `max_attempts` deliveries the job fails.
- **Idempotency-Key** (`intake`) is written in the same transaction as the record and bound to a
  digest of the resolved request: the same request again returns the first job; another request
  under the same key is refused.
- **Files are settled after the fact** (`delivery`, `recovery`). `finish` records, with the
  terminal state, which staged files to promote (`ty:settle`); the owner promotes them at once,
  and any worker's sweep does it if the owner died in between.

Writes that a client may retry after a broken connection (core/redis.py) are idempotent: a
claim retried by the same worker instance claims, a finish found already done by the same
token reports success, an epoch already recorded as such is not recorded twice.
"""

from core.jobs.delivery import Claim
from core.jobs.intake import body_digest
from core.jobs.records import NotOwner
from core.jobs.recovery import Settlement
from core.jobs.store import JobStore

__all__ = ["Claim", "JobStore", "NotOwner", "Settlement", "body_digest"]
