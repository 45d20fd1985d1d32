"""`torchyard up | api | worker`. Imports stay light here: a worker must pin its device
before anything imports torch."""

from __future__ import annotations

import argparse
import logging
import sys

from app.core.config import Settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _up(settings: Settings, _: argparse.Namespace) -> int:
    from app.supervisor import Supervisor

    return Supervisor(settings).run()


def _api(settings: Settings, _: argparse.Namespace) -> int:
    import uvicorn

    from app.main import create_app

    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=5)
    return 0


def _worker(settings: Settings, args: argparse.Namespace) -> int:
    from app.core.errors import DeviceInUse
    from worker.device import DeviceChoice, PinningError, pin_process, resolve_worker_device

    try:
        choice = DeviceChoice.parse(args.device)
        pin_process(choice)  # before torch is imported below
        device = resolve_worker_device(choice, settings.node_name, settings.host_gpu_index)
        from worker.runtime import run_worker

        return run_worker(settings, device)
    except (PinningError, DeviceInUse) as exc:
        logging.getLogger("torchyard.worker").error("%s", exc)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchyard", description="Train and serve PyTorch image classifiers.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="the embedded stack: Redis, the API and one worker per device").set_defaults(run=_up)
    sub.add_parser("api", help="the HTTP API alone (uvicorn)").set_defaults(run=_api)
    worker = sub.add_parser("worker", help="one worker pinned to one device")
    worker.add_argument("--device", required=True, help="GPU index (0, 1, ...) or 'cpu'")
    worker.set_defaults(run=_worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    return args.run(Settings(), args)


if __name__ == "__main__":
    sys.exit(main())
