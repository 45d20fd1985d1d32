"""/predict on a worker's device, as stages (worker/serving/engine.py has the map)."""
