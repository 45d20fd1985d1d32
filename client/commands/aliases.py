"""Aliases: stable names for trained jobs (set, get, list, rollback, history, delete)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from client.commands.base import EXIT_OK, Command, Group

if TYPE_CHECKING:
    from client.sdk import TorchyardClient
    from core.schemas import AliasUpdate


def _alias_list(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    aliases = client.aliases()
    if args.json:
        output.emit_json({"aliases": [a.model_dump(mode="json") for a in aliases]})
        return EXIT_OK
    if not aliases:
        output.console().print("no aliases: point one at a succeeded job with `torchyard alias set NAME JOB`")
        return EXIT_OK
    output.table(output.console(), ["alias", "job", "model", "previous", "moves", "updated (UTC)", "by"],
                 [[a.name, a.job_id, a.model, a.previous_job_id or "-", str(a.moves),
                   a.updated_at.strftime("%Y-%m-%d %H:%M:%S"), a.updated_by or "-"] for a in aliases])
    return EXIT_OK


def _alias_get(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    alias = client.alias(args.name)
    if args.json:
        output.emit_json(alias)
    else:
        output.alias_report(output.console(), alias)
    return EXIT_OK


def _alias_set(client: TorchyardClient, args: argparse.Namespace) -> int:
    return _alias_moved(client.set_alias(args.name, args.job_id, args.note), args)


def _alias_rollback(client: TorchyardClient, args: argparse.Namespace) -> int:
    return _alias_moved(client.rollback_alias(args.name, args.note), args)


def _alias_moved(alias: AliasUpdate, args: argparse.Namespace) -> int:
    from client import output

    if args.json:
        output.emit_json(alias)
    else:
        output.alias_report(output.console(), alias)
    return EXIT_OK


def _alias_history(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    history = client.alias_history(args.name, args.limit)
    if args.json:
        output.emit_json(history)
        return EXIT_OK
    output.table(output.console(), ["when (UTC)", "action", "from", "to", "by", "note"],
                 [[m.at.strftime("%Y-%m-%d %H:%M:%S"), m.action, m.from_job_id or "-", m.to_job_id or "-",
                   " ".join(filter(None, [m.by, m.user_agent])) or "-", m.note or ""] for m in history.moves])
    return EXIT_OK


def _alias_delete(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    client.delete_alias(args.name, args.note)
    if args.json:
        output.emit_json({"name": args.name, "deleted": True})
    else:
        output.console().print(f"alias {args.name} deleted (its history stays)")
    return EXIT_OK


def register(command: Command, group: Group) -> None:
    alias = group("alias", _alias_list, "stable names for trained jobs: set, get, list, rollback, history, delete",
                  "Aliases: stable names clients predict with (`predict --alias NAME`).")
    command("list", _alias_list, "list the aliases and their targets", alias)
    alias_get = command("get", _alias_get, "one alias: its target, previous target, last move", alias)
    alias_get.add_argument("name")
    alias_set = command("set", _alias_set, "point NAME at a succeeded job (created or moved; the new model is "
                                           "loaded where the old one is resident first)", alias)
    alias_set.add_argument("name")
    alias_set.add_argument("job_id")
    alias_set.add_argument("--note", help="why, for the history")
    alias_rollback = command("rollback", _alias_rollback, "move NAME back to its previous target", alias)
    alias_rollback.add_argument("name")
    alias_rollback.add_argument("--note", help="why, for the history")
    alias_history = command("history", _alias_history, "every move of NAME, newest first", alias)
    alias_history.add_argument("name")
    alias_history.add_argument("--limit", type=int, default=100)
    alias_delete = command("delete", _alias_delete, "remove NAME (its history stays)", alias)
    alias_delete.add_argument("name")
    alias_delete.add_argument("--note", help="why, for the history")
