"""The client side of `torchyard`: commands that talk to a running server over HTTP.

Only the standard library is imported at module level: `app.cli` builds its parser for every
command, a worker included, and a worker must pin its GPU before anything heavy loads. The
handlers import the SDK (client/sdk.py, httpx) and the renderers (client/output.py, rich) when
they run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from client.sdk import TorchyardClient
    from core.config import Settings
    from core.schemas import AliasUpdate, Job

EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 130
Handler = Callable[["TorchyardClient", argparse.Namespace], int]


# ---------------------------------------------------------------------- commands
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


def _datasets_upload(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    err = output.console(sys.stderr)
    if not args.json:
        err.print(f"uploading {args.path} …")
    record = client.upload_dataset(args.path, args.name, labeled=not args.unlabeled)
    if args.json:
        output.emit_json(record)
        return EXIT_OK
    out = output.console()
    out.print(f"dataset {record['id']} ({record.get('name')}): {record.get('num_images')} images, "
              f"{len(record.get('classes') or [])} classes")
    for name, count in (record.get("class_counts") or {}).items():
        out.print(f"  {name}: {count}")
    for skipped in record.get("skipped") or []:
        err.print(f"  skipped {skipped.get('path')}: {skipped.get('reason')}")
    return EXIT_OK


def _jobs(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    jobs = client.jobs(status=args.status, limit=args.limit)
    if args.json:
        output.emit_json(jobs)
        return EXIT_OK
    output.table(output.console(), ["job", "kind", "status", "model", "dataset", "epoch", "val_acc", "device",
                                    "created (UTC)"],
                 [[j.id, j.kind.value, j.status.value, j.model, j.dataset_name or j.dataset,
                   f"{j.progress.epoch}/{j.params.get('epochs', '?')}" if j.kind.value == "train" else "-",
                   output.pct(output.job_accuracy(j)), j.device or j.requested_device,
                   j.created_at.strftime("%Y-%m-%d %H:%M:%S")] for j in jobs.jobs])
    return EXIT_OK


def _job(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    if args.follow:
        return _follow_and_report(client, client.job(args.job_id), args)
    job = client.job(args.job_id)
    if args.json:
        output.emit_json(job)
    else:
        output.job_report(output.console(), job)
    return EXIT_OK


def _cancel(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    job = client.cancel(args.job_id)
    if args.json:
        output.emit_json(job)
    else:
        output.console().print(f"job {job.id}: cancel requested (now {job.status.value})")
    return EXIT_OK


def _train(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    job = client.submit(model=args.model, dataset=args.dataset, epochs=args.epochs, batch_size=args.batch_size,
                        learning_rate=args.lr, optimizer=args.optimizer, device=args.device, seed=args.seed,
                        val_fraction=args.val_fraction, image_size=args.image_size, augment=args.augment,
                        schedule=args.schedule, warmup_fraction=args.warmup, weight_decay=args.weight_decay,
                        label_smoothing=args.label_smoothing, patience=args.patience, monitor=args.monitor,
                        keep=args.keep, init_from=args.init_from, pretrained=args.pretrained or None)
    output.console(sys.stderr).print(f"job {job.id} queued: {job.model} on {job.dataset}, "
                                     f"{job.params.get('epochs')} epochs, device {job.requested_device}")
    if args.detach:
        return _detached(job, job.id, args)
    return _follow_and_report(client, job, args)


def _evaluate(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    evaluation = client.evaluate(args.job_id, args.dataset, device=args.device, batch_size=args.batch_size)
    err = output.console(sys.stderr)
    err.print(f"evaluation {evaluation.id} queued: job {args.job_id} on {evaluation.dataset_name or evaluation.dataset}")
    if args.detach:
        return _detached(evaluation, evaluation.id, args)
    interrupted = _follow_to_end(client, client.job(evaluation.id), args)
    if interrupted is not None:
        return interrupted
    final = client.evaluation(args.job_id, evaluation.id)
    if args.json:
        output.emit_json(final)
    else:
        output.evaluation_report(output.console(), final)
    return EXIT_OK if final.status.value == "succeeded" else EXIT_ERROR


def _follow_and_report(client: TorchyardClient, job: Job, args: argparse.Namespace) -> int:
    """Follow the job's events to its end; Ctrl-C asks whether to cancel (or leaves it running)."""
    from client import output

    interrupted = _follow_to_end(client, job, args)
    if interrupted is not None:
        return interrupted
    final = client.job(job.id)
    if args.json:
        output.emit_json(final)
    else:
        out = output.console()
        out.print()
        output.job_report(out, final)
    return EXIT_OK if final.status.value == "succeeded" else EXIT_ERROR


