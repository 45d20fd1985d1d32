"""Writing a benchmark's section of docs/benchmarks.md, between its own markers."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_section(name: str, title: str, text: str, docs: Path = DOCS) -> None:
    """Replace what stands between `<!-- name:begin -->` and `<!-- name:end -->`, nothing else."""
    doc = docs.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    docs.write_text(f"{head}{begin}\n## {title}\n\n{text}{end}{tail}")
