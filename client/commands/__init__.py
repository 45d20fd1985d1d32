"""The client side of `torchyard`: commands that talk to a running server over HTTP.

One module per concern (catalog: devices, models, datasets; jobs; predict; aliases; files:
checkpoint and export), each registering its own commands; follow.py follows a job to its end,
base.py holds what they share. Only the standard library is imported at module level: `app.cli`
builds its parser for every command, a worker included, and a worker must pin its GPU before
anything heavy loads. The handlers import the SDK (client/sdk.py, httpx) and the renderers
(client/output.py, rich) when they run.
"""

from __future__ import annotations

import argparse

from client.commands import aliases, catalog, files, jobs, keys, predict, projects, sweeps
from client.commands.base import (
    CONNECTION_OPTIONS,
    Handler,
    add_connection_options,
    connection_options,
    run_with_client,
)

__all__ = ["CONNECTION_OPTIONS", "add_client_commands", "add_connection_options"]


def add_client_commands(sub: argparse._SubParsersAction) -> None:
    """Register devices, models, datasets, train, evaluate, jobs, job, cancel, predict, predict-folder,
    alias, export, checkpoint, sweep, sweeps, keys and projects."""
    common = connection_options()

    def command(name: str, handler: Handler, help_: str,
                parent: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
        parser = (parent or sub).add_parser(name, parents=[common], help=help_, description=help_)
        parser.set_defaults(run=run_with_client(handler))
        return parser

    def group(name: str, handler: Handler, help_: str, description: str) -> argparse._SubParsersAction:
        parser = sub.add_parser(name, parents=[common], help=help_, description=description)
        parser.set_defaults(run=run_with_client(handler))
        return parser.add_subparsers(dest=f"{name}_command")

    catalog.register(command, group)
    jobs.register(command)
    predict.register(command)
    aliases.register(command, group)
    files.register(command)
    sweeps.register(command)
    keys.register(command, group)
    projects.register(command, group)
