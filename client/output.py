"""How the CLI shows things to a person: tables, the epoch progress bar, a job's report.

Rendering is rich's: it sizes tables to the terminal, draws a live progress bar only where a
terminal is there to redraw it, and degrades to plain text in a pipe or a log (no colours, no
cursor movement, one line per epoch). Loaded only when a client command runs (see
client/commands/: a worker's start-up must not pay for it).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from rich import box
from rich.bar import Bar
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from core.kinds import BatchPredictParams, EvaluateParams, TrainingParams, params_of
from core.schemas import Alias, AliasUpdate, Evaluation, EvaluationResult, Job, MlflowRun, PredictResponse

# A pipe or a log has no width: never wrap a row there (scripts grep lines).
_PIPE_WIDTH = 1000


def console(stream: TextIO | None = None, *, quiet: bool = False) -> Console:
    """A console on `stream` that prints text as given (no markup, no highlighting of numbers)."""
    stream = stream or sys.stdout
    tty = stream.isatty()
    return Console(file=stream, quiet=quiet, markup=False, highlight=False, emoji=False,
                   width=None if tty else _PIPE_WIDTH, soft_wrap=not tty)


def emit_json(value: Any) -> None:
    """What --json prints: the API's own JSON shape, so scripts can rely on docs/api.md."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    elif isinstance(value, list):
        value = [v.model_dump(mode="json") if hasattr(v, "model_dump") else v for v in value]
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")


