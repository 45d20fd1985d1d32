"""Sweeps: `sweep --base job.json --space space.json` (or flags: `--model cifar_net --dataset fake
--float learning_rate=1e-4:0.1:log --choice batch_size=64,128`) starts one and watches its trials to the end,
`sweep ID` (one sweep; `--follow`, `--cancel`), `sweeps` (the list), through the SDK's calls (client/teams.py: typed with core/sweeps/spec.py's
Sweep, which loads no Optuna); the tables read a sweep as its JSON, the shape `--json` prints."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.commands.base import EXIT_ERROR, EXIT_OK, Command

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from client.sdk import TorchyardClient
    from core.sweeps.spec import Sweep

ENDED = {"succeeded", "failed", "cancelled"}
POLL_S = 2.0


def _as_json(sweep: Sweep) -> dict[str, Any]:
    return sweep.model_dump(mode="json")


def _read_json(path: str, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"torchyard: error: {what} {path}: {exc}") from None


def _value(text: str) -> Any:
    """A value as typed: a number, true/false or null as JSON reads it, else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _range_flag(kind: str, text: str) -> tuple[str, dict[str, Any]]:
    """--float lr=1e-4:0.1:log, --int epochs=2:8, --choice batch_size=32,64,128 as a space's entry."""
    name, sep, spec = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"torchyard: error: --{kind} {text!r}: write NAME=...")
    if kind == "choice":
        return name, {"type": "categorical", "choices": [_value(v) for v in spec.split(",")]}
    low, _, rest = spec.partition(":")
    high, _, log = rest.partition(":")
    if not high or log not in ("", "log"):
        raise SystemExit(f"torchyard: error: --{kind} {text!r}: write NAME=LOW:HIGH or NAME=LOW:HIGH:log")
    return name, {"type": kind, "low": _value(low), "high": _value(high), "log": log == "log"}


