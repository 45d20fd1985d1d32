"""The client side of `torchyard`: commands that talk to a running server over HTTP.

Only the standard library is imported at module level: `app.cli` builds its parser for every
command, a worker included, and a worker must pin its GPU before anything heavy loads. The
handlers import the httpx client when they run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from app.client import Event, TorchyardClient
    from app.core.config import Settings
    from app.core.schemas import Job

EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 130
Handler = Callable[["TorchyardClient", argparse.Namespace], int]


# ---------------------------------------------------------------------- output helpers
def _emit_json(value: Any) -> None:
    """What --json prints: the API's own JSON shape, so scripts can rely on docs/api.md."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    elif isinstance(value, list):
        value = [v.model_dump(mode="json") if hasattr(v, "model_dump") else v for v in value]
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _table(rows: list[list[str]], header: list[str], out: TextIO = sys.stdout) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        out.write("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


def _block_chars(stream: TextIO) -> tuple[str, str]:
    encoding = (getattr(stream, "encoding", None) or "").lower()
    return ("█", "░") if "utf" in encoding else ("#", ".")


class ProgressBar:
    """One line per epoch: redrawn in place on a terminal, printed once at the epoch's end otherwise
    (so logs and CI output get one readable line per epoch, not hundreds of carriage returns)."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.width = width
        self.full, self.empty = _block_chars(stream)
        self.epoch: int | None = None
        self.started = time.monotonic()
        self._drawn = False

    def update(self, epoch: int, epochs: int, step: int, steps: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.started = epoch, time.monotonic()
        if not self.tty:
            return
        fraction = step / steps if steps else 0.0
        filled = int(round(self.width * fraction))
        rate = step / max(time.monotonic() - self.started, 1e-6)
        columns = shutil.get_terminal_size((100, 20)).columns
        line = (f"epoch {epoch}/{epochs} {self.full * filled}{self.empty * (self.width - filled)} "
                f"{100 * fraction:5.1f}% {step}/{steps} steps {rate:.1f} it/s")
        self.stream.write("\r" + line[: columns - 1].ljust(min(len(line), columns - 1)))
        self.stream.flush()
        self._drawn = True

    def finish_epoch(self, summary: str) -> None:
        """Replace the bar with the epoch's summary line."""
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[2K")
        self.stream.write(summary + "\n")
        self.stream.flush()
        self._drawn = False

    def message(self, text: str) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self._drawn = False
        self.stream.write(text + "\n")
        self.stream.flush()


def _epoch_line(m: dict[str, Any], epochs: int | None) -> str:
    total = f"/{epochs}" if epochs else ""
    return (f"epoch {m['epoch']}{total}: train loss {_num(m.get('train_loss'))} "
            f"acc {_pct(m.get('train_accuracy'))} | val loss {_num(m.get('val_loss'))} "
            f"acc {_pct(m.get('val_accuracy'))} | {m.get('images_per_second', 0):.0f} img/s, "
            f"{m.get('seconds', 0):.1f} s")


def _print_job(job: Job, out: TextIO = sys.stdout) -> None:
    """A job as a person reads it: the record, the metrics table, the last epoch's per-class accuracy."""
    p = job.params
    rows = [("job", job.id), ("status", job.status.value + (f" ({job.message})" if job.message else "")),
            ("model", job.model), ("dataset", job.dataset), ("device", job.device or "-"),
            ("params", ", ".join(f"{k}={p[k]}" for k in ("epochs", "batch_size", "learning_rate", "optimizer",
                                                         "seed", "val_fraction") if k in p)),
            ("progress", f"epoch {job.progress.epoch}/{job.progress.epochs}, "
                         f"step {job.progress.step}/{job.progress.steps}"),
            ("attempts", str(job.attempts)), ("created", str(job.created_at)),
            ("finished", str(job.finished_at or "-"))]
    if job.checkpoint:
        rows.append(("checkpoint", f"{job.checkpoint.url} ({_bytes(job.checkpoint.bytes)}, "
                                   f"sha256 {job.checkpoint.sha256[:12]}…)"))
    if job.error:
        rows.append(("error", job.error))
    for key, value in rows:
        out.write(f"{key:<11}{value}\n")
    _print_metrics(job, out)


def _print_metrics(job: Job, out: TextIO = sys.stdout) -> None:
    if not job.metrics:
        return
    out.write("\n")
    _table([[str(m.epoch), _num(m.train_loss), _pct(m.train_accuracy), _num(m.val_loss), _pct(m.val_accuracy),
             f"{m.images_per_second:.0f}", f"{m.seconds:.1f}"] for m in job.metrics],
           ["epoch", "train_loss", "train_acc", "val_loss", "val_acc", "img/s", "seconds"], out)
    per_class = job.metrics[-1].per_class_accuracy
    if per_class:
        out.write("\n")
        width = max(len(name) for name in per_class)
        for name, accuracy in per_class.items():
            out.write(f"Accuracy of {name:<{width}} : {100 * accuracy:3.0f} %\n")


# ---------------------------------------------------------------------- commands
def _devices(client: TorchyardClient, args: argparse.Namespace) -> int:
    devices = client.devices()
    if args.json:
        _emit_json(devices)
        return EXIT_OK
    if not devices:
        print("no devices: start a worker (`torchyard worker --device 0|cpu`) or `torchyard up`")
        return EXIT_OK
    _table([[d.id, d.type, d.name, d.status, f"{_bytes(d.memory_used_bytes)} / {_bytes(d.memory_total_bytes)}",
             "-" if d.utilization_percent is None else f"{d.utilization_percent:.0f} %", d.current_job or "-",
             str(len(d.loaded_models))] for d in devices],
           ["device", "type", "name", "status", "memory", "util", "job", "models"])
    return EXIT_OK


def _models(client: TorchyardClient, args: argparse.Namespace) -> int:
    models = client.models()
    if args.json:
        _emit_json(models)
        return EXIT_OK
    _table([[m.name, f"{m.input.channels}×{m.input.height}×{m.input.width}", f"{m.parameters:,}", m.description]
            for m in models], ["model", "input", "parameters", "description"])
    return EXIT_OK


def _datasets_list(client: TorchyardClient, args: argparse.Namespace) -> int:
    datasets = client.datasets()
    if args.json:
        _emit_json(datasets)
        return EXIT_OK
    _table([[d["id"], d.get("name", ""), d.get("kind", ""), str(len(d["classes"])) if d.get("classes") else "-",
             str(d.get("num_images") or "-"), "yes" if d.get("available", True) else "no"] for d in datasets],
           ["dataset", "name", "kind", "classes", "images", "available"])
    return EXIT_OK


def _datasets_upload(client: TorchyardClient, args: argparse.Namespace) -> int:
    if not args.json:
        print(f"uploading {args.path} …", file=sys.stderr)
    record = client.upload_dataset(args.path, args.name)
    if args.json:
        _emit_json(record)
        return EXIT_OK
    print(f"dataset {record['id']} ({record.get('name')}): {record.get('num_images')} images, "
          f"{len(record.get('classes') or [])} classes")
    for name, count in (record.get("class_counts") or {}).items():
        print(f"  {name}: {count}")
    for skipped in record.get("skipped") or []:
        print(f"  skipped {skipped.get('path')}: {skipped.get('reason')}", file=sys.stderr)
    return EXIT_OK


def _jobs(client: TorchyardClient, args: argparse.Namespace) -> int:
    jobs = client.jobs(status=args.status, limit=args.limit)
    if args.json:
        _emit_json(jobs)
        return EXIT_OK
    _table([[j.id, j.status.value, j.model, j.dataset, f"{j.progress.epoch}/{j.params.get('epochs', '?')}",
             _pct(j.metrics[-1].val_accuracy) if j.metrics else "-", j.device or j.requested_device,
             j.created_at.strftime("%Y-%m-%d %H:%M:%S")] for j in jobs.jobs],
           ["job", "status", "model", "dataset", "epoch", "val_acc", "device", "created (UTC)"])
    return EXIT_OK


def _job(client: TorchyardClient, args: argparse.Namespace) -> int:
    if args.follow:
        return _follow_and_report(client, client.job(args.job_id), args)
    job = client.job(args.job_id)
    if args.json:
        _emit_json(job)
    else:
        _print_job(job)
    return EXIT_OK


def _cancel(client: TorchyardClient, args: argparse.Namespace) -> int:
    job = client.cancel(args.job_id)
    if args.json:
        _emit_json(job)
    else:
        print(f"job {job.id}: cancel requested (now {job.status.value})")
    return EXIT_OK


def _train(client: TorchyardClient, args: argparse.Namespace) -> int:
    job = client.submit(model=args.model, dataset=args.dataset, epochs=args.epochs, batch_size=args.batch_size,
                        learning_rate=args.lr, optimizer=args.optimizer, device=args.device, seed=args.seed,
                        val_fraction=args.val_fraction)
    print(f"job {job.id} queued: {job.model} on {job.dataset}, {job.params.get('epochs')} epochs, "
          f"device {job.requested_device}", file=sys.stderr)
    if args.detach:
        if args.json:
            _emit_json(job)
        else:
            print(job.id)
        return EXIT_OK
    return _follow_and_report(client, job, args)


def _follow_and_report(client: TorchyardClient, job: Job, args: argparse.Namespace) -> int:
    """Follow the job's events to its end; Ctrl-C asks whether to cancel (or leaves it running)."""
    try:
        _follow(client, job, quiet=args.json)
    except KeyboardInterrupt:
        return _interrupted(client, job.id, args)
    final = client.job(job.id)
    if args.json:
        _emit_json(final)
    else:
        print()
        _print_job(final)
    return EXIT_OK if final.status.value == "succeeded" else EXIT_ERROR


def _follow(client: TorchyardClient, job: Job, *, quiet: bool) -> None:
    bar = ProgressBar(open(os.devnull, "w") if quiet else sys.stderr)  # noqa: SIM115 - lives as long as the bar
    epochs = job.params.get("epochs")
    event: Event
    for event in client.events(job.id):
        data = event.data
        if event.kind == "progress":
            epochs = data.get("epochs") or epochs
            bar.update(data.get("epoch", 0), data.get("epochs", 0), data.get("step", 0), data.get("steps", 0))
        elif event.kind == "metrics":
            bar.finish_epoch(_epoch_line(data, epochs))
        elif event.kind == "status":
            status = data.get("status")
            detail = data.get("device") or data.get("reason") or data.get("error") or ""
            bar.message(f"{status}{': ' + detail if detail else ''}")
        elif event.kind == "cancel_requested":
            bar.message("cancel requested")


def _interrupted(client: TorchyardClient, job_id: str, args: argparse.Namespace) -> int:
    sys.stderr.write("\n")
    cancel = args.cancel_on_interrupt
    if not cancel and sys.stdin is not None and sys.stdin.isatty():
        try:
            answer = input(f"Cancel job {job_id}? [y/N] ")
        except (EOFError, KeyboardInterrupt):
            answer = ""
        cancel = answer.strip().lower() in ("y", "yes")
    if cancel:
        job = client.cancel(job_id)
        print(f"job {job_id}: cancel requested (now {job.status.value})", file=sys.stderr)
    else:
        print(f"job {job_id} keeps running; follow it with `torchyard job {job_id} --follow`, "
              f"stop it with `torchyard cancel {job_id}`", file=sys.stderr)
    if args.json:
        _emit_json({"id": job_id, "interrupted": True, "cancel_requested": bool(cancel)})
    return EXIT_INTERRUPTED


def _predict(client: TorchyardClient, args: argparse.Namespace) -> int:
    answer = client.predict(args.job, args.images, top_k=args.top_k)
    if args.json:
        _emit_json(answer)
        return EXIT_OK
    full, empty = _block_chars(sys.stdout)
    for result in answer.results:
        print(f"{result.filename}  ({answer.model}, job {answer.job_id}, on {answer.device})")
        width = max((len(p.label) for p in result.predictions), default=0)
        for p in result.predictions:
            filled = int(round(20 * p.probability))
            print(f"  {p.label:<{width}}  {full * filled}{empty * (20 - filled)}  {100 * p.probability:5.1f} %")
    return EXIT_OK


def _checkpoint(client: TorchyardClient, args: argparse.Namespace) -> int:
    target = args.output or f"{args.job_id}.pt"
    path, sha256 = client.download_checkpoint(args.job_id, target)
    if args.json:
        _emit_json({"job_id": args.job_id, "path": str(path), "sha256": sha256, "bytes": path.stat().st_size})
    else:
        print(f"saved {path} ({_bytes(path.stat().st_size)}, sha256 {sha256})")
    return EXIT_OK


# ---------------------------------------------------------------------- wiring
def _run(handler: Handler) -> Callable[[Settings, argparse.Namespace], int]:
    """Adapt a client handler to `app.cli`'s (settings, args) signature: one error line, an exit code."""

    def run(_: Settings, args: argparse.Namespace) -> int:
        import logging

        logging.getLogger("httpx").setLevel(logging.WARNING)  # no per-request INFO lines in a CLI
        from app.client import ApiError, TorchyardClient

        try:
            with TorchyardClient(args.url, args.api_key) as client:
                return handler(client, args)
        except ApiError as exc:
            where = f" ({exc.status})" if exc.status else ""
            print(f"torchyard: error{where}: {exc.detail}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED

    return run


def _connection_options(nested: bool = False) -> argparse.ArgumentParser:
    """--url, --api-key, --json. A nested command (`datasets upload`) takes them too, with no
    defaults of its own, so `torchyard datasets --url X upload DIR` keeps the X given before it."""
    def default(value: object) -> object:
        return argparse.SUPPRESS if nested else value

    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("server")
    group.add_argument("--url", default=default(os.environ.get("TORCHYARD_URL") or "http://127.0.0.1:8000"),
                       help="the torchyard API (env TORCHYARD_URL; default http://127.0.0.1:8000)")
    group.add_argument("--api-key", default=default(os.environ.get("TORCHYARD_API_KEY")),
                       help="bearer token (env TORCHYARD_API_KEY)")
    group.add_argument("--json", action="store_true", default=default(False),
                       help="print the API's JSON instead of tables")
    return common


def add_client_commands(sub: argparse._SubParsersAction) -> None:
    """Register devices, models, datasets, train, jobs, job, cancel, predict and checkpoint."""
    common, nested_common = _connection_options(), _connection_options(nested=True)

    def command(name: str, handler: Handler, help_: str, parent: argparse._SubParsersAction = sub):
        options = common if parent is sub else nested_common
        parser = parent.add_parser(name, parents=[options], help=help_, description=help_)
        parser.set_defaults(run=_run(handler))
        return parser

    command("devices", _devices, "the devices the workers hold: memory, utilisation, current job")
    command("models", _models, "the model architectures the server can train")

    datasets = sub.add_parser("datasets", parents=[common], help="list or upload datasets",
                              description="List datasets, or upload an ImageFolder directory or zip.")
    datasets.set_defaults(run=_run(_datasets_list))
    datasets_sub = datasets.add_subparsers(dest="datasets_command")
    command("list", _datasets_list, "list the datasets (built-in and uploaded)", datasets_sub)
    upload = command("upload", _datasets_upload, "upload DIR (zipped here) or ZIP in ImageFolder layout "
                                                 "(<class>/<image>)", datasets_sub)
    upload.add_argument("path", help="a directory of <class>/<image> folders, or a .zip of them")
    upload.add_argument("--name", help="a label for the dataset")

    train = command("train", _train, "start a training job and follow it to the end")
    train.add_argument("--model", required=True, help="architecture, e.g. cifar_net (see `torchyard models`)")
    train.add_argument("--dataset", required=True, help="dataset id, e.g. fake (see `torchyard datasets`)")
    train.add_argument("--epochs", type=int)
    train.add_argument("--batch-size", type=int)
    train.add_argument("--lr", type=float, help="learning rate (default: per optimizer)")
    train.add_argument("--optimizer", choices=["sgd", "adam", "adamw"])
    train.add_argument("--device", help="auto (default), cuda, cpu or a device id from `torchyard devices`")
    train.add_argument("--seed", type=int)
    train.add_argument("--val-fraction", type=float)
    train.add_argument("--detach", action="store_true", help="print the job id and return at once")
    train.add_argument("--cancel-on-interrupt", action="store_true",
                       help="on Ctrl-C cancel the job without asking (without it, a non-interactive run "
                            "leaves the job running)")

    jobs = command("jobs", _jobs, "list jobs, newest first")
    jobs.add_argument("--status", choices=["queued", "running", "succeeded", "failed", "cancelled"])
    jobs.add_argument("--limit", type=int, default=20)

    job = command("job", _job, "one job: status, parameters, metrics, per-class accuracy")
    job.add_argument("job_id")
    job.add_argument("--follow", "-f", action="store_true", help="follow its progress to the end")
    job.add_argument("--cancel-on-interrupt", action="store_true", help="with --follow: Ctrl-C cancels the job")

    cancel = command("cancel", _cancel, "cancel a queued or running job")
    cancel.add_argument("job_id")

    predict = command("predict", _predict, "classify images with a trained job's model")
    predict.add_argument("--job", required=True, help="a succeeded job's id")
    predict.add_argument("--top-k", type=int, default=5)
    predict.add_argument("images", nargs="+", help="image files (PNG, JPEG, WebP, BMP, GIF)")

    checkpoint = command("checkpoint", _checkpoint, "download a job's weights (checked against its sha256)")
    checkpoint.add_argument("job_id")
    checkpoint.add_argument("-o", "--output", help="file to write (default: <job id>.pt)")