def _detached(created: Any, created_id: str, args: argparse.Namespace) -> int:
    """`--detach`: what was queued, as JSON or just its id, and no following."""
    from client import output

    if args.json:
        output.emit_json(created)
    else:
        output.console().print(created_id)
    return EXIT_OK


def _follow_to_end(client: TorchyardClient, job: Job, args: argparse.Namespace) -> int | None:
    """Follow the job's events to its end: None, or the exit code when Ctrl-C interrupted it."""
    try:
        _follow(client, job, quiet=args.json)
    except KeyboardInterrupt:
        return _interrupted(client, job.id, args)
    return None


def _follow(client: TorchyardClient, job: Job, *, quiet: bool) -> None:
    from client import output

    epochs = job.params.get("epochs")
    with output.EpochProgress(output.console(sys.stderr, quiet=quiet)) as bar:
        for event in client.events(job.id):
            data = event.data
            if event.kind == "progress":
                epochs = data.get("epochs") or epochs
                bar.update(data.get("epoch", 0), data.get("epochs", 0), data.get("step", 0), data.get("steps", 0))
            elif event.kind == "metrics":
                bar.finish_epoch(output.epoch_line(data, epochs))
            elif event.kind == "status":
                status = data.get("status")
                detail = data.get("device") or data.get("reason") or data.get("error") or ""
                bar.message(f"{status}{': ' + detail if detail else ''}")
            elif event.kind == "cancel_requested":
                bar.message("cancel requested")
            elif event.kind in ("batch_backoff", "early_stop", "restarted"):
                bar.message(str(data.get("message", event.kind)))
            elif event.kind == "resumed" and "images_done" in data:
                bar.message(f"resumed after {data['images_done']} of {data.get('images_total', '?')} images")


def _interrupted(client: TorchyardClient, job_id: str, args: argparse.Namespace) -> int:
    from client import output

    err = output.console(sys.stderr)
    err.print()
    cancel = args.cancel_on_interrupt
    if not cancel and sys.stdin is not None and sys.stdin.isatty():
        try:
            answer = input(f"Cancel job {job_id}? [y/N] ")
        except (EOFError, KeyboardInterrupt):
            answer = ""
        cancel = answer.strip().lower() in ("y", "yes")
    if cancel:
        job = client.cancel(job_id)
        err.print(f"job {job_id}: cancel requested (now {job.status.value})")
    else:
        err.print(f"job {job_id} keeps running; follow it with `torchyard job {job_id} --follow`, "
                  f"stop it with `torchyard cancel {job_id}`")
    if args.json:
        output.emit_json({"id": job_id, "interrupted": True, "cancel_requested": bool(cancel)})
    return EXIT_INTERRUPTED