def _body(args: argparse.Namespace) -> dict[str, Any]:
    base: dict[str, Any] = _read_json(args.base, "--base") if args.base else {}
    for name in ("model", "dataset", "epochs"):
        if getattr(args, name) is not None:
            base[name] = getattr(args, name)
    space: dict[str, Any] = _read_json(args.space, "--space") if args.space else {}
    for kind in ("float", "int", "choice"):
        space.update(_range_flag(kind, text) for text in getattr(args, kind) or [])
    body: dict[str, Any] = {"base": base, "space": space}
    for name in ("trials", "parallel", "metric", "direction", "sampler", "pruner", "seed", "startup_trials"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    return body


def _sweep(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    if args.sweep_id is None:
        if not ((args.base or args.model) and (args.space or args.float or args.int or args.choice)):
            print("torchyard: error: give a sweep ID, or a base (--base or --model/--dataset) and a space "
                  "(--space or --float/--int/--choice) to start one", file=sys.stderr)
            return EXIT_ERROR
        sweep = _as_json(client.start_sweep(_body(args), args.idempotency_key))
        output.console(sys.stderr).print(f"sweep {sweep['id']}: {sweep['spec']['trials']} trials, "
                                         f"{sweep['parallel']} at once")
        if args.detach:
            if args.json:
                output.emit_json(sweep)
            else:
                output.console().print(sweep["id"])
            return EXIT_OK
        follow = True
    else:
        sweep = _as_json(client.cancel_sweep(args.sweep_id) if args.cancel else client.sweep(args.sweep_id))
        follow = args.follow
    if follow and not args.json:
        sweep = _watch(client, sweep)
    elif follow:
        while sweep["status"] not in ENDED or any(t["state"] == "running" for t in sweep["trials"]):
            time.sleep(POLL_S)
            sweep = _as_json(client.sweep(sweep["id"]))
    if args.json:
        output.emit_json(sweep)
    else:
        _report(output.console(), sweep)
    return EXIT_OK if sweep["status"] in {"running", "succeeded"} or not follow else EXIT_ERROR


def _watch(client: TorchyardClient, sweep: dict[str, Any]) -> dict[str, Any]:
    """A live table of the trials and the best-so-far line, until the sweep ends (Ctrl-C: leave it running)."""
    from rich.live import Live

    from client import output

    with Live(_trials_table(sweep), console=output.console(sys.stderr), refresh_per_second=2) as live:
        while sweep["status"] not in ENDED or any(t["state"] == "running" for t in sweep["trials"]):
            time.sleep(POLL_S)
            sweep = _as_json(client.sweep(sweep["id"]))
            live.update(_trials_table(sweep))
    return sweep


def _trials_table(sweep: dict[str, Any]) -> Table:
    from rich import box
    from rich.table import Table

    spec = sweep["spec"]
    names = list(spec["space"])
    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, header_style="bold",
                 title=f"sweep {sweep['id']} ({sweep['status']}): {_best_line(sweep)}", title_justify="left")
    for column in ["#", "state", "epoch", spec["metric"], "best so far", *names, "job"]:
        grid.add_column(column, no_wrap=True)
    pick = max if (spec.get("direction") or "maximize") == "maximize" else min
    best: float | None = None
    for trial in sweep["trials"]:
        value = trial.get("value")
        if trial["state"] == "complete" and value is not None:
            best = value if best is None else pick(best, value)
        grid.add_row(str(trial["number"]), trial["state"], str(trial["epoch"]), _num(value), _num(best),
                     *[_num(trial["params"].get(n)) for n in names], trial.get("job_id") or "-")
    return grid


def _best_line(sweep: dict[str, Any]) -> str:
    best = sweep.get("best")
    if not best:
        return "no complete trial yet"
    params = ", ".join(f"{k}={_num(v)}" for k, v in best["params"].items())
    return f"best {sweep['spec']['metric']} {_num(best['value'])} (trial {best['number']}, job {best['job_id']}: {params})"


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _report(out: Console, sweep: dict[str, Any]) -> None:
    out.print(_trials_table(sweep))
    if sweep.get("importances"):
        out.print("importance: " + ", ".join(f"{k} {v:.2f}" for k, v in sweep["importances"].items()))
    if sweep.get("message"):
        out.print(sweep["message"])


def _sweeps(client: TorchyardClient, args: argparse.Namespace) -> int:
    from client import output

    found = {"sweeps": [_as_json(s) for s in client.sweeps(args.limit)]}
    if args.json:
        output.emit_json(found)
        return EXIT_OK
    output.table(output.console(), ["sweep", "status", "trials", "metric", "best", "created (UTC)"],
                 [[s["id"], s["status"], f"{len(s['trials'])}/{s['spec']['trials']}", s["spec"]["metric"],
                   _num(s["best"]["value"]) if s.get("best") else "-", s["created_at"][:19].replace("T", " ")]
                  for s in found["sweeps"]])
    return EXIT_OK


def register(command: Command) -> None:
    sweep = command("sweep", _sweep, "start a hyper-parameter sweep and watch its trials (--base, --space), "
                                     "or show one (ID)")
    sweep.add_argument("sweep_id", nargs="?", metavar="ID", help="an existing sweep")
    sweep.add_argument("--base", metavar="JOB.json", help="a POST /jobs training body")
    sweep.add_argument("--space", metavar="SPACE.json", help='{"field": {"type": "float", "low": .., "high": ..}, ...}')
    flags = sweep.add_argument_group("or as flags (added to --base and --space when both are given)")
    flags.add_argument("--model")
    flags.add_argument("--dataset")
    flags.add_argument("--epochs", type=int)
    flags.add_argument("--float", action="append", metavar="NAME=LOW:HIGH[:log]", help="a float range to search")
    flags.add_argument("--int", action="append", metavar="NAME=LOW:HIGH[:log]", help="an int range to search")
    flags.add_argument("--choice", action="append", metavar="NAME=A,B,..", help="values to choose from")
    sweep.add_argument("--trials", type=int)
    sweep.add_argument("--parallel", type=int)
    sweep.add_argument("--metric", choices=["val_accuracy", "val_loss", "train_accuracy", "train_loss"])
    sweep.add_argument("--direction", choices=["maximize", "minimize"])
    sweep.add_argument("--sampler", choices=["tpe", "random", "grid"])
    sweep.add_argument("--pruner", choices=["median", "successive_halving", "hyperband", "none"])
    sweep.add_argument("--startup-trials", type=int, help="the median pruner waits for this many complete trials")
    sweep.add_argument("--seed", type=int)
    sweep.add_argument("--idempotency-key", help="a retry with the same key and body gets the same sweep")
    sweep.add_argument("--detach", action="store_true", help="print the sweep id and return at once")
    sweep.add_argument("--follow", "-f", action="store_true", help="with ID: watch it to the end")
    sweep.add_argument("--cancel", action="store_true", help="with ID: cancel it (its running trials stop)")

    sweeps = command("sweeps", _sweeps, "list sweeps, newest first")
    sweeps.add_argument("--limit", type=int, default=20)
