"""What every client command shares: exit codes, the connection options and their defaults, and
the adapter that runs a handler with a client and turns an API error into one line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from client.sdk import TorchyardClient
    from core.config import Settings

EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 130
Handler = Callable[["TorchyardClient", argparse.Namespace], int]
DEFAULT_URL = "http://127.0.0.1:8000"  # client/http.DEFAULT_URL (not imported here: it loads httpx)
CONNECTION_OPTIONS = ("url", "api_key", "json")


class Command(Protocol):
    """Registers one client command: its name, handler and help, under `parent` (a group's
    subcommands) or at the top level."""

    def __call__(self, name: str, handler: Handler, help_: str,
                 parent: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser: ...


class Group(Protocol):
    """Registers a command with subcommands (`datasets upload`, `alias set`); `handler` runs when
    none is given. Returns where its subcommands go."""

    def __call__(self, name: str, handler: Handler, help_: str, description: str) -> argparse._SubParsersAction: ...


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    """--url, --api-key, --json on `parser`. Their defaults are applied when a command runs
    (`resolve_connection_options`), not here: the same options sit on the top-level parser and on
    every client command, so `torchyard --json predict ...` and `torchyard predict ... --json`
    both work, and one given before the command is not overwritten by the command's default."""
    group = parser.add_argument_group("server")
    group.add_argument("--url", default=argparse.SUPPRESS,
                       help=f"the torchyard API (env TORCHYARD_URL; default {DEFAULT_URL})")
    group.add_argument("--api-key", default=argparse.SUPPRESS, help="bearer token (env TORCHYARD_API_KEY)")
    group.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                       help="print the API's JSON instead of tables")


def connection_options() -> argparse.ArgumentParser:
    """The options as a parent parser, for every client command."""
    common = argparse.ArgumentParser(add_help=False)
    add_connection_options(common)
    return common


def resolve_connection_options(args: argparse.Namespace) -> None:
    """Fill in what was not given: the environment, else the defaults."""
    if getattr(args, "url", None) is None:
        args.url = os.environ.get("TORCHYARD_URL") or DEFAULT_URL
    if getattr(args, "api_key", None) is None:
        args.api_key = os.environ.get("TORCHYARD_API_KEY")
    if getattr(args, "json", None) is None:
        args.json = False


# The API's pointers to its own routes, as the command that shows the same thing.
_API_TO_CLI = {"GET /datasets": "`torchyard datasets`", "GET /models": "`torchyard models`",
               "GET /devices": "`torchyard devices`", "GET /aliases": "`torchyard alias list`"}


def in_cli_words(detail: str) -> str:
    """An API error as a CLI user acts on it: `see GET /datasets` becomes `torchyard datasets`."""
    import re

    for route, command in _API_TO_CLI.items():
        detail = re.sub(rf"{re.escape(route)}(?![/\w])", command, detail)
    return detail


def run_with_client(handler: Handler) -> Callable[[Settings, argparse.Namespace], int]:
    """Adapt a client handler to `app.cli`'s (settings, args) signature: one error line, an exit code."""

    def run(_: Settings, args: argparse.Namespace) -> int:
        import logging

        logging.getLogger("httpx").setLevel(logging.WARNING)  # no per-request INFO lines in a CLI
        from client.sdk import ApiError, TorchyardClient

        resolve_connection_options(args)
        try:
            with TorchyardClient(args.url, args.api_key) as client:
                return handler(client, args)
        except ApiError as exc:
            where = f" ({exc.status})" if exc.status else ""
            print(f"torchyard: error{where}: {in_cli_words(exc.detail)}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except BrokenPipeError:
            # `torchyard --json jobs | head`: the reader left; no traceback, and none again when
            # Python flushes stdout at exit (the recipe of Python's signal module docs).
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_ERROR

    return run


def detached(created: Any, created_id: str, args: argparse.Namespace) -> int:
    """`--detach`: what was queued, as JSON or just its id, and no following."""
    from client import output

    if args.json:
        output.emit_json(created)
    else:
        output.console().print(created_id)
    return EXIT_OK
