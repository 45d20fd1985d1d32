"""The worker's rooms as docs/architecture.md draws them, checked on the code as it is: every module
of worker/ lives in a room (runtime, device, training, data, checkpoints, kinds, serving, gang), a
name private to one room (a leading underscore) is never imported by another, and a batch
prediction decodes through the data room's one image → array module, never through the /predict
engine's."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO

WORKER = REPO / "worker"
ROOMS = {"runtime", "device", "training", "data", "checkpoints", "kinds", "serving", "gang", "tracking"}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "worker" else None


def _from_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every `from worker... import name` in `path`, at any depth."""
    return [(node.module, alias.name) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and node.module.startswith("worker.") for alias in node.names]


def test_every_worker_module_lives_in_a_room() -> None:
    assert {p.name for p in WORKER.glob("*.py")} == {"__init__.py"}
    assert {p.name for p in WORKER.iterdir() if p.is_dir() and p.name != "__pycache__"} == ROOMS
    assert all((WORKER / room / "__init__.py").is_file() for room in ROOMS)


def test_no_room_imports_a_name_private_to_another() -> None:
    breaches = []
    for path in sorted(WORKER.rglob("*.py")):
        here = path.relative_to(WORKER).parts[0]
        for module, name in _from_imports(path):
            if name.startswith("_") and _room(module) not in (None, here):
                breaches.append(f"{path.relative_to(REPO)} imports {module}.{name}")
    assert breaches == []


def test_a_batch_prediction_decodes_as_predict_does_without_its_engine() -> None:
    for relative in ("kinds/batch_predict.py", "data/batch_predict_loader.py"):
        modules = {module for module, _ in _from_imports(WORKER / relative)}
        assert not {m for m in modules if m.startswith("worker.serving")}, relative
    assert ("worker.data.image_array", "decode_image") in _from_imports(WORKER / "data" / "batch_predict_loader.py")
    assert ("worker.data.image_array", "decode_image") in _from_imports(WORKER / "serving" / "decode_processes.py")
