"""A static check of the sources: every `torch.load` is `weights_only=True`, and no package of the
service imports a pickle module or unpickles, so no user file can run code when it is read
(docs/security.md). Reads the code, starts nothing."""

from __future__ import annotations

import ast

from tests.support import REPO


def _torch_load_calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"]


def test_every_torch_load_is_weights_only_and_nothing_unpickles() -> None:
    sources = [p for folder in ("app", "core", "client", "worker", "models", "bench", "scripts", "tests")
               for p in (REPO / folder).rglob("*.py")]
    assert sources
    unsafe, calls = [], 0
    for path in sources:
        text = path.read_text()
        tree = ast.parse(text)
        for call in _torch_load_calls(tree):
            calls += 1
            flag = next((k.value for k in call.keywords if k.arg == "weights_only"), None)
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                unsafe.append(f"{path.relative_to(REPO)}:{call.lineno}")
        service = any(path.is_relative_to(REPO / package) for package in ("app", "core", "client", "worker", "models"))
        for node in ast.walk(tree):
            if service and isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in ("pickle", "dill", "cloudpickle", "marshal", "shelve") for n in names):
                    unsafe.append(f"{path.relative_to(REPO)}:{node.lineno} imports a pickle module")
            if (isinstance(node, ast.Attribute) and node.attr in ("load", "loads", "Unpickler")
                    and isinstance(node.value, ast.Name) and node.value.id in ("pickle", "dill", "cloudpickle")):
                unsafe.append(f"{path.relative_to(REPO)}:{node.lineno} unpickles")
    assert calls >= 2  # the checkpoint loader and the dataset cache at least
    assert not unsafe, unsafe
