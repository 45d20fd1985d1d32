"""A batch prediction's decoding beside its forward (worker/data/batch_predict_loader.py): real image files
decoded in DataLoader worker processes, in order, with what does not decode reported; and how the
cores are shared between decoding and the forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.worker.checkpoints.test_batch_predict_results import META
from worker.checkpoints.batch_predict_results import list_images
from worker.data.batch_predict_loader import ForwardThreadChoice, decoded_batches, thread_split
from worker.serving.decode import Decoder


def _write(path: Path, fmt: str, seed: int, size: tuple[int, int] = (20, 12)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path, format=fmt)


@pytest.mark.parametrize("workers", [0, 1])
def test_decoded_batches_keep_the_order_and_report_what_does_not_decode(tmp_path: Path, workers: int) -> None:
    names = [f"img{k:02d}.{'jpg' if k % 3 == 0 else 'png'}" for k in range(11)]
    for k, name in enumerate(names):
        _write(tmp_path / name, "JPEG" if name.endswith("jpg") else "PNG", k)
    (tmp_path / "img05.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"broken" * 4)
    files = list_images(tmp_path)
    batches = list(decoded_batches(tmp_path, files, META, 10**6, 4, start=2, workers=workers))
    assert [b.start for b in batches] == [2, 6, 10]
    assert [f for b in batches for f in b.files] == files[2:]
    broken = batches[0]
    assert list(broken.errors) == [3] and "cannot decode image" in broken.errors[3]
    assert broken.images is not None and broken.images.shape == (3, 3, 16, 16) and broken.images.dtype == torch.uint8
    # A file gone from the disk is an error line that does not show the server's paths.
    (tmp_path / files[-1]).unlink()
    [last] = list(decoded_batches(tmp_path, files, META, 10**6, 4, start=10, workers=workers))
    assert last.images is None and last.errors == {0: "cannot read the file: No such file or directory"}
    # Each image is exactly what /predict's decode stage makes of that file (the one image → array
    # module both go through, worker/data/image_array.py).
    predict = Decoder(processes=1, max_pixels=10**6)
    try:
        expected = predict.decode_all([(tmp_path / f).read_bytes() for f in files[2:6] if f != "img05.png"], META)
    finally:
        predict.shutdown()
    assert all(isinstance(row, np.ndarray) for row in expected)
    assert torch.equal(broken.images, torch.from_numpy(np.stack(expected)))


def test_the_forward_takes_every_core_only_when_decoding_is_light() -> None:
    # a heavy model (resnet18's proportions on a small CPU): the forward per image 64 times its
    # decoding: all cores, once, decided on the second batch (the first warms up)
    heavy = ForwardThreadChoice(cores=2, split_threads=1)
    assert heavy.observe(decode_cpu_s=64 * 50e-6, forward_s=64 * 3.2e-3) is None
    assert heavy.observe(decode_cpu_s=64 * 50e-6, forward_s=64 * 3.2e-3) == 2
    assert heavy.observe(decode_cpu_s=64 * 50e-6, forward_s=64 * 3.2e-3) is None and heavy.threads == 2
    # a light model (cifar_net's proportions): decoding a third of the forward's time: the decoder
    # keeps its core
    light = ForwardThreadChoice(cores=2, split_threads=1)
    assert [light.observe(64 * 50e-6, 64 * 175e-6) for _ in range(4)] == [None] * 4 and light.threads == 1
    # nothing to take: one core, or the split already has them all
    assert [ForwardThreadChoice(1, 1).observe(0.0, 1.0) for _ in range(2)] == [None, None]


def test_thread_split_leaves_the_forward_a_core() -> None:
    assert thread_split(False, 2) == (1, 1)
    assert thread_split(False, 16) == (8, 8)
    assert thread_split(False, 1) == (1, 1)
    assert thread_split(True, 16) == (8, 1)
