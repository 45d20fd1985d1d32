"""A host without uvloop (Windows, PyPy, uvicorn installed without its `standard` extras): with this
folder first on a process's PYTHONPATH, `import uvloop` fails as it does there, so uvicorn runs
asyncio's own event loop, whose transports copy what they are given to write. Used by
tests/e2e/test_predict_budget.py to measure the API's memory on both loops."""

raise ImportError("uvloop is not installed on this host (tests/no_uvloop)")