def table(out: Console, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for name in header:
        grid.add_column(name, no_wrap=True)
    for row in rows:
        grid.add_row(*row)
    if out.is_terminal:
        out.print(grid)
        return
    # In a pipe rich pads every cell to its column, so each line ran to the widest row's width in
    # trailing spaces: what `grep`/`awk` get is the text, without them.
    with out.capture() as captured:
        out.print(grid)
    out.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def count(n: int, singular: str, plural: str | None = None) -> str:
    """`1 class`, `2 classes`: the noun agrees with the number."""
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def size(value: int | None) -> str:
    """Bytes in binary units, as memory is reported (rich's filesize is decimal)."""
    if value is None:
        return "-"
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if amount < 1024 or unit == "TiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return str(value)


def epoch_line(m: dict[str, Any], epochs: int | None) -> str:
    total = f"/{epochs}" if epochs else ""
    return (f"epoch {m['epoch']}{total}: train loss {num(m.get('train_loss'))} "
            f"acc {pct(m.get('train_accuracy'))} | val loss {num(m.get('val_loss'))} "
            f"acc {pct(m.get('val_accuracy'))} | {m.get('images_per_second', 0):.0f} img/s, "
            f"{m.get('seconds', 0):.1f} s")


class EpochProgress:
    """The running epoch as a live bar on a terminal (rich redraws it in place); everywhere, one
    summary line per finished epoch and one line per status change, so logs stay readable."""

    def __init__(self, out: Console) -> None:
        self.out = out
        self._progress = Progress(TextColumn("epoch {task.fields[epoch]}/{task.fields[epochs]}"), BarColumn(),
                                  MofNCompleteColumn(), TextColumn("steps"), TimeElapsedColumn(),
                                  console=out, transient=True)
        self._task: TaskID | None = None
        self._epoch: int | None = None

    def __enter__(self) -> EpochProgress:
        self._progress.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._progress.stop()

    def update(self, epoch: int, epochs: int, step: int, steps: int) -> None:
        if self._task is None:
            self._task = self._progress.add_task("train", total=steps, epoch=epoch, epochs=epochs)
        elif epoch != self._epoch:
            self._progress.reset(self._task, total=steps, epoch=epoch, epochs=epochs)
        self._epoch = epoch
        self._progress.update(self._task, completed=step, total=steps)

    def finish_epoch(self, summary: str) -> None:
        if self._task is not None:
            self._progress.remove_task(self._task)
            self._task = None
        self.out.print(summary)

    def message(self, text: str) -> None:
        self.out.print(text)


def job_accuracy(job: Job) -> float | None:
    """The accuracy a person compares jobs by: an evaluation's result, the kept weights' validation,
    else the last epoch's."""
    if job.evaluation is not None:
        return job.evaluation.accuracy
    return job.metrics[-1].val_accuracy if job.metrics else None


_PARAMS = ("epochs", "batch_size", "learning_rate", "optimizer", "schedule", "warmup_fraction", "weight_decay",
           "label_smoothing", "augment", "patience", "monitor", "keep", "seed", "val_fraction", "image_size")


def _device_choices(job: Job) -> list[tuple[str, str]]:
    """What the worker decided for the run (the batch when left unset, the precision, the layout):
    a row of its own, as the record keeps it apart from the params the user gave."""
    c = job.device_choices
    if c is None:
        return []
    precision = c.amp_dtype or "fp32"
    return [("ran with", f"batch_size={c.batch_size}, schedule={c.schedule}, precision={precision}, "
                         f"channels_last={c.channels_last}")]


def job_report(out: Console, job: Job) -> None:
    """A job as a person reads it: the record, the metrics table, the kept weights' validation
    (per-class accuracy, confusion matrix) and the job's evaluations."""
    p = params_of(job)
    dataset = f"{job.dataset_name} ({job.dataset})" if job.dataset_name and job.dataset_name != job.dataset else job.dataset
    given = p.model_dump(include=set(_PARAMS)) if isinstance(p, TrainingParams) else {}
    rows = [("job", job.id + (f" ({job.kind.value})" if job.kind.value != "train" else "")),
            ("status", job.status.value + (f" ({job.message})" if job.message else "")),
            ("model", job.model), ("dataset", dataset), ("device", job.device or "-"),
            ("params", ", ".join(f"{k}={given[k]}" for k in _PARAMS if given.get(k) is not None)),
            *_device_choices(job),
            ("progress", f"epoch {job.progress.epoch}/{job.progress.epochs}, "
                         f"step {job.progress.step}/{job.progress.steps}"),
            ("attempts", str(job.attempts)), ("created", str(job.created_at)),
            ("finished", str(job.finished_at or "-"))]
    if isinstance(p, TrainingParams) and p.init_from:
        rows.insert(5, ("starts from", f"the weights of job {p.init_from}"))
    elif isinstance(p, TrainingParams) and p.pretrained:
        rows.insert(5, ("starts from", "torchvision's ImageNet weights"))
    if isinstance(p, EvaluateParams | BatchPredictParams):
        rows.insert(2, ("evaluates", f"the checkpoint of job {p.trained_job}"))
    if job.stop_reason:
        rows.append(("ended", job.stop_reason))
    if job.best_epoch is not None:
        rows.append(("weights", f"epoch {job.best_epoch} ({p.keep if isinstance(p, TrainingParams) else 'last'})"))
    if job.checkpoint:
        rows.append(("checkpoint", f"{job.checkpoint.url} ({size(job.checkpoint.bytes)}, "
                                   f"sha256 {job.checkpoint.sha256[:12]}…)"))
    if job.error:
        rows.append(("error", job.error))
    if job.mlflow is not None:
        rows.append(("mlflow", mlflow_line(job.mlflow)))
    record = Table.grid(padding=(0, 2))
    record.add_column(no_wrap=True)
    record.add_column()
    for key, value in rows:
        record.add_row(key, value)
    out.print(record)
    if job.metrics:
        out.print()
        table(out, ["epoch", "train_loss", "train_acc", "val_loss", "val_acc", "lr", "img/s", "seconds"],
              [[str(m.epoch) + (" *" if m.epoch == job.best_epoch else ""), num(m.train_loss), pct(m.train_accuracy),
                num(m.val_loss), pct(m.val_accuracy), "-" if m.learning_rate is None else f"{m.learning_rate:.2e}",
                f"{m.images_per_second:.0f}", f"{m.seconds:.1f}"] for m in job.metrics])
    if job.evaluation is not None:
        out.print()
        evaluation_result(out, job.evaluation, job.dataset_name)
    elif job.metrics and job.metrics[-1].per_class_accuracy:
        out.print()
        per_class_lines(out, job.metrics[-1].per_class_accuracy)
    if job.evaluations:
        out.print()
        out.print("evaluations")
        table(out, ["evaluation", "dataset", "status", "images", "accuracy", "loss", "created (UTC)"],
              [[e.id, e.dataset_name or e.dataset, e.status.value, str(e.result.num_images) if e.result else "-",
                pct(e.result.accuracy if e.result else None), num(e.result.loss if e.result else None),
                e.created_at.strftime("%Y-%m-%d %H:%M:%S")] for e in job.evaluations])


def mlflow_line(run: MlflowRun) -> str:
    """Where the job's MLflow run is, and what it does not hold yet (the server away)."""
    where = (run.url or run.run_id or "no run yet") + (f" ({run.status})" if run.status else "")
    if not run.behind:
        return where
    return f"{where}; behind: {', '.join(run.behind)}" + (f" ({run.error})" if run.error else "")


def per_class_lines(out: Console, per_class: dict[str, float]) -> None:
    width = max(len(name) for name in per_class)
    for name, accuracy in per_class.items():  # the PyTorch tutorial's own lines
        out.print(f"Accuracy of {name:<{width}} : {100 * accuracy:3.0f} %")


def evaluation_result(out: Console, result: EvaluationResult, dataset_name: str | None = None) -> None:
    """Accuracy and loss, a bar per class, and the confusion matrix (rows: true, columns: predicted).
    The dataset goes by its name where the caller has it (the result records only its id)."""
    what = {"validation": f"validation split, epoch {result.epoch}" if result.epoch else "validation split",
            "test": "test split", "all": "all images"}[result.split]
    out.print(f"{dataset_name or result.dataset} ({what}): accuracy {pct(result.accuracy)}, loss {num(result.loss)}, "
              f"{result.num_images} images")
    bars = Table(box=None, show_header=False, pad_edge=False, padding=(0, 2))
    bars.add_column(no_wrap=True)
    bars.add_column(width=20)
    bars.add_column(justify="right", no_wrap=True)
    for name, accuracy in result.per_class_accuracy.items():
        bars.add_row(f"Accuracy of {name}", Bar(1.0, 0.0, accuracy), f"{100 * accuracy:5.1f} %")
    out.print(bars)
    if result.confusion_matrix is not None:
        out.print()
        confusion_matrix(out, result.classes, result.confusion_matrix)


def confusion_matrix(out: Console, classes: list[str], matrix: list[list[int]]) -> None:
    """Rows are the true classes, columns the predicted ones (numbered as the rows); the diagonal,
    the right answers, in bold."""
    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold",
                 title="confusion matrix (rows: true class, columns: predicted)", title_justify="left")
    grid.add_column("true \\ predicted", no_wrap=True)
    for k in range(len(classes)):
        grid.add_column(str(k), justify="right", no_wrap=True)
    for k, (name, row) in enumerate(zip(classes, matrix, strict=True)):
        grid.add_row(f"{k} {name}", *(Text(str(v), style="bold" if j == k else "") for j, v in enumerate(row)))
    out.print(grid)


