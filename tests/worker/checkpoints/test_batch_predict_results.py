"""A batch-prediction job's results (worker/checkpoints/batch_predict_results.py): the files' one order, the lines,
the resume point and the prefix a redelivery copies."""

from __future__ import annotations

import io
import json
from pathlib import Path

from worker.checkpoints.batch_predict_results import (
    ResumePoint,
    copy_prefix,
    error_line,
    list_images,
    result_line,
    true_label,
)
from worker.checkpoints.format import ModelMeta, Preprocessing

META = ModelMeta("cifar_net", 3, ["cat", "dog", "eel"], Preprocessing(3, 16, 16, (0.5,) * 3, (0.25,) * 3), "job")


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
