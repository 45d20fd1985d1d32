"""A trained job's files: its checkpoint, and its model exported as TorchScript or ONNX."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from client.commands.base import EXIT_OK, Command

if TYPE_CHECKING:
    from client.sdk import TorchyardClient


def _checkpoint(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    target = args.output or f"{args.job_id}.pt"
    path, sha256 = client.download_checkpoint(args.job_id, target)
    if args.json:
        output.emit_json({"job_id": args.job_id, "path": str(path), "sha256": sha256, "bytes": path.stat().st_size})
    else:
        output.console().print(f"saved {path} ({output.size(path.stat().st_size)}, sha256 {sha256})")
    return EXIT_OK


def _export(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    suffix = ".onnx" if args.format == "onnx" else ".torchscript.pt"
    target = args.output or f"{args.job_id}{suffix}"
    if not args.json:
        output.console(sys.stderr).print(f"exporting job {args.job_id} as {args.format} (built and checked on a "
                                         "worker) …")
    path, sha256 = client.export(args.job_id, args.format, target, timeout=args.timeout, retry=args.retry)
    if args.json:
        output.emit_json({"job_id": args.job_id, "format": args.format, "path": str(path), "sha256": sha256,
                          "bytes": path.stat().st_size})
    else:
        output.console().print(f"saved {path} ({output.size(path.stat().st_size)}, sha256 {sha256})")
    return EXIT_OK


def register(command: Command) -> None:
    export = command("export", _export, "download a job's model as TorchScript or ONNX (runs without torchyard)")
    export.add_argument("job_id")
    export.add_argument("--format", choices=["torchscript", "onnx"], required=True)
    export.add_argument("-o", "--output", help="file to write (default: <job id>.onnx or <job id>.torchscript.pt)")
    export.add_argument("--timeout", type=float, default=600, help="seconds to wait while a worker builds it")
    export.add_argument("--retry", action="store_true", help="build it again after a failed export")

    checkpoint = command("checkpoint", _checkpoint, "download a job's weights (checked against its sha256)")
    checkpoint.add_argument("job_id")
    checkpoint.add_argument("-o", "--output", help="file to write (default: <job id>.pt)")
