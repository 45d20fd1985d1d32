"""MLflow tracking, the worker's side: tracker.py the thread that ships enlisted jobs' records to
their runs (core/tracking.py: why the record is the outbox), runs.py a record → its run (params,
tags, epoch metrics once each, artifacts, status), registry.py aliases → registered models and
their `current` alias. Imports nothing, like every room: mlflow loads only where tracking is on."""
