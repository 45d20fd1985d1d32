"""The worker process and one delivery inside it: the process (main.py), the Celery task (tasks.py),
the heartbeat and the recovery sweep (heartbeat.py), what its threads share (state.py), one
delivery run start to finish (job_runner.py), what a handler gets (job_context.py), its fenced
writes (delivery.py) and Redis outages ridden out (outages.py). Nothing is imported here: a room's
modules are imported by name (a decoding process must not load what it does not run)."""
