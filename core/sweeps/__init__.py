"""Sweeps: a hyper-parameter search over the queue, with Optuna as the search engine.

- `spec`: what POST /sweeps takes (the base training body, the space, the sampler and pruner) and
  every check of it that needs nothing but the request (a 422 naming the field); the answers;
- `records`: the sweep's record, its trials' jobs, events, Idempotency-Key and lock in Redis;
- `study`: its Optuna study on a journal in the service's Redis, the sampler and the pruner made
  again from the request wherever the study is opened (Optuna stores neither);
- `coordinator`: the driver (ask, submit each trial as a training job, tell, finish), idempotent
  and run by one process at a time, so any process may be killed anywhere in it.

This face imports nothing: the client reads `spec` without loading Optuna."""
