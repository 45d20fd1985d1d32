"""The batch-prediction handler's pieces: the files' one order, the lines, the resume point, and
the decode of real image files beside the forward (worker/predict_job.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from worker.checkpoint import ModelMeta, Preprocessing
from worker.predict_job import (
    ForwardThreadChoice,
    ResumePoint,
    copy_prefix,
    decoded_batches,
    error_line,
    list_images,
    result_line,
    thread_split,
    true_label,
)
from worker.serving.decode import decode_image

META = ModelMeta("cifar_net", 3, ["cat", "dog", "eel"], Preprocessing(3, 16, 16, (0.5,) * 3, (0.25,) * 3), "job")


def _write(path: Path, fmt: str, seed: int, size: tuple[int, int] = (20, 12)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path, format=fmt)


def test_list_images_is_sorted_relative_and_skips_dotfiles(tmp_path: Path) -> None:
    for name in ("b/2.png", "a.png", "b/10.png", "c/d/e.jpg", ".cache/x.png", "b/.DS_Store"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert list_images(tmp_path) == ["a.png", "b/10.png", "b/2.png", "c/d/e.jpg"]
    assert true_label("b/10.png") == "b"


def _strict(line: bytes) -> object:
    """A line parsed as strict JSON: NaN and Infinity refused, as jq and JavaScript refuse them."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_lines_are_strict_json_with_predictions_best_first() -> None:
    line = result_line("cat/1.png", [0.7, 0.2], [0, 2], META.classes, label="cat")
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert _strict(line) == {"file": "cat/1.png", "label": "cat", "predictions": [
        {"label": "cat", "index": 0, "probability": 0.7}, {"label": "eel", "index": 2, "probability": 0.2}]}
    # Odd names come back as they were; a non-finite probability is null, as /predict answers it;
    # a name that was not UTF-8 (lone surrogates, as os.walk returns it) still makes a line.
    odd = ["caf\u00e9 \"q\"", "back\\slash", "tab\t"]
    for name, values, written in (('we"ird\\name.png', [0.123456789012345, 1e-12], [0.123456789012345, 1e-12]),
                                  ("n.png", [float("nan"), float("inf")], [None, None]),
                                  ("not-utf8-\udcff.png", [float("-inf"), 0.5], [None, 0.5])):
        line = result_line(name, values, [2, 0], odd, label="\u00e9")
        assert line.count(b"\n") == 1, line
        assert _strict(line) == {"file": name, "label": "\u00e9", "predictions": [
            {"label": odd[2], "index": 2, "probability": written[0]},
            {"label": odd[0], "index": 0, "probability": written[1]}]}
    assert json.loads(error_line("x\n.png", "cannot decode image: truncated")) == {
        "file": "x\n.png", "error": "cannot decode image: truncated"}  # a newline in a name stays in its line


def test_resume_point_parses_what_it_recorded_and_refuses_garbage() -> None:
    point = ResumePoint(images=5, bytes=100, total=9, errors=1, correct=3)
    assert ResumePoint.parse(json.dumps(point.__dict__)) == point
    for raw in (None, "", "not json", "{}", '{"images": "x", "bytes": 1, "total": 2}'):
        assert ResumePoint.parse(raw) is None


def test_copy_prefix_takes_exactly_the_recorded_lines(tmp_path: Path) -> None:
    source = tmp_path / "a.jsonl"
    lines = [result_line(f"{k}.png", [1.0], [0], META.classes) for k in range(4)]
    source.write_bytes(b"".join(lines) + b'{"file": "half-writ')  # what a SIGKILL leaves after the point
    out = io.BytesIO()
    assert copy_prefix(source, out, ResumePoint(images=3, bytes=sum(map(len, lines[:3])), total=4))
    assert out.getvalue() == b"".join(lines[:3])
    # A point that does not match the file (fewer bytes, other line count), or no file: start over.
    assert not copy_prefix(source, io.BytesIO(), ResumePoint(images=2, bytes=sum(map(len, lines[:3])), total=4))
    assert not copy_prefix(source, io.BytesIO(), ResumePoint(images=9, bytes=10_000, total=9))
    assert not copy_prefix(tmp_path / "gone.jsonl", io.BytesIO(), ResumePoint(images=0, bytes=0, total=1))


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
    # Each image is exactly /predict's decode of that file.
    expected = [decode_image((tmp_path / f).read_bytes(), META, 10**6) for f in files[2:6] if f != "img05.png"]
    assert torch.equal(broken.images, torch.from_numpy(np.stack(expected)))


def test_the_forward_takes_every_core_only_when_decoding_is_light() -> None:
    # resnet18 on 2 cores: the forward ~3.2 ms an image, decoding ~50 µs: all cores, once, decided on
    # the second batch (the first warms up)
    heavy = ForwardThreadChoice(cores=2, split_threads=1)
    assert heavy.observe(decode_cpu_s=64 * 50e-6, forward_s=64 * 3.2e-3) is None
    assert heavy.observe(decode_cpu_s=64 * 50e-6, forward_s=64 * 3.2e-3) == 2
    assert heavy.observe(decode_cpu_s=64 * 50e-6, forward_s=64 * 3.2e-3) is None and heavy.threads == 2
    # cifar_net: decoding is a third of the forward's time: the decoder keeps its core
    light = ForwardThreadChoice(cores=2, split_threads=1)
    assert [light.observe(64 * 50e-6, 64 * 175e-6) for _ in range(4)] == [None] * 4 and light.threads == 1
    # nothing to take: one core, or the split already has them all
    assert [ForwardThreadChoice(1, 1).observe(0.0, 1.0) for _ in range(2)] == [None, None]


def test_thread_split_leaves_the_forward_a_core() -> None:
    assert thread_split(False, 2) == (1, 1)
    assert thread_split(False, 16) == (8, 8)
    assert thread_split(False, 1) == (1, 1)
    assert thread_split(True, 16) == (8, 1)
