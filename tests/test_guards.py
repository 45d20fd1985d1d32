"""Three guards beside tests/test_layers.py, on the code as it is. Every module of ours is at most 400
lines: past that a module holds more than one concern, and is split by concern, not cut. No import
cycle among the product's modules, where an import under `if TYPE_CHECKING:` and one inside a
function count as much as any: each still ties two modules together, so that neither can be read,
tested or moved without the other. A cycle is a strongly connected component (Tarjan's) of the
graph of every import statement between the product's modules. And each test module with a keyed
API of its own (tests/e2e/conftest.KEYED_API_DBS) has a Redis database no other test names, since
each flushes its database at start and end."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 400
SIZED = ("app", "bench", "client", "core", "harness", "models", "scripts", "tests", "worker")
PRODUCT = ("app", "client", "core", "models", "worker")

# No cycle is allowed. A cycle that must be lived with for a while is listed here by its modules, with
# the reason; one listed that is gone fails too, so the set never outlives its cycles.
ALLOWED_CYCLES: set[frozenset[str]] = set()


def _python_files(root: Path, tops: tuple[str, ...]) -> Iterator[Path]:
    for top in tops:
        yield from (path for path in sorted((root / top).rglob("*.py")) if "__pycache__" not in path.parts)


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _imported(module: str, is_package: bool, tree: ast.AST) -> set[str]:
    """Every module name an import statement anywhere in `tree` may load: `import a.b`, and for
    `from a import b` both `a` and `a.b` (b may be a module); relative imports resolved."""
    names: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):  # every depth: under TYPE_CHECKING, inside functions
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph(tops: tuple[str, ...] = PRODUCT, root: Path = REPO) -> dict[str, set[str]]:
    """Module → the modules of `tops` it imports (itself left out)."""
    files = {_module_name(path, root): path for path in _python_files(root, tops)}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        imported = _imported(module, path.name == "__init__.py", ast.parse(path.read_text()))
        graph[module] = {name for name in imported if name in files and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.add(frozenset(component))
    return found


def test_every_module_is_at_most_400_lines() -> None:
    long = {str(path.relative_to(REPO)): n for path in _python_files(REPO, SIZED)
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_import_cycle_among_the_products_modules_but_the_allowed_ones() -> None:
    new = cycles(import_graph()) - ALLOWED_CYCLES
    assert new == set(), "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in new)


def test_every_allowed_cycle_still_exists() -> None:
    """An allowance whose cycle is gone is taken out, so it cannot cover a cycle that comes back."""
    assert ALLOWED_CYCLES - cycles(import_graph()) == set()


def test_the_guard_sees_cycles_through_type_checking_and_function_imports(tmp_path: Path) -> None:
    """The two hidden kinds of import the layers test leaves aside (it checks what runs) make a
    cycle here; a relative import is resolved; a module importing only what imports nothing does not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "runner.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.member import Member\n")
    (package / "member.py").write_text("def join():\n    from pkg import runner\n    return runner\n")
    (package / "face.py").write_text("from .leaf import x\n")
    (package / "leaf.py").write_text("x = 1\n")
    graph = import_graph(("pkg",), tmp_path)
    assert graph["pkg.face"] == {"pkg.leaf"}
    assert cycles(graph) == {frozenset({"pkg.runner", "pkg.member"})}


def _databases_named(text: str) -> set[int]:
    """The Redis database numbers a test module names: `with_db(url, 15)`, `DB = 12` and `with_db(url,
    DB - 1)`, TEST_DB and `TEST_DB + 1` (tests/support.py's)."""
    import re

    constants = {"TEST_DB": 13, **{m[0]: int(m[1]) for m in re.findall(r"^(DB) = (\d+)", text, re.M)}}
    named = {int(n) for n in re.findall(r"with_db\([^,()]+,\s*(\d+)\)", text)}
    for name, sign, offset in re.findall(r"\b(TEST_DB|DB)\b\s*(?:([+-])\s*(\d+))?", text):
        if name in constants:
            named.add(constants[name] + (int(offset) if sign == "+" else -int(offset) if sign == "-" else 0))
    return named


def test_each_keyed_api_has_a_redis_database_of_its_own() -> None:
    from tests.e2e.conftest import KEYED_API_DBS

    assert len(set(KEYED_API_DBS.values())) == len(KEYED_API_DBS)
    for path in _python_files(REPO, ("tests",)):
        if path.stem in KEYED_API_DBS or (path.name == "conftest.py" and path.parent.name == "e2e"):
            continue
        shared = _databases_named(path.read_text()) & set(KEYED_API_DBS.values())
        assert not shared, f"{path.relative_to(REPO)} names Redis database(s) {shared} of a keyed API's module"
