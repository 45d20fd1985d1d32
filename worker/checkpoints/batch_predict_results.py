"""A `predict` job's results file: the job's one order of files, a JSON line per file, and the
resume point that says how much of a delivery's working file is final.

Exactly once, in order, whatever dies: the handler (worker/kinds/batch_predict.py) appends lines to a
working file of its delivery and, now and then, fsyncs it and records a `ResumePoint` (how many
images and bytes of it are final) in one fenced write. A redelivery copies exactly that prefix
(`copy_prefix`) and goes on from the next file of the same order (`list_images`); whatever the dead
delivery wrote after its last recorded point is ignored. Kept apart from decoding and the forward,
because this is the contract between deliveries and with the reader of results.jsonl.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from core.wire import strict_json


# ---------------------------------------------------------------------- the files, in order
def list_images(root: Path) -> list[str]:
    """Every file under `root` as a POSIX path relative to it, sorted: the job's one order (its
    resume point counts images of it). Dotfiles and dot-folders are not the dataset's."""
    found: list[str] = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        base = Path(directory).relative_to(root)
        found.extend((base / name).as_posix() for name in files if not name.startswith("."))
    return sorted(found)


def true_label(relative: str) -> str:
    """A labelled (ImageFolder) dataset's class of a file: its folder under the root."""
    return relative.split("/", 1)[0]


# ---------------------------------------------------------------------- the lines
def result_line(file: str, values: Sequence[float], indices: Sequence[int], classes: Sequence[str],
                label: str | None = None) -> bytes:
    """One image's line: the top-k (label, index, probability), best first, as /predict answers them
    (core/wire.strict_json, so a non-finite probability is null there as here). The dict goes to
    orjson in one call: this runs per image on the thread that also runs the forward, where
    assembling the string from pre-encoded pieces cost more and json.dumps several times more
    (docs/benchmarks.md, "Figures that were quoted in code comments")."""
    doc: dict[str, Any] = {"file": file}
    if label is not None:
        doc["label"] = label
    doc["predictions"] = [{"label": classes[i], "index": i, "probability": p}
                          for p, i in zip(values, indices, strict=True)]
    return strict_json(doc) + b"\n"


def error_line(file: str, error: str, label: str | None = None) -> bytes:
    doc: dict[str, Any] = {"file": file}
    if label is not None:
        doc["label"] = label
    doc["error"] = error
    return strict_json(doc) + b"\n"


# ---------------------------------------------------------------------- the resume point
@dataclass(frozen=True)
class ResumePoint:
    """What of a delivery's working file is final: its first `bytes` bytes hold the lines of the
    first `images` files of the job's order (of `total`)."""

    images: int
    bytes: int
    total: int
    errors: int = 0
    correct: int = 0  # labelled: top-1 right, among the images that decoded

    @classmethod
    def parse(cls, raw: str | None) -> ResumePoint | None:
        if not raw:
            return None
        try:
            doc = json.loads(raw)
            return cls(images=int(doc["images"]), bytes=int(doc["bytes"]), total=int(doc["total"]),
                       errors=int(doc.get("errors", 0)), correct=int(doc.get("correct", 0)))
        except (ValueError, KeyError, TypeError):
            return None


def copy_prefix(source: Path, target: BinaryIO, point: ResumePoint) -> bool:
    """Copy the final part of an earlier delivery's working file into this one's. False (nothing
    usable copied; the caller starts over) when the file is gone or does not hold that many lines."""
    try:
        with open(source, "rb") as fh:
            prefix = fh.read(point.bytes)
    except OSError:
        return False
    if len(prefix) != point.bytes or prefix.count(b"\n") != point.images:
        return False
    target.write(prefix)
    return True
