"""Jobs: train, evaluate, jobs, job, cancel."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from client.commands.base import EXIT_ERROR, EXIT_OK, Command, detached
from client.commands.follow import follow_and_report, follow_to_end, waiting_notice

if TYPE_CHECKING:
    from client.sdk import TorchyardClient


def _train(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    job = client.submit(model=args.model, dataset=args.dataset, epochs=args.epochs, batch_size=args.batch_size,
                        learning_rate=args.lr, optimizer=args.optimizer, device=args.device, seed=args.seed,
                        val_fraction=args.val_fraction, image_size=args.image_size, augment=args.augment,
                        schedule=args.schedule, warmup_fraction=args.warmup, weight_decay=args.weight_decay,
                        label_smoothing=args.label_smoothing, patience=args.patience, monitor=args.monitor,
                        keep=args.keep, init_from=args.init_from, pretrained=args.pretrained or None,
                        precision=args.precision, world_size=args.world_size, elastic=args.elastic or None)
    output.console(sys.stderr).print(f"job {job.id} queued: {job.model} on {job.dataset_name or job.dataset}, "
                                     f"{output.count(job.progress.epochs, 'epoch')}, device {job.requested_device}")
    if args.detach:
        return detached(job, job.id, args)
    return follow_and_report(client, job, args)


def _evaluate(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    evaluation = client.evaluate(args.job_id, args.dataset, device=args.device, batch_size=args.batch_size)
    err = output.console(sys.stderr)
    err.print(f"evaluation {evaluation.id} queued: job {args.job_id} on {evaluation.dataset_name or evaluation.dataset}")
    if args.detach:
        return detached(evaluation, evaluation.id, args)
    interrupted = follow_to_end(client, client.job(evaluation.id), args)
    if interrupted is not None:
        return interrupted
    final = client.patiently(lambda: client.evaluation(args.job_id, evaluation.id), waiting_notice(err, evaluation.id))
    if args.json:
        output.emit_json(final)
    else:
        output.evaluation_report(output.console(), final)
    return EXIT_OK if final.status.value == "succeeded" else EXIT_ERROR


def _jobs(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    jobs = client.jobs(status=args.status, limit=args.limit)
    if args.json:
        output.emit_json(jobs)
        return EXIT_OK
    output.table(output.console(), ["job", "kind", "status", "model", "dataset", "epoch", "val_acc", "device",
                                    "created (UTC)"],
                 [[j.id, j.kind.value, j.status.value, j.model, j.dataset_name or j.dataset,
                   f"{j.progress.epoch}/{j.progress.epochs}" if j.kind.value == "train" else "-",
                   output.pct(output.job_accuracy(j)), j.device or j.requested_device,
                   j.created_at.strftime("%Y-%m-%d %H:%M:%S")] for j in jobs.jobs])
    return EXIT_OK


def _job(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    if args.follow:
        return follow_and_report(client, client.job(args.job_id), args)
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


def _delete(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    client.delete("jobs", args.job_id)
    if not args.json:
        output.console().print(f"job {args.job_id} deleted")
    return EXIT_OK


def register(command: Command) -> None:
    train = command("train", _train, "start a training job and follow it to the end")
    train.add_argument("--model", required=True, help="architecture, e.g. cifar_net (see `torchyard models`)")
    train.add_argument("--dataset", required=True, help="dataset id or name (its newest version), e.g. fake or pets "
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
    recipe.add_argument("--precision", choices=["auto", "fp32"],
                        help="auto (default): the device's native mixed precision; fp32: none")
    gang = train.add_argument_group("one job on several devices (docs/training.md)")
    gang.add_argument("--world-size", type=int, metavar="N",
                      help="devices that train the job together; --batch-size is then the global batch")
    gang.add_argument("--elastic", action="store_true", help="after a fault, resume on fewer devices if fewer are free")
    train.add_argument("--detach", action="store_true", help="print the job id and return at once")
    train.add_argument("--cancel-on-interrupt", action="store_true",
                       help="on Ctrl-C cancel the job without asking (without it, a non-interactive run "
                            "leaves the job running)")

    evaluate = command("evaluate", _evaluate, "measure a trained job's checkpoint on a dataset: accuracy, loss, "
                                              "per-class accuracy and the confusion matrix")
    evaluate.add_argument("job_id", metavar="JOB", help="a succeeded training job")
    evaluate.add_argument("--dataset", required=True, help="dataset id or name (a built-in's test split, "
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

    delete = command("delete", _delete, "delete a finished job: its record, checkpoint and files (refused, "
                                        "with the reason, while an alias points at it or a job uses it)")
    delete.add_argument("job_id", metavar="JOB")
