"""What a server has: devices, models, datasets (list and upload)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from client.commands.base import EXIT_ERROR, EXIT_OK, Command, Group

if TYPE_CHECKING:
    from client.sdk import TorchyardClient


def _devices(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    devices = client.devices()
    if args.json:
        output.emit_json(devices)
        return EXIT_OK
    out = output.console()
    if not devices:
        out.print("no devices: start a worker (`torchyard worker --device 0|cpu`) or `torchyard up`")
        return EXIT_OK
    output.table(out, ["device", "type", "name", "status", "memory", "util", "job", "models"],
                 [[d.id, d.type, d.name, d.status, f"{output.size(d.memory_used_bytes)} / "
                   f"{output.size(d.memory_total_bytes)}",
                   "-" if d.utilization_percent is None else f"{d.utilization_percent:.0f} %", d.current_job or "-",
                   str(len(d.loaded_models))] for d in devices])
    return EXIT_OK


def _models(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    models = client.models()
    if args.json:
        output.emit_json(models)
        return EXIT_OK
    output.table(output.console(), ["model", "input", "parameters", "description"],
                 [[m.name, f"{m.input.channels}×{m.input.height}×{m.input.width}", f"{m.parameters:,}",
                   m.description] for m in models])
    return EXIT_OK


def _datasets_list(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    datasets = client.datasets()
    if args.json:
        output.emit_json(datasets)
        return EXIT_OK
    output.table(output.console(), ["dataset", "name", "kind", "classes", "images", "available"],
                 [[d["id"], d.get("name", ""), d.get("kind", ""),
                   str(len(d["classes"])) if d.get("classes") else "-", str(d.get("num_images") or "-"),
                   "yes" if d.get("available", True) else "no"] for d in datasets])
    return EXIT_OK


def _flat_folder(path: Path) -> str | None:
    """`N images` when `path` is a directory of files with no sub-folder: images without classes."""
    if not path.is_dir() or any(p.is_dir() and not p.name.startswith(".") for p in path.iterdir()):
        return None
    files = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]
    return f"{len(files)} file{'' if len(files) == 1 else 's'}" if files else None


def _datasets_upload(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    err = output.console(sys.stderr)
    flat = _flat_folder(Path(args.path)) if not args.unlabeled else None
    if flat:
        err.print(f"torchyard: error: {args.path} holds {flat} but no <class> folders: to train on them, put "
                  f"each class's images in a folder of its own; to label them with a trained model, "
                  f"`torchyard predict-folder {args.path} --job ID` (or upload them with --unlabeled)")
        return EXIT_ERROR
    if not args.json:
        err.print(f"uploading {args.path} …")
    record = client.upload_dataset(args.path, args.name, labeled=not args.unlabeled, new_version=args.new_version)
    if args.json:
        output.emit_json(record)
        return EXIT_OK
    out = output.console()
    version = f", version {record['version']}" if record.get("version", 1) > 1 else ""
    out.print(f"dataset {record['id']} ({record.get('name')}{version}): "
              f"{output.count(record.get('num_images') or 0, 'image')}, "
              f"{output.count(len(record.get('classes') or []), 'class', 'classes')}")
    for name, count in (record.get("class_counts") or {}).items():
        out.print(f"  {name}: {count}")
    for skipped in record.get("skipped") or []:
        err.print(f"  skipped {skipped.get('path')}: {skipped.get('reason')}")
    return EXIT_OK


def _datasets_delete(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    client.delete("datasets", args.dataset)
    if not args.json:
        output.console().print(f"dataset {args.dataset} deleted")
    return EXIT_OK


def register(command: Command, group: Group) -> None:
    command("devices", _devices, "the devices the workers hold: memory, utilisation, current job")
    command("models", _models, "the model architectures the server can train")

    datasets = group("datasets", _datasets_list, "list or upload datasets",
                     "List datasets, or upload an ImageFolder directory or zip.")
    command("list", _datasets_list, "list the datasets (built-in and uploaded)", datasets)
    upload = command("upload", _datasets_upload, "upload DIR (zipped here) or ZIP in ImageFolder layout "
                                                 "(<class>/<image>)", datasets)
    upload.add_argument("path", help="a directory of <class>/<image> folders, or a .zip of them")
    upload.add_argument("--name", help="a label for the dataset")
    upload.add_argument("--unlabeled", action="store_true", help="images at any depth, no class folders "
                                                                 "(for predict-folder only)")
    upload.add_argument("--new-version", action="store_true", help="the --name is taken: make this its next "
                                                                   "version (the name then means this one; the older "
                                                                   "keeps its id)")
    delete = command("delete", _datasets_delete, "delete an uploaded dataset (its files too)", datasets)
    delete.add_argument("dataset", metavar="NAME|ID", help="an id, or a name (its newest version)")
