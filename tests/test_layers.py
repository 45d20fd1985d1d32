"""The layering docs/architecture.md states, checked on the import statements of the code as it is:
every import at any depth (a function's lazy import counts), those under `if TYPE_CHECKING:` aside
(they never run). `app/cli.py`, the entry point, may import every package (tests/app/test_cli.py
checks that nothing imports it back)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OURS = ("app", "client", "core", "models", "worker", "harness")
# What each package may import of ours, besides itself.
MAY_IMPORT = {
    "models": set(),
    "core": {"models"},
    "client": {"core.schemas", "core.defaults"},
    "worker": {"core", "models"},
    "app": {"core", "models"},
    "harness": {"app", "core", "models"},  # the stack's processes for tests/, bench/, scripts/: no product module imports it
}
# Libraries a package must not import itself: the domain knows no web framework and no device, and
# the API's and the client's processes never load torch (models/registry.py imports none either).
MUST_NOT_IMPORT = {
    "core": {"fastapi", "starlette", "uvicorn", "torch", "torchvision"},
    "client": {"fastapi", "starlette", "uvicorn", "torch", "torchvision"},
    "app": {"torch", "torchvision"},
    "harness": {"tests", "bench", "scripts"},  # they import it, never the other way
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


# Job kinds: each kind's params and their resolution in core/kinds/<kind>.py, its handler in
# worker/kinds/<kind>.py, named the same. A handler reads its own kind's params only, and the API's
# side of a kind is a leaf of the domain: it imports no submitter, job store or other kind's params.
KINDS = {"train", "evaluate", "predict", "export"}
KIND_LEAF_MAY_NOT = {"core.submission", "core.evaluations", "core.batch_predict", "core.exports", "core.jobs"}


def _kind_modules(package: str) -> set[str]:
    return {p.stem for p in (REPO / package / "kinds").glob("*.py") if p.stem != "__init__"}


def test_every_kind_has_its_params_and_its_handler_named_alike() -> None:
    from core.schemas import JobKind

    assert {kind.value for kind in JobKind} == KINDS
    assert _kind_modules("worker") == KINDS
    assert _kind_modules("core") == KINDS | {"request"}  # request.py: what POST /jobs accepts


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_kind_reads_its_own_params(kind: str) -> None:
    handler = _imports(ast.parse((REPO / "worker" / "kinds" / f"{kind}.py").read_text()))
    others = [name for name in handler if name.startswith("core.kinds.") and not name.startswith(f"core.kinds.{kind}.")]
    assert others == []
    params = _imports(ast.parse((REPO / "core" / "kinds" / f"{kind}.py").read_text()))
    assert [name for name in params if any(name.startswith(f"{m}.") or name == m for m in KIND_LEAF_MAY_NOT)] == []
    assert [name for name in params if name.startswith("core.kinds.")] == []
