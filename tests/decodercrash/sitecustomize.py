"""A decoder that crashes on one image: imported at start-up by every Python process that has this
folder on its PYTHONPATH (tests/e2e/test_predict_intake.py starts a worker so), it makes any
process started by multiprocessing (the worker's decoding processes) die by SIGKILL, as a decoder's
segfault would end it, when Pillow is asked to open an image whose bytes hold MARKER. The worker's
own threads are left alone. Nothing a client sends reaches this: it exists only in the processes a
test starts with this folder on their path; no setting turns it on."""

import multiprocessing
import os
import signal

from PIL import Image

MARKER = b"torchyard-test: this image kills its decoder"

_open = Image.open


def _open_or_die(fp, *args, **kwargs):
    if (multiprocessing.parent_process() is not None and hasattr(fp, "getvalue")
            and MARKER in fp.getvalue()):
        os.kill(os.getpid(), signal.SIGKILL)
    return _open(fp, *args, **kwargs)


Image.open = _open_or_die
