"""The command line's parsing: server commands and client commands side by side."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import build_parser
from client.commands.base import resolve_connection_options
from tests.support import REPO


def _parsed(argv: list[str]):
    args = build_parser().parse_args(argv)
    resolve_connection_options(args)
    return args


def test_connection_options_before_a_nested_command_are_kept() -> None:
    args = _parsed(["datasets", "--url", "http://gpu-box:8000", "--json", "upload", "photos"])
    assert (args.url, args.json, args.path) == ("http://gpu-box:8000", True, "photos")
    args = _parsed(["datasets", "upload", "photos", "--url", "http://other:1"])
    assert args.url == "http://other:1" and args.json is False


@pytest.mark.parametrize("argv", [
    ["--url", "http://box:1", "--api-key", "k", "--json", "predict", "--job", "j", "x.png"],
    ["predict", "--job", "j", "x.png", "--url", "http://box:1", "--api-key", "k", "--json"],
    ["--url", "http://box:1", "predict", "--api-key", "k", "--job", "j", "x.png", "--json"],
    ["--json", "--api-key", "k", "--url", "http://box:1", "alias", "set", "pets", "j"],
    ["alias", "--url", "http://box:1", "set", "pets", "j", "--json", "--api-key", "k"],
])
def test_global_options_work_before_or_after_the_command(argv: list[str]) -> None:
    args = _parsed(argv)
    assert (args.url, args.api_key, args.json) == ("http://box:1", "k", True)


def test_connection_defaults_come_from_the_environment_then_the_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHYARD_URL", raising=False)
    monkeypatch.delenv("TORCHYARD_API_KEY", raising=False)
    args = _parsed(["devices"])
    assert (args.url, args.api_key, args.json) == ("http://127.0.0.1:8000", None, False)
    monkeypatch.setenv("TORCHYARD_URL", "http://env:2")
    assert _parsed(["devices"]).url == "http://env:2"
    assert _parsed(["--url", "http://flag:3", "devices"]).url == "http://flag:3"


def test_server_commands_parse_and_refuse_client_options() -> None:
    parser = build_parser()
    assert parser.parse_args(["worker", "--device", "1"]).device == "1"
    assert parser.parse_args(["up"]).command == "up"
    refused = subprocess.run([sys.executable, "-m", "app.cli", "--url", "http://box:1", "up"], cwd=REPO,
                             capture_output=True, text=True, timeout=60, env={**os.environ})
    assert refused.returncode == 2 and "options of the client commands" in refused.stderr


def test_the_cli_is_imported_by_nothing() -> None:
    """The entry point may import every package; no module imports it back (app/server.py once did,
    for its log format)."""
    def imports_the_cli(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in ("app.cli", "app") and \
                    (node.module == "app.cli" or any(alias.name == "cli" for alias in node.names)):
                return True
            if isinstance(node, ast.Import) and any(alias.name == "app.cli" for alias in node.names):
                return True
        return False

    importers = [str(path.relative_to(REPO)) for package in ("app", "core", "client", "worker", "models")
                 for path in (REPO / package).rglob("*.py")
                 if path != REPO / "app" / "cli.py" and imports_the_cli(path)]
    assert importers == []
