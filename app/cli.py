"""The `torchyard` command, the entry point of every process: `up | api | worker`, plus the client
commands of client/commands/. It may import every package; nothing imports it. Imports stay light
here: a worker must pin its device before anything imports torch."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from app.process import EXIT_CONFIGURATION_ERROR
from core.config import Settings
from core.logs import configure_logging

SERVER_COMMANDS = ("up", "api", "worker")


def _refuse_unsafe_bind(settings: Settings) -> bool:
    """Safe by default (docs/security.md): no serving without a key beyond this host unless told to."""
    from app.server import unsafe_bind_refusal, warn_if_open

    refusal = unsafe_bind_refusal(settings)
    if refusal:
        logging.getLogger("torchyard.api").error("%s", refusal)
        return True
    warn_if_open(settings)
    return False


def _up(settings: Settings, _: argparse.Namespace) -> int:
    from app.supervisor import Supervisor

    if _refuse_unsafe_bind(settings):
        return 2
    return Supervisor(settings).run()


def _api(settings: Settings, _: argparse.Namespace) -> int:
    if _refuse_unsafe_bind(settings):  # before the heavy imports: a refusal answers at once
        return 2
    from app.server import serve

    return serve(settings)


def _worker(settings: Settings, args: argparse.Namespace) -> int:
    from core.errors import DeviceInUse
    from worker.device.pinning import DeviceChoice, PinningError, exec_pinned, is_pinned, resolve_worker_device

    # No OpenMP wait policy is set: OpenMP threads that sleep between operators (PASSIVE) cost a CPU
    # training loop about a third of its speed (docs/benchmarks.md). libgomp's spin is capped instead
    # (worker/device/pinning.openmp_environment), unless the operator set GOMP_SPINCOUNT or OMP_WAIT_POLICY.
    try:
        choice = DeviceChoice.parse(args.device)
        if not is_pinned(args.device, os.environ):
            # Same pid, a fresh interpreter whose environment starts pinned: CUDA_VISIBLE_DEVICES and
            # CUDA_DEVICE_ORDER are in place before anything can import torch. Does not return.
            exec_pinned(args.device, choice)
        device = resolve_worker_device(choice, settings.node_name, settings.host_gpu_index)
        from app.process import prefer_as_oom_victim

        prefer_as_oom_victim(settings.worker_oom_score_adj)  # a worker, never Redis, when memory runs out
        from worker.runtime.main import run_worker

        return run_worker(settings, device)
    except (PinningError, DeviceInUse) as exc:
        logging.getLogger("torchyard.worker").error("%s", exc)
        return 2


def build_parser() -> argparse.ArgumentParser:
    from client.commands import add_client_commands, add_connection_options  # stdlib only at import

    parser = argparse.ArgumentParser(prog="torchyard", description="Train and serve PyTorch image classifiers.")
    add_connection_options(parser)  # before the command, or after it (each client command takes them too)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="the embedded stack: Redis, the API and one worker per device").set_defaults(run=_up)
    sub.add_parser("api", help="the HTTP API alone (uvicorn)").set_defaults(run=_api)
    worker = sub.add_parser("worker", help="one worker pinned to one device")
    worker.add_argument("--device", required=True, help="GPU index (0, 1, ...), GPU-/MIG- UUID, or 'cpu'")
    worker.set_defaults(run=_worker)
    add_client_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from client.commands import CONNECTION_OPTIONS

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in SERVER_COMMANDS and any(hasattr(args, name) for name in CONNECTION_OPTIONS):
        parser.error(f"--url, --api-key and --json are options of the client commands, not of `{args.command}` "
                     f"(the server's own settings are TORCHYARD_* variables)")
    configure_logging()
    try:
        settings = Settings()
    except ValueError as exc:  # pydantic's ValidationError: one clear message, not a traceback
        logging.getLogger("torchyard").error("invalid settings: %s", exc)
        return EXIT_CONFIGURATION_ERROR
    return args.run(settings, args)


if __name__ == "__main__":
    sys.exit(main())
