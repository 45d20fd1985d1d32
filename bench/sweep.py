"""Sweeps: where Optuna's study lives, and a sweep through the service with and without pruning.

    flock /tmp/torchyard-bench.lock .venv/bin/python bench/sweep.py [--trials 16] [--workers 1]
        [--epochs-low 2] [--epochs-high 4] [--space narrow|issue] [--startup-trials 4] [--warmup-epochs 0]
        [--data fake|photos] [--photos 3000] [--tint 0.2] [--val-fraction 0.15]
        [--storage-trials 100] [--no-write-docs]

(a) The study's storage: `--storage-trials` ask + tell pairs (the coordinator's work per trial) on
    Optuna's JournalStorage over an embedded Redis (unix socket, AOF everysec: the service's own)
    and over a journal file under a temporary data dir (JournalFileBackend), and the time a fresh
    process takes to open the study with that many trials (what an API process pays after a restart).
(b) Through the service, as real processes: an embedded Redis, the API and `--workers` CPU workers.
    The same sweep (cifar_net, TPE, seed 0; learning_rate log 1e-3..0.1, weight_decay 0..0.1,
    batch_size 64|128, epochs `--epochs-low`..`--epochs-high`, not searched when they are equal;
    early stopping off) with the median pruner (`--startup-trials`, `--warmup-epochs`: its
    n_startup_trials and n_warmup_steps) and with none, `parallel` = the workers; `--space issue`
    searches the issue's example ranges (learning_rate 1e-4..0.1, batch 32|64|128) instead. On
    `fake` (`--data fake`: most trials reach val_accuracy 1.0 within two epochs, so they tie) or
    on a harder photo set (`--data photos`: bench/photo_data.py's photo-like JPEGs at 32×32 with a
    fainter class tint, uploaded as an ImageFolder zip; trials differ and keep improving). Device
    busy: the trials' jobs' running time (started_at..finished_at, summed) over the sweep's wall
    time × workers; epochs: every epoch the trials' jobs ran; best: the sweep's best val_accuracy;
    each trial's state, epochs and value in the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.docs import write_section  # noqa: E402 (after the sys.path entry above)
from bench.harness import load_average, machine  # noqa: E402

SPACES = {
    # The example space (learning_rate 1e-4..0.1 log, weight_decay 0..0.1, batch 32|64|128).
    "issue": {"learning_rate": {"type": "float", "low": 1e-4, "high": 0.1, "log": True},
              "weight_decay": {"type": "float", "low": 0.0, "high": 0.1},
              "batch_size": {"type": "categorical", "choices": [32, 64, 128]}},
    # A narrower one, where most trials are good (the first figures below).
    "narrow": {"learning_rate": {"type": "float", "low": 1e-3, "high": 0.1, "log": True},
               "weight_decay": {"type": "float", "low": 0.0, "high": 0.1},
               "batch_size": {"type": "categorical", "choices": [64, 128]}},
}


def storage(trials: int) -> dict[str, Any]:
    import subprocess
    import warnings

    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend, JournalRedisBackend

    from app.embedded_redis import EmbeddedRedis

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.simplefilter("ignore")
    root = Path(tempfile.mkdtemp(prefix="torchyard-bench-sweep-"))
    server = EmbeddedRedis(root / "redis")
    url = server.start()
    out: dict[str, Any] = {}
    try:
        backends = {"redis": (lambda: JournalRedisBackend(url, prefix="bench:"), f"JournalRedisBackend({url!r}, "
                              "prefix='bench:')"),
                    "file": (lambda: JournalFileBackend(str(root / "journal.log")),
                             f"JournalFileBackend({str(root / 'journal.log')!r})")}
        for name, (make, source) in backends.items():
            study = optuna.create_study(study_name="s", storage=JournalStorage(make()), direction="maximize",
                                        sampler=optuna.samplers.RandomSampler(seed=0))
            dist: dict[str, optuna.distributions.BaseDistribution] = {"x": optuna.distributions.FloatDistribution(0, 1)}
            started = time.perf_counter()
            for _ in range(trials):
                trial = study.ask(dist)
                study.tell(trial.number, trial.params["x"])
            per_trial = (time.perf_counter() - started) / trials
            code = ("import time, warnings; warnings.simplefilter('ignore'); import optuna; "
                    "from optuna.storages import JournalStorage; "
                    "from optuna.storages.journal import JournalFileBackend, JournalRedisBackend; "
                    f"t = time.perf_counter(); s = optuna.load_study(study_name='s', storage=JournalStorage({source})); "
                    "n = len(s.get_trials()); print((time.perf_counter() - t) * 1000, n)")
            opened = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
            open_ms, seen = opened.stdout.split()
            out[name] = {"ask_tell_ms": round(per_trial * 1000, 2), "open_ms": round(float(open_ms), 1),
                         "trials_seen": int(seen)}
    finally:
        server.stop()
    return out


def photo_set(root: Path, photos: int, tint: float) -> Path:
    """The harder set: bench/photo_data.py's photo-like JPEGs at 32×32 (cifar_net's input), the
    class's colour shift `tint` (0.4 in bench/photos.py's set; at 0.2 the classes overlap, so
    trials differ by their recipe and keep improving over epochs instead of all reaching 1.0)."""
    from bench.photo_data import write_dataset_zip

    path = root / "photos.zip"
    write_dataset_zip(path, photos, width=32, height=32, tint=tint)
    return path


def service(trials: int, workers: int, epochs: tuple[int, int], space: dict[str, Any], *, startup_trials: int,
            warmup_epochs: int, data: str, photos: int, tint: float, val_fraction: float) -> dict[str, Any]:
    import httpx

    from app.embedded_redis import EmbeddedRedis
    from harness import Processes, free_port, wait_until

    root = Path(tempfile.mkdtemp(prefix="torchyard-bench-sweep-"))
    server = EmbeddedRedis(root / "redis")
    url = server.start()
    procs = Processes(url, root / "data", root / "logs")
    for k in range(workers):
        procs.worker("cpu", name=f"w{k}", TORCHYARD_NODE_NAME=f"w{k}")
    port = free_port()
    procs.api(port)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    results: dict[str, Any] = {}
    try:
        wait_until(lambda: sum(d["status"] == "idle" for d in client.get("/devices").json()["devices"]) >= workers,
                   timeout=240, what="the workers")
        base: dict[str, Any] = {"model": "cifar_net", "dataset": "fake", "epochs": epochs[1], "patience": 0}
        if data == "photos":
            with open(photo_set(root, photos, tint), "rb") as archive:
                uploaded = client.post("/datasets", files={"file": ("photos.zip", archive, "application/zip")},
                                       data={"name": "sweep-photos"})
            assert uploaded.status_code == 201, uploaded.text
            base.update(dataset=uploaded.json()["id"], val_fraction=val_fraction)
        searched = dict(space)
        if epochs[0] < epochs[1]:
            searched["epochs"] = {"type": "int", "low": epochs[0], "high": epochs[1]}
        for pruner in ("median", "none"):
            body = {"base": base, "space": searched, "trials": trials, "parallel": workers, "sampler": "tpe",
                    "pruner": pruner, "startup_trials": startup_trials, "warmup_epochs": warmup_epochs, "seed": 0}
            started = time.perf_counter()
            created = client.post("/sweeps", json=body)
            assert created.status_code == 201, created.text

            def ended(sweep_id: str = created.json()["id"]) -> dict | None:
                sweep = client.get(f"/sweeps/{sweep_id}").json()
                return sweep if sweep["status"] != "running" and all(t["state"] != "running"
                                                                      for t in sweep["trials"]) else None

            sweep = wait_until(ended, timeout=6 * 3600, interval=1.0, what="the sweep")
            wall = time.perf_counter() - started
            jobs = [client.get(f"/jobs/{t['job_id']}").json() for t in sweep["trials"]]
            busy = sum((_at(j["finished_at"]) - _at(j["started_at"])) for j in jobs if j["started_at"])
            results[pruner] = {
                "status": sweep["status"], "wall_s": round(wall, 1), "device_busy": round(busy / (wall * workers), 3),
                "epochs_run": sum(len(j["metrics"]) for j in jobs),
                "pruned": sum(t["state"] == "pruned" for t in sweep["trials"]),
                "best": sweep["best"]["value"] if sweep["best"] else None,
                "best_trial": sweep["best"]["number"] if sweep["best"] else None,
                "trials": [{"number": t["number"], "state": t["state"], "epochs": len(j["metrics"]),
                            "value": t["value"], "params": t["params"]} for t, j in zip(sweep["trials"], jobs, strict=True)],
            }
    finally:
        client.close()
        procs.stop_all()
        server.stop()
    return results


def _at(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--epochs-high", type=int, default=4)
    parser.add_argument("--storage-trials", type=int, default=100)
    parser.add_argument("--space", choices=sorted(SPACES), default="narrow")
    parser.add_argument("--epochs-low", type=int, default=2, help="equal to --epochs-high: epochs not searched")
    parser.add_argument("--startup-trials", type=int, default=4, help="the median pruner's n_startup_trials")
    parser.add_argument("--warmup-epochs", type=int, default=0, help="the median pruner's n_warmup_steps")
    parser.add_argument("--data", choices=("fake", "photos"), default="fake")
    parser.add_argument("--photos", type=int, default=3000, help="--data photos: images in the set")
    parser.add_argument("--tint", type=float, default=0.2, help="--data photos: the class's colour shift")
    parser.add_argument("--val-fraction", type=float, default=0.15, help="--data photos: the validation split")
    parser.add_argument("--no-write-docs", action="store_true")
    args = parser.parse_args()
    load_before = load_average()
    stored = storage(args.storage_trials)
    swept = service(args.trials, args.workers, (args.epochs_low, args.epochs_high), SPACES[args.space],
                    startup_trials=args.startup_trials, warmup_epochs=args.warmup_epochs, data=args.data,
                    photos=args.photos, tint=args.tint, val_fraction=args.val_fraction)
    report = {"storage": stored, "service": swept, "host": machine(), "load_before": load_before,
              "load_after": load_average(), "args": vars(args)}
    print(json.dumps(report, indent=2))
    if args.no_write_docs:
        return
    med, none = swept["median"], swept["none"]
    saved = 1 - med["epochs_run"] / none["epochs_run"] if none["epochs_run"] else 0.0
    text = (f"`{' '.join(sys.argv)}` on {report['host']} (load average {load_before:.1f} before, "
            f"{report['load_after']:.1f} after: other work shared the cores).\n\n"
            "| study storage | ask + tell per trial | a fresh process opens the study |\n|---|---|---|\n"
            + "".join(f"| {name} | {s['ask_tell_ms']} ms | {s['open_ms']} ms ({s['trials_seen']} trials) |\n"
                      for name, s in stored.items())
            + "\n| pruner | trials | wall | device busy | epochs run | pruned | best val_accuracy |\n"
              "|---|---|---|---|---|---|---|\n"
            + "".join(f"| {name} | {args.trials} | {r['wall_s']} s | {100 * r['device_busy']:.1f} % | "
                      f"{r['epochs_run']} | {r['pruned']} | {r['best']} |\n" for name, r in swept.items())
            + f"\nThe median pruner ran {100 * saved:.0f} % fewer epochs than none at the same seed.\n\n")
    write_section("sweeps", "Sweeps (bench/sweep.py)", text)


if __name__ == "__main__":
    main()
