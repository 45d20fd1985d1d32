"""The mutation pass (`make mutation`): break each critical guard, one line at a time, and check that
the tests named for it fail, saying what broke.

The guards are listed in scripts/mutation_guards.py. The pass copies the working tree (tracked
files and untracked ones git does not ignore) into a temporary directory, never touching the
checkout; runs every named test once on the copy as it is (they must pass, or a "caught" would
mean nothing); then, for each guard, writes its mutated line into the copy, runs its tests, and
puts the line back. A guard is

- caught: its tests failed and their output holds the guard's `says` (the assertion that names
  the broken behaviour);
- caught, wrong reason: they failed, but not with that assertion (a decode error, a timeout);
- survived: they passed with the guard broken.

Bytecode is neither written nor read (PYTHONDONTWRITEBYTECODE, and the copy has none), so a line
changed within the same second as its cached bytecode can never be run stale. The processes the
tests start (API, workers) run from the copy too: they are started from its root.

    python scripts/mutation.py                     # every guard; exit 1 unless all are caught
    python scripts/mutation.py --only "zip-slip"   # guards whose name holds any of these words
    python scripts/mutation.py --repeat 3          # caught only if caught in each of 3 runs
    python scripts/mutation.py --write-docs        # also replace the table in docs/reliability.md
    python scripts/mutation.py --check             # only: is every entry's line and test still there?
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from mutation_guards import GUARDS, Guard

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "reliability.md"
BEGIN, END = "<!-- mutation-pass:begin -->", "<!-- mutation-pass:end -->"


@dataclass
class Outcome:
    guard: Guard
    verdict: str  # caught | caught, wrong reason | survived | timed out | not applied
    seconds: float
    detail: str = ""


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked-but-not-ignored files), and the venv."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if not source.is_file() or source.is_symlink():
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    venv = REPO / ".venv"
    if venv.exists():
        (dest / ".venv").symlink_to(venv.resolve())


def locate(text: str, guard: Guard) -> int:
    """The index of the guard's line in `text`'s lines; refuses an entry whose line is not there
    exactly as listed (the code moved on: the entry must follow it)."""
    lines = text.splitlines()
    found = [i for i, line in enumerate(lines) if line.strip() == guard.original.strip()]
    if len(found) <= guard.nth:
        raise LookupError(f"{guard.path}: line {guard.original!r} found {len(found)} time(s), "
                          f"entry wants occurrence {guard.nth}")
    return found[guard.nth]


def mutate(text: str, guard: Guard) -> str:
    lines = text.splitlines(keepends=True)
    index = locate(text, guard)
    line = lines[index]
    indent = line[:len(line) - len(line.lstrip())]
    ending = line[len(line.rstrip("\r\n")):]
    lines[index] = indent + guard.mutated.strip() + ending
    return "".join(lines)


def run_tests(root: Path, tests: list[str], timeout_s: float) -> tuple[int | None, str, float]:
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    python = root / ".venv" / "bin" / "python"
    command = [str(python if python.exists() else sys.executable), "-m", "pytest", "-x", "-q", "-p",
               "no:cacheprovider", "--durations=0", "--durations-min=999", *tests]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s,
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out, time.monotonic() - started
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def failure_lines(output: str) -> list[str]:
    """pytest's lines that say why a test failed: the failing statement (`>`) and the error (`E`),
    not the source shown around them."""
    return [line.strip() for line in output.splitlines() if line.startswith((">", "E "))]


def failure_line(output: str, says: str) -> str:
    """The failure line holding `says`, else the first error line."""
    lines = failure_lines(output)
    return next((line for line in lines if says in line),
                next((line for line in lines if line.startswith("E ")), "(no failure line)"))[:160]


def judge(guard: Guard, root: Path, timeout_s: float, repeat: int = 1) -> Outcome:
    """The guard broken, its tests run `repeat` times: caught only if every run caught it."""
    path = root / guard.path
    original = path.read_text()
    try:
        path.write_text(mutate(original, guard))
    except LookupError as exc:
        return Outcome(guard, "not applied", 0.0, str(exc))
    total = 0.0
    try:
        for run in range(repeat):
            code, output, seconds = run_tests(root, list(guard.tests), timeout_s)
            total += seconds
            runs = f" (run {run + 1} of {repeat})" if repeat > 1 else ""
            if code is None:
                return Outcome(guard, "timed out", total, f"over {timeout_s:.0f} s{runs}")
            if code == 0:
                return Outcome(guard, "survived", total, f"every named test passed{runs}")
            if not any(guard.says in line for line in failure_lines(output)):
                return Outcome(guard, "caught, wrong reason", total, failure_line(output, guard.says) + runs)
    finally:
        path.write_text(original)
    return Outcome(guard, "caught", total, failure_line(output, guard.says))


def table(outcomes: list[Outcome]) -> str:
    rows = ["| Guard | Line broken | Tests | Result | s |", "|---|---|---|---|---|"]
    for o in outcomes:
        tests = ", ".join(f"`{t.replace('tests/', '', 1)}`" for t in o.guard.tests)
        line = f"`{o.guard.path}`: `{o.guard.original.strip()}` → `{o.guard.mutated.strip()}`".replace("|", "\\|")
        result = o.verdict if o.verdict == "caught" else f"**{o.verdict}**: {o.detail}".replace("|", "\\|")
        rows.append(f"| {o.guard.name} | {line} | {tests} | {result} | {o.seconds:.0f} |")
    return "\n".join(rows)


def write_docs(outcomes: list[Outcome], header: str) -> None:
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC} has no {BEGIN} … {END} section to replace")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{header}\n\n{table(outcomes)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[], help="guards whose name holds any of these words")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for one guard's tests")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each guard's tests; caught only if caught each time")
    parser.add_argument("--skip-baseline", action="store_true",
                        help="do not run the tests on the unmutated copy first (they were just run)")
    parser.add_argument("--write-docs", action="store_true", help="replace the table in docs/reliability.md")
    parser.add_argument("--list", action="store_true", help="list the guards and exit")
    parser.add_argument("--check", action="store_true",
                        help="only check that every entry's line and tests are in the tree (exit 2 if not)")
    args = parser.parse_args(argv)
    guards = [g for g in GUARDS if not args.only or any(word.lower() in g.name.lower() for word in args.only)]
    if args.list:
        for g in guards:
            print(f"{g.group:12} {g.name}: {g.path}")
        return 0
    if args.check:
        missing = [f"{g.name}: {exc}" for g in guards for exc in _lookup_error(REPO, g)]
        print("\n".join(missing) or f"every one of the {len(guards)} guards' lines and tests is where its entry says")
        return 2 if missing else 0
    with tempfile.TemporaryDirectory(prefix="torchyard-mutation-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        missing = [f"{g.name}: {exc}" for g in guards for exc in _lookup_error(root, g)]
        if missing:
            print("entries that no longer match the code:\n  " + "\n  ".join(missing), file=sys.stderr)
            return 2
        if not args.skip_baseline:
            tests = sorted({t for g in guards for t in g.tests})
            print(f"baseline: {len(tests)} test targets on the unmutated copy …", flush=True)
            code, output, seconds = run_tests(root, tests, args.timeout * 2)
            if code != 0:
                print(output[-4000:], file=sys.stderr)
                print(f"baseline failed after {seconds:.0f} s: fix the tests before judging mutations",
                      file=sys.stderr)
                return 2
            print(f"baseline passed in {seconds:.0f} s", flush=True)
        outcomes = []
        for guard in guards:
            outcome = judge(guard, root, args.timeout, args.repeat)
            outcomes.append(outcome)
            print(f"{outcome.verdict:22} {outcome.seconds:5.0f} s  {guard.name}  ({outcome.detail})", flush=True)
    caught = sum(o.verdict == "caught" for o in outcomes)
    load = os.getloadavg()
    header = (f"Last run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.node() or 'this host'} "
              f"({os.cpu_count()} cores, load average at the end {load[0]:.1f}): {caught} of {len(outcomes)} "
              f"guards caught for the right reason" + (f", each in {args.repeat} runs." if args.repeat > 1 else "."))
    print(header)
    print(table(outcomes))
    if args.write_docs:
        write_docs(outcomes, header)
    return 0 if caught == len(outcomes) else 1


def _lookup_error(root: Path, guard: Guard) -> list[str]:
    """What of the entry is not in the tree at `root`: its line (exactly, at its occurrence), a
    test file it names, or a test function in it."""
    errors = []
    try:
        locate((root / guard.path).read_text(), guard)
    except (LookupError, FileNotFoundError) as exc:
        errors.append(str(exc))
    for test in guard.tests:
        path, _, name = test.partition("::")
        if not (root / path).is_file():
            errors.append(f"no test file {path}")
        elif name and f"def {name.split('[')[0]}(" not in (root / path).read_text():
            errors.append(f"no test {name} in {path}")
    return errors


if __name__ == "__main__":
    sys.exit(main())
