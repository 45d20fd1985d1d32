"""Predictions: a few images at once (`predict`), or a folder as a job (`predict-folder`)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from client.commands.base import EXIT_ERROR, EXIT_OK, Command, detached
from client.commands.follow import follow_to_end, waiting_notice
from core.defaults import TOP_K

if TYPE_CHECKING:
    from client.sdk import TorchyardClient


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
    from core.kinds import BatchPredictParams

    err = output.console(sys.stderr, quiet=args.json)
    dataset = args.dataset
    if dataset is None:
        err.print(f"uploading {args.path} …")
        dataset = client.upload_dataset(args.path, args.name, labeled=args.labeled)["id"]
    job = client.submit_predictions(dataset, job_id=args.job, alias=args.alias, top_k=args.top_k,
                                    batch_size=args.batch_size, device=args.device)
    trained = BatchPredictParams.of(job).trained_job
    model = f"alias {args.alias} (job {trained})" if args.alias else f"job {trained}"
    err.print(f"job {job.id} queued: predictions of {model} on dataset {job.dataset_name or job.dataset}")
    if args.detach:
        return detached(job, job.id, args)
    interrupted = follow_to_end(client, job, args)
    if interrupted is not None:
        return interrupted
    final = client.patiently(lambda: client.job(job.id), waiting_notice(output.console(sys.stderr), job.id))
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


def register(command: Command) -> None:
    predict = command("predict", _predict, "classify images with a trained job's model (or an alias's)")
    target = predict.add_mutually_exclusive_group(required=True)
    target.add_argument("--job", help="a succeeded job's id")
    target.add_argument("--alias", help="an alias (see `torchyard alias list`)")
    predict.add_argument("--top-k", type=int, default=TOP_K)
    predict.add_argument("images", nargs="+", help="image files (PNG, JPEG, WebP, BMP, GIF)")

    folder = command("predict-folder", _predict_folder, "label a folder of images (or a dataset) with a trained "
                                                         "job's model: a predict job, followed, its JSON lines saved")
    folder_model = folder.add_mutually_exclusive_group(required=True)
    folder_model.add_argument("--job", help="a succeeded training job's id")
    folder_model.add_argument("--alias", help="an alias (resolved once, when the job is submitted)")
    folder_source = folder.add_mutually_exclusive_group(required=True)
    folder_source.add_argument("path", nargs="?", help="a directory or .zip of images, uploaded unlabelled first")
    folder_source.add_argument("--dataset", help="an uploaded dataset's id or name instead of PATH")
    folder.add_argument("--labeled", action="store_true", help="PATH is <class>/<image> folders: lines carry the "
                                                               "true label and the job its top-1 accuracy")
    folder.add_argument("--name", help="a name for the uploaded dataset")
    folder.add_argument("--top-k", type=int, default=TOP_K)
    folder.add_argument("--batch-size", type=int)
    folder.add_argument("--device", help="auto (default), cuda, cpu or a device id")
    folder.add_argument("-o", "--output", help="file to write (default: predictions-<job id>.jsonl)")
    folder.add_argument("--detach", action="store_true", help="print the job id and return at once")
    folder.add_argument("--cancel-on-interrupt", action="store_true", help="on Ctrl-C cancel the job")
