"""Following a job to its end, as `train`, `evaluate`, `predict-folder` and `job --follow` do.

A follower outlives what the job outlives: an API restart or a Redis outage pauses the job, not
the follower. It says once that it is waiting (and once that it is back), reconnects with the
last event id, and ends only with the job, or on Ctrl-C (which asks whether to cancel)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from client.commands.base import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK

if TYPE_CHECKING:
    from rich.console import Console

    from client.sdk import TorchyardClient
    from core.schemas import Job


def follow_and_report(client: TorchyardClient, job: Job, args: argparse.Namespace) -> int:
    """Follow the job to its end, then print its report (or JSON): exit 0 only if it succeeded."""
    from client import output

    interrupted = follow_to_end(client, job, args)
    if interrupted is not None:
        return interrupted
    final = client.patiently(lambda: client.job(job.id), waiting_notice(output.console(sys.stderr), job.id))
    if args.json:
        output.emit_json(final)
    else:
        out = output.console()
        out.print()
        output.job_report(out, final)
    return EXIT_OK if final.status.value == "succeeded" else EXIT_ERROR


def follow_to_end(client: TorchyardClient, job: Job, args: argparse.Namespace) -> int | None:
    """Follow the job's events to its end: None, or the exit code when Ctrl-C interrupted it."""
    try:
        _follow(client, job, quiet=args.json)
    except KeyboardInterrupt:
        return _interrupted(client, job.id, args)
    return None


def waiting_notice(out: Console, job_id: str) -> Callable[[str | None], None]:
    """What a follower says when the server goes away (once) and when it is back (once)."""

    def notice(reason: str | None) -> None:
        if reason is None:
            out.print(f"torchyard: the server answers again; following job {job_id}")
        else:
            # The server may be all down (`make run` stopped) or only its API: the job is kept either way,
            # running on where its worker is up, resumed after its last epoch when the stack is back.
            out.print(f"torchyard: waiting for the server ({reason}); job {job_id} is kept: it runs on if its "
                      f"worker is up, else it resumes where it left off when the server is back. Ctrl-C stops "
                      f"waiting, not the job")

    return notice


def _follow(client: TorchyardClient, job: Job, *, quiet: bool) -> None:
    from client import output

    epochs = job.progress.epochs or None  # a job without epochs: 0
    with output.EpochProgress(output.console(sys.stderr, quiet=quiet)) as bar:
        # Said on stderr even with --json: a script's log should show why it is slow.
        notice = waiting_notice(bar.out if not quiet else output.console(sys.stderr), job.id)
        for event in client.events(job.id, on_wait=notice):
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
