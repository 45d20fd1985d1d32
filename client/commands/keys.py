"""API keys: `torchyard keys create|list|revoke` (an admin's key; docs/security.md), through the
SDK's calls (client/teams.py), typed with the contract's models (core/access/models.py)."""

from __future__ import annotations

import argparse
from datetime import datetime
from typing import TYPE_CHECKING

from client.commands.base import EXIT_OK, Command, Group

if TYPE_CHECKING:
    from client.sdk import TorchyardClient

ROLES = ("admin", "trainer", "predictor", "viewer")  # core/access/roles.Role, as the API spells them


def _keys_list(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    keys = client.api_keys()
    if args.json:
        output.emit_json({"keys": [k.model_dump(mode="json") for k in keys]})
        return EXIT_OK
    if not keys:
        output.console().print("no keys yet: create one with `torchyard keys create --name NAME --role ROLE`")
        return EXIT_OK
    output.table(output.console(), ["id", "name", "role", "project", "created (UTC)", "expires (UTC)", "state"],
                 [[k.id, k.name, k.role.value, k.project, _when(k.created_at), _when(k.expires_at),
                   "active" if k.active else ("revoked" if k.revoked_at else "expired")] for k in keys])
    return EXIT_OK


def _when(at: datetime | None) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S") if at else "-"


def _keys_create(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    created = client.create_key(args.name, args.role, args.project, args.expires_in_days)
    if args.json:
        output.emit_json(created.model_dump(mode="json"))
        return EXIT_OK
    out = output.console()
    out.print(f"key {created.id} ({created.name}): role {created.role.value} in project {created.project}"
              + (f", expires {_when(created.expires_at)} UTC" if created.expires_at else ""))
    out.print("its secret, shown this once (store it now; the server keeps only a hash):")
    print(created.secret)  # alone on its line, unstyled: for a script to read
    return EXIT_OK


def _keys_revoke(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    client.revoke_key(args.key_id)
    if args.json:
        output.emit_json({"id": args.key_id, "revoked": True})
    else:
        output.console().print(f"key {args.key_id} revoked: every API process refuses it within a second")
    return EXIT_OK


def register(command: Command, group: Group) -> None:
    keys = group("keys", _keys_list, "API keys with roles (admin): create, list, revoke",
                 "API keys: each has a role (admin, trainer, predictor, viewer) in a project; docs/security.md.")
    command("list", _keys_list, "every key: name, role, project, expiry, state (never a secret)", keys)
    create = command("create", _keys_create, "a new key; its secret is printed once", keys)
    create.add_argument("--name", required=True, help="who or what holds it (ci-bot)")
    create.add_argument("--role", required=True, choices=ROLES)
    create.add_argument("--project", default="default", help="the project it acts in (default: default)")
    create.add_argument("--expires-in-days", type=float, default=None, help="it stops working after this long")
    revoke = command("revoke", _keys_revoke, "revoke KEY_ID: refused everywhere within a second", keys)
    revoke.add_argument("key_id")
