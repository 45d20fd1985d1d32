"""A process whose wall clock is off: imported at start-up by every Python process that has this
folder on its PYTHONPATH, it shifts `time.time()` (and `time.time_ns()`) by
TORCHYARD_TEST_CLOCK_OFFSET_S seconds, as a host whose clock drifted or was set wrong would read it.
Used by tests/e2e/test_predict_hardening.py to run a worker on such a host."""

import os
import time

_OFFSET_S = float(os.environ.get("TORCHYARD_TEST_CLOCK_OFFSET_S", "0") or 0)
if _OFFSET_S:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _OFFSET_S
    time.time_ns = lambda: _time_ns() + int(_OFFSET_S * 1e9)