def _predict(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    answer = client.predict(args.job, args.images, top_k=args.top_k, alias=args.alias)
    if args.json:
        output.emit_json(answer)
    else:
        output.predictions(output.console(), answer)
    return EXIT_OK


def _predict_folder(client: TorchyardClient, args: argparse.Namespace) -> int:
    """A folder (or zip) of images uploaded unlabelled, or a dataset already uploaded, through a
    predict job; its progress followed like `train`'s, its results downloaded as JSON lines."""
    from client import output

    err = output.console(sys.stderr, quiet=args.json)
    dataset = args.dataset
    if dataset is None:
        err.print(f"uploading {args.path} …")
        dataset = client.upload_dataset(args.path, args.name, labeled=args.labeled)["id"]
    job = client.submit_predictions(dataset, job_id=args.job, alias=args.alias, top_k=args.top_k,
                                    batch_size=args.batch_size, device=args.device)
    err.print(f"job {job.id} queued: predictions of job {job.params.get('trained_job')} on dataset {job.dataset}")
    if args.detach:
        return _detached(job, job.id, args)
    interrupted = _follow_to_end(client, job, args)
    if interrupted is not None:
        return interrupted
    final = client.job(job.id)
    if final.status.value != "succeeded":
        if args.json:
            output.emit_json(final)
        else:
            output.job_report(output.console(), final)
        return EXIT_ERROR
    target = args.output or f"predictions-{job.id}.jsonl"
    path, sha256 = client.download_results(job.id, target)
    summary = final.results
    if args.json:
        output.emit_json({"job": final.model_dump(mode="json"), "path": str(path), "sha256": sha256})
    elif summary is not None:
        accuracy = f", top-1 accuracy {output.pct(summary.accuracy)}" if summary.accuracy is not None else ""
        output.console().print(f"saved {path}: {summary.images} images, {summary.errors} unreadable{accuracy}, "
                               f"{summary.images_per_second:,.0f} images/s")
    return EXIT_OK


def _checkpoint(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    target = args.output or f"{args.job_id}.pt"
    path, sha256 = client.download_checkpoint(args.job_id, target)
    if args.json:
        output.emit_json({"job_id": args.job_id, "path": str(path), "sha256": sha256, "bytes": path.stat().st_size})
    else:
        output.console().print(f"saved {path} ({output.size(path.stat().st_size)}, sha256 {sha256})")
    return EXIT_OK


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


# ---------------------------------------------------------------------- wiring
def _run(handler: Handler) -> Callable[[Settings, argparse.Namespace], int]:
    """Adapt a client handler to `app.cli`'s (settings, args) signature: one error line, an exit code."""

    def run(_: Settings, args: argparse.Namespace) -> int:
        import logging

        logging.getLogger("httpx").setLevel(logging.WARNING)  # no per-request INFO lines in a CLI
        from client.sdk import ApiError, TorchyardClient

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
    """Register devices, models, datasets, train, evaluate, jobs, job, cancel, predict, predict-folder, checkpoint,
    alias and export."""
    common, nested_common = _connection_options(), _connection_options(nested=True)

    def command(name: str, handler: Handler, help_: str,
                parent: argparse._SubParsersAction = sub) -> argparse.ArgumentParser:
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
    upload.add_argument("--unlabeled", action="store_true", help="images at any depth, no class folders "
                                                                 "(for predict-folder only)")

    train = command("train", _train, "start a training job and follow it to the end")
    train.add_argument("--model", required=True, help="architecture, e.g. cifar_net (see `torchyard models`)")
    train.add_argument("--dataset", required=True, help="dataset id or unique name, e.g. fake or pets "
                                                        "(see `torchyard datasets`)")
    train.add_argument("--epochs", type=int)
    train.add_argument("--batch-size", type=int)
    train.add_argument("--lr", type=float, help="learning rate (default: per optimizer)")
    train.add_argument("--optimizer", choices=["sgd", "adam", "adamw"])
    train.add_argument("--device", help="auto (default), cuda, cpu or a device id from `torchyard devices`")
    train.add_argument("--seed", type=int)
    train.add_argument("--val-fraction", type=float)
    train.add_argument("--image-size", type=int, help="square input size of resnet18/mobilenet_v3_small")
    recipe = train.add_argument_group("recipe (defaults and why: docs/training.md)")
    recipe.add_argument("--init-from", metavar="JOB", help="start from the weights of this succeeded job "
                                                           "(same model; a new head when classes differ)")
    recipe.add_argument("--pretrained", action="store_true", help="start from torchvision's ImageNet weights")
    recipe.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                        help="random crop and flip per image")
    recipe.add_argument("--schedule", choices=["onecycle", "cosine", "constant"])
    recipe.add_argument("--warmup", type=float, help="share of the steps spent warming up")
    recipe.add_argument("--weight-decay", type=float)
    recipe.add_argument("--label-smoothing", type=float)
    recipe.add_argument("--patience", type=int, help="early stopping after this many epochs without "
                                                     "improvement (0: off)")
    recipe.add_argument("--monitor", choices=["val_accuracy", "val_loss"])
    recipe.add_argument("--keep", choices=["best", "last"], help="which epoch's weights the checkpoint keeps")
    train.add_argument("--detach", action="store_true", help="print the job id and return at once")
    train.add_argument("--cancel-on-interrupt", action="store_true",
                       help="on Ctrl-C cancel the job without asking (without it, a non-interactive run "
                            "leaves the job running)")

    evaluate = command("evaluate", _evaluate, "measure a trained job's checkpoint on a dataset: accuracy, loss, "
                                              "per-class accuracy and the confusion matrix")
    evaluate.add_argument("job_id", metavar="JOB", help="a succeeded training job")
    evaluate.add_argument("--dataset", required=True, help="dataset id or unique name (a built-in's test split, "
                                                           "or all images of an upload)")
    evaluate.add_argument("--device", help="auto (default), cuda, cpu or a device id")
    evaluate.add_argument("--batch-size", type=int)
    evaluate.add_argument("--detach", action="store_true", help="print the evaluation's id and return at once")
    evaluate.add_argument("--cancel-on-interrupt", action="store_true", help="on Ctrl-C cancel the evaluation")

    jobs = command("jobs", _jobs, "list jobs, newest first")
    jobs.add_argument("--status", choices=["queued", "running", "succeeded", "failed", "cancelled"])
    jobs.add_argument("--limit", type=int, default=20)

    job = command("job", _job, "one job: status, parameters, metrics, per-class accuracy")
    job.add_argument("job_id")
    job.add_argument("--follow", "-f", action="store_true", help="follow its progress to the end")
    job.add_argument("--cancel-on-interrupt", action="store_true", help="with --follow: Ctrl-C cancels the job")

    cancel = command("cancel", _cancel, "cancel a queued or running job")
    cancel.add_argument("job_id")

    predict = command("predict", _predict, "classify images with a trained job's model (or an alias's)")
    target = predict.add_mutually_exclusive_group(required=True)
    target.add_argument("--job", help="a succeeded job's id")
    target.add_argument("--alias", help="an alias (see `torchyard alias list`)")
    predict.add_argument("--top-k", type=int, default=5)
    predict.add_argument("images", nargs="+", help="image files (PNG, JPEG, WebP, BMP, GIF)")

    folder = command("predict-folder", _predict_folder, "label a folder of images (or a dataset) with a trained "
                                                         "job's model: a predict job, followed, its JSON lines saved")
    folder_model = folder.add_mutually_exclusive_group(required=True)
    folder_model.add_argument("--job", help="a succeeded training job's id")
    folder_model.add_argument("--alias", help="an alias (resolved once, when the job is submitted)")
    folder_source = folder.add_mutually_exclusive_group(required=True)
    folder_source.add_argument("path", nargs="?", help="a directory or .zip of images, uploaded unlabelled first")
    folder_source.add_argument("--dataset", help="an uploaded dataset's id or unique name instead of PATH")
    folder.add_argument("--labeled", action="store_true", help="PATH is <class>/<image> folders: lines carry the "
                                                               "true label and the job its top-1 accuracy")
    folder.add_argument("--name", help="a name for the uploaded dataset")
    folder.add_argument("--top-k", type=int, default=5)
    folder.add_argument("--batch-size", type=int)
    folder.add_argument("--device", help="auto (default), cuda, cpu or a device id")
    folder.add_argument("-o", "--output", help="file to write (default: predictions-<job id>.jsonl)")
    folder.add_argument("--detach", action="store_true", help="print the job id and return at once")
    folder.add_argument("--cancel-on-interrupt", action="store_true", help="on Ctrl-C cancel the job")

    alias = sub.add_parser("alias", parents=[common], help="stable names for trained jobs: set, get, list, "
                                                        "rollback, history, delete",
                           description="Aliases: stable names clients predict with (`predict --alias NAME`).")
    alias.set_defaults(run=_run(_alias_list))
    alias_sub = alias.add_subparsers(dest="alias_command")
    command("list", _alias_list, "list the aliases and their targets", alias_sub)
    alias_get = command("get", _alias_get, "one alias: its target, previous target, last move", alias_sub)
    alias_get.add_argument("name")
    alias_set = command("set", _alias_set, "point NAME at a succeeded job (created or moved; the new model is "
                                           "loaded where the old one is resident first)", alias_sub)
    alias_set.add_argument("name")
    alias_set.add_argument("job_id")
    alias_set.add_argument("--note", help="why, for the history")
    alias_rollback = command("rollback", _alias_rollback, "move NAME back to its previous target", alias_sub)
    alias_rollback.add_argument("name")
    alias_rollback.add_argument("--note", help="why, for the history")
    alias_history = command("history", _alias_history, "every move of NAME, newest first", alias_sub)
    alias_history.add_argument("name")
    alias_history.add_argument("--limit", type=int, default=100)
    alias_delete = command("delete", _alias_delete, "remove NAME (its history stays)", alias_sub)
    alias_delete.add_argument("name")
    alias_delete.add_argument("--note", help="why, for the history")

    export = command("export", _export, "download a job's model as TorchScript or ONNX (runs without torchyard)")
    export.add_argument("job_id")
    export.add_argument("--format", choices=["torchscript", "onnx"], required=True)
    export.add_argument("-o", "--output", help="file to write (default: <job id>.onnx or <job id>.torchscript.pt)")
    export.add_argument("--timeout", type=float, default=600, help="seconds to wait while a worker builds it")
    export.add_argument("--retry", action="store_true", help="build it again after a failed export")

    checkpoint = command("checkpoint", _checkpoint, "download a job's weights (checked against its sha256)")
    checkpoint.add_argument("job_id")
    checkpoint.add_argument("-o", "--output", help="file to write (default: <job id>.pt)")
