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
    # core.kinds: its face only (below); core.access.models (and its roles) and core.sweeps.spec: the
    # contract's models of keys, projects and sweeps, pure pydantic (client/teams.py)
    "client": {"core.schemas", "core.defaults", "core.kinds", "core.access.models", "core.access.roles",
               "core.sweeps.spec"},
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


# Job kinds: each kind's package core/kinds/<kind>/ (its request, params and their resolution, its
# submitter), its handler in worker/kinds/, named by the kind's name in code (JobKind's member name;
# a batch prediction's wire value stays "predict"). A handler reads its own kind's params only, and
# the params side of a kind (spec, params, resolution) is a leaf of the domain: it imports no
# submitter, job store, device registry or other kind, only the KindParams base they all share.
KINDS = {"train", "evaluate", "batch_predict", "export"}
KIND_LEAF_MAY_NOT = {"core.jobs", "core.devices", "core.gangs", "core.datasets", "core.kinds.submitter"}
KIND_SHARED = {"request", "params", "submitter"}  # core/kinds/*.py: what every kind shares


def _kind_leaves(kind: str) -> list[Path]:
    return [p for p in (REPO / "core" / "kinds" / kind).glob("*.py") if p.stem != "submit"]


def test_every_kind_has_its_package_and_its_handler() -> None:
    from core.schemas import JobKind

    assert {kind.name for kind in JobKind} == KINDS
    assert {p.name for p in (REPO / "core" / "kinds").iterdir() if p.is_dir() and p.name != "__pycache__"} == KINDS
    assert {p.stem for p in (REPO / "core" / "kinds").glob("*.py")} == KIND_SHARED | {"__init__"}
    assert {p.stem for p in (REPO / "worker" / "kinds").glob("*.py")} == KINDS | {"__init__"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_kind_reads_its_own_params(kind: str) -> None:
    handler = _imports(ast.parse((REPO / "worker" / "kinds" / f"{kind}.py").read_text()))
    others = [name for name in handler if name.startswith("core.kinds.") and not name.startswith(f"core.kinds.{kind}.")]
    assert others == []
    for leaf in _kind_leaves(kind):
        names = _imports(ast.parse(leaf.read_text()))
        assert [name for name in names if any(name.startswith(f"{m}.") or name == m for m in KIND_LEAF_MAY_NOT)] == []
        assert [name for name in names if name.startswith("core.kinds.") and not name.startswith(f"core.kinds.{kind}.")
                and not name.startswith("core.kinds.params.")] == []


def test_the_client_reads_params_through_the_kinds_face_only() -> None:
    """The client may read a job's params as its kind's model (the face of core/kinds: the params
    models and `params_of`), never a submitter or a resolution."""
    import core.kinds

    for path in sorted((REPO / "client").rglob("*.py")):
        for name in _imports(ast.parse(path.read_text())):
            if name.startswith("core.kinds"):
                assert name.rpartition(".")[0] == "core.kinds" and name.rpartition(".")[2] in core.kinds.__all__, (
                    f"{path.relative_to(REPO)} imports {name}")


def test_the_commands_call_the_sdk_s_public_methods_only() -> None:
    """`torchyard keys|projects|sweep...` go through the SDK's public calls (client/sdk.py and its
    bases), never its plumbing (`client._request`): what a command can do, a script using the SDK
    can do the same way, and the calls are typed once."""
    found = []
    for path in sorted((REPO / "client" / "commands").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and isinstance(node.value, ast.Name) and node.value.id == "client":
                found.append(f"{path.relative_to(REPO)}:{node.lineno} client.{node.attr}")
    assert found == []
