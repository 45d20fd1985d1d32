"""The layering docs/architecture.md states, checked on the import statements of the code as it is:
every import at any depth (a function's lazy import counts), those under `if TYPE_CHECKING:` aside
(they never run). `app/cli.py`, the entry point, may import every package (tests/app/test_cli.py
checks that nothing imports it back)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OURS = ("app", "client", "core", "models", "worker")
# What each package may import of ours, besides itself.
MAY_IMPORT = {
    "models": set(),
    "core": {"models"},
    "client": {"core.schemas", "core.defaults"},
    "worker": {"core", "models"},
    "app": {"core", "models"},
}
# Libraries a package must not import itself: the domain knows no web framework and no device, and
# the API's and the client's processes never load torch (models/registry.py imports none either).
MUST_NOT_IMPORT = {
    "core": {"fastapi", "starlette", "uvicorn", "torch", "torchvision"},
    "client": {"fastapi", "starlette", "uvicorn", "torch", "torchvision"},
    "app": {"torch", "torchvision"},
}


def _imports(tree: ast.AST) -> list[str]:
    """Every module named by an import statement under `tree`, skipping `if TYPE_CHECKING:` blocks."""
    found: list[str] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found.extend(_imports(ast.Module(body=node.orelse, type_ignores=[])))
            continue
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        found.extend(_imports(node))
    return found


def _breaches(package: str) -> list[str]:
    allowed, forbidden = MAY_IMPORT[package], MUST_NOT_IMPORT.get(package, set())
    breaches = []
    for path in sorted((REPO / package).rglob("*.py")):
        if path == REPO / "app" / "cli.py":
            continue
        for name in _imports(ast.parse(path.read_text())):
            top = name.split(".")[0]
            if top in forbidden or (top in OURS and top != package
                                    and not any(name == a or name.startswith(f"{a}.") for a in allowed)):
                breaches.append(f"{path.relative_to(REPO)} imports {name}")
    return breaches


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_imports_point_down(package: str) -> None:
    assert _breaches(package) == []


# Job kinds: each kind's params and their resolution in core/kinds/<name> (a module, or a package of
# them beside the kind's submitter, submit.py), its handler in worker/kinds/<name>.py, named the same.
# The name is the kind's wire value, but for batch prediction: its wire value stays "predict" (the HTTP
# contract) while "predict" alone means /predict. A handler reads its own kind's params only, and the
# API's side of a kind (all of it but its submitter) is a leaf of the domain: it imports no submitter,
# job store or other kind.
KIND_NAMES = {"train": "train", "evaluate": "evaluate", "predict": "batch_predict", "export": "export"}
# The core side's old name, accepted until core/kinds/batch_predict/ lands beside this (its own branch).
CORE_NOT_YET_RENAMED = {"batch_predict": "predict"}
KIND_LEAF_MAY_NOT = {"core.submission", "core.evaluations", "core.batch_predict", "core.exports", "core.jobs"}


def _core_home(name: str) -> Path:
    """core/kinds/<name>.py or core/kinds/<name>/ (the old name while the core side is not renamed)."""
    for candidate in (name, CORE_NOT_YET_RENAMED.get(name)):
        if candidate is None:
            continue
        for home in (REPO / "core" / "kinds" / candidate, REPO / "core" / "kinds" / f"{candidate}.py"):
            if home.exists():
                return home
    raise AssertionError(f"core/kinds/ has no home for the kind {name}")


def _home_module(home: Path) -> str:
    return f"core.kinds.{home.stem}"


def test_every_kind_has_its_params_and_its_handler_named_alike() -> None:
    from core.schemas import JobKind

    assert {kind.value for kind in JobKind} == set(KIND_NAMES)
    handlers = {p.stem for p in (REPO / "worker" / "kinds").glob("*.py") if p.stem != "__init__"}
    assert handlers == set(KIND_NAMES.values())
    homes = [_core_home(name) for name in KIND_NAMES.values()]
    assert len(set(homes)) == len(homes)
    assert (REPO / "core" / "kinds" / "request.py").is_file()  # what POST /jobs accepts


@pytest.mark.parametrize("name", sorted(KIND_NAMES.values()))
def test_a_kind_reads_its_own_params(name: str) -> None:
    own = _home_module(_core_home(name))
    others = {_home_module(_core_home(other)) for other in KIND_NAMES.values() if other != name}
    handler = _imports(ast.parse((REPO / "worker" / "kinds" / f"{name}.py").read_text()))
    assert [n for n in handler if any(n == o or n.startswith(f"{o}.") for o in others)] == []
    home = _core_home(name)
    leaf = [home] if home.is_file() else [p for p in sorted(home.rglob("*.py")) if p.name != "submit.py"]
    for path in leaf:
        names = _imports(ast.parse(path.read_text()))
        forbidden = KIND_LEAF_MAY_NOT | others | {f"{own}.submit"}
        assert [n for n in names if any(n == m or n.startswith(f"{m}.") for m in forbidden)] == [], path