def evaluation_report(out: Console, evaluation: Evaluation) -> None:
    dataset = evaluation.dataset_name or evaluation.dataset
    out.print(f"evaluation {evaluation.id} of job {evaluation.job_id} on {dataset}: {evaluation.status.value}"
              + (f" on {evaluation.device}" if evaluation.device else ""))
    if evaluation.error:
        out.print(f"error: {evaluation.error}")
    if evaluation.result is not None:
        out.print()
        evaluation_result(out, evaluation.result, evaluation.dataset_name)


def predictions(out: Console, answer: PredictResponse) -> None:
    """Per image: a heading, then one row per class with a bar of its probability."""
    for result in answer.results:
        served_by = f"alias {answer.alias} → job {answer.job_id}" if answer.alias else f"job {answer.job_id}"
        out.print(f"{result.filename}  ({answer.model}, {served_by}, on {answer.device})")
        rows = Table(box=None, show_header=False, pad_edge=False, padding=(0, 2))
        rows.add_column(no_wrap=True)
        rows.add_column(width=20)
        rows.add_column(justify="right", no_wrap=True)
        for p in result.predictions:
            rows.add_row(p.label, Bar(1.0, 0.0, p.probability), f"{100 * p.probability:5.1f} %")
        out.print(rows)


def alias_report(out: Console, alias: Alias) -> None:
    """An alias as a person reads it; after a move, how warming the new target went per device."""
    record = Table.grid(padding=(0, 2))
    record.add_column(no_wrap=True)
    record.add_column()
    for key, value in (("alias", alias.name), ("job", f"{alias.job_id} ({alias.model})"),
                       ("previous", alias.previous_job_id or "-"), ("moves", str(alias.moves)),
                       ("updated", f"{alias.updated_at} by {alias.updated_by or '-'}"), ("note", alias.note or "-")):
        record.add_row(key, value)
    if isinstance(alias, AliasUpdate):
        warmed = ", ".join(f"{w.device}: {w.status}" + (f" ({w.detail})" if w.detail else "") for w in alias.warm)
        record.add_row("warmed", warmed or "- (no device held the previous target)")
    out.print(record)
