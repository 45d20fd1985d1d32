"""/predict on the API's side, as stages named as the worker's (app/api/serving/engine.py has the map)."""
